"""`rlinf-vla train` under faults, on the toy env with the tiny OpenVLA, with real Ray workers
and real signals: a killed env worker, a stopped one, Ctrl-C while a call hangs. Each run is
continued with the command its console printed, and the last one finishes: every iteration
is in ``metrics.jsonl`` once.

SIGTERM on a running iteration and its resume: tests/pipelines/test_train.py
(``test_sigterm_stops_the_run_...``). Damaged checkpoints: tests/pipelines/test_checkpoints.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.faults.conftest import CliRun, checkpoint_done, process_gone, wait_until
from tests.run.test_checkpoints import SMALL

#: Seconds a call may take at least before it counts as stalled, in these runs (the default
#: is 120 s); every call of the toy run takes well under a second, 3 s under heavy load.
STALL_MIN_S = 10
#: ... and in the runs that a signal stops while a call hangs: longer than the signal takes
SIGNAL_STALL_MIN_S = 60
TRAIN = [
    "train",
    *SMALL,
    f"cluster.stall_min_s={STALL_MIN_S}",
    "cluster.stall_factor=5",
]


def _resume_hint(err: str, run: Path) -> tuple[int, str]:
    """The last checkpoint's iteration and the ``runner.resume=`` override the console printed."""
    checkpoint = re.search(r"last checkpoint: (\S+)", err)
    command = re.search(r"resume with: rlinf-vla train \.\.\. (runner\.resume=\S+)", err)
    assert checkpoint and command, err
    assert Path(checkpoint.group(1)).parent == run / "checkpoints"
    return int(checkpoint.group(1).rsplit("_", 1)[1]), command.group(1)


def _start(run: Path, resume: str | None, iterations: int = 1000, *more: str) -> CliRun:
    extra = [f"runner.output_dir={run}", f"runner.max_iterations={iterations}", *more]
    return CliRun([*TRAIN, *extra, *([resume] if resume else [])])


def _resumed_after(err: str) -> int:
    found = re.search(r"resuming after iteration (\d+) of", err)
    assert found, err
    return int(found.group(1))


@pytest.mark.slow
def test_killed_stopped_and_interrupted_runs_resume_from_the_checkpoint_they_name(tmp_path):
    run = tmp_path / "run"

    # 1. SIGKILL of the env worker: exit 1 naming the dead worker, and the resume hint.
    job = _start(run, None)
    pid = job.worker("env")
    wait_until(lambda: checkpoint_done(run, 2), job.job, "checkpoint 2")
    os.kill(pid, signal.SIGKILL)
    code, err, seconds = job.finish()
    assert code == 1, err
    assert re.search(r"WorkerError: worker env\[0\] on node \S+ failed in interact\(\)", err), err
    assert "the worker process died" in err
    assert seconds < 30, f"the run took {seconds:.0f} s to exit after its env worker died"
    done, resume = _resume_hint(err, run)
    assert done >= 2

    # 2. The printed command continues it; SIGSTOP of the env worker: the stalled call is
    # detected within its deadline, the stopped worker is named first, with its process id.
    job = _start(run, resume)
    pid = job.worker("env")
    wait_until(lambda: checkpoint_done(run, done + 2), job.job, f"checkpoint {done + 2}")
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    code, err, _ = job.finish()
    seconds = time.monotonic() - stopped
    assert _resumed_after(err) == done
    assert code == 1, err
    assert "rlinf-vla train: WorkerStalled: no answer from" in err
    first = err.split("WorkerStalled: ", 1)[1].splitlines()[1]
    # whichever of its calls the stop caught: mostly the rollout's interact(), sometimes the
    # memory reading after it
    assert re.search(rf"env\[0\]\.(interact|memory)\(\) \(pid {pid} on ", first), first
    assert "the process is stopped" in first
    deadline = re.search(r"has run (\d+) s, past its deadline of (\d+) s \(5 x the longest", err)
    assert deadline and int(deadline.group(1)) >= int(deadline.group(2)) >= STALL_MIN_S, err
    # Reported within the deadline of the call (it began before the stop), a poll, the shutdown.
    assert seconds < int(deadline.group(2)) + 30, f"stall reported after {seconds:.0f} s"
    assert process_gone(pid), "the stopped worker was left behind"
    done, resume = _resume_hint(err, run)

    # 3. Continued again; Ctrl-C while a call hangs on a stopped worker stops the run at once.
    # (A later stall deadline: on a loaded machine the call may have begun well before the
    # stop, and the stall must not end the run before the Ctrl-C does.)
    job = _start(run, resume, 1000, f"cluster.stall_min_s={SIGNAL_STALL_MIN_S}")
    pid = job.worker("env")
    wait_until(lambda: checkpoint_done(run, done + 1), job.job, f"checkpoint {done + 1}")
    os.kill(pid, signal.SIGSTOP)
    time.sleep(2)  # the next call is hanging now
    job.interrupt()
    code, err, seconds = job.finish()
    assert _resumed_after(err) == done
    assert code == 130, err
    assert re.search(r"training stopped in iteration \d+: interrupted", err), err
    assert "rlinf-vla train: stopped by Ctrl-C" in err
    assert seconds < 20, f"Ctrl-C took {seconds:.0f} s to stop the run"
    done, resume = _resume_hint(err, run)

    # 4. The last continuation finishes; no iteration is missing or repeated.
    job = _start(run, resume, iterations=done + 1)
    code, err, _ = job.finish()
    assert code == 0, err
    assert _resumed_after(err) == done
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, done + 2))
