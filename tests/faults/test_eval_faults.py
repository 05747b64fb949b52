"""`rlinf-vla eval` under faults, on the toy env with the tiny OpenVLA, with real Ray workers
and real signals: an env worker that stops answering is named and the evaluation stops with
its reports written; Ctrl-C and SIGTERM stop it at once even while a call hangs.

Interrupted evaluations resuming to the same results, and crashed simulators retried:
tests/eval/test_run.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from rlinf_vla.runtime import WorkerStalled
from tests.faults.conftest import CliRun, process_gone, wait_until, worker_pids

STALL_MIN_S = 10  # see test_train_faults.py
SIGNAL_STALL_MIN_S = 60
TRIALS = 60
EVAL = [
    "env=toy",
    "policy=openvla",
    "env.success_radius=0.3",
    "env.step_size=0.2",
    f"eval.trials_per_task={TRIALS}",
    "env.num_envs=2",
    f"cluster.stall_min_s={STALL_MIN_S}",
]


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance the in-process evaluations of this module share."""
    from rlinf_vla.runtime import Cluster

    with Cluster(num_cpus=2) as c:
        yield c


def _recorded(folder: Path) -> int:
    path = folder / "trials.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _assert_reports_hold_every_recorded_trial(folder: Path, recorded: int) -> None:
    results = json.loads((folder / "results.json").read_text())
    assert results["planned"] == TRIALS
    assert len(results["trials"]) == recorded == _recorded(folder)
    assert f"Incomplete: {recorded} of {TRIALS}" in (folder / "summary.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("sent", ["SIGTERM", "Ctrl-C"])
def test_a_signal_stops_an_evaluation_hanging_on_a_stopped_worker_at_once(tmp_path, sent):
    out = tmp_path / "eval"
    # a stall deadline the signal beats on a loaded machine too (the stop is what is tested)
    job = CliRun(
        [
            "eval",
            *EVAL,
            "eval.progress=false",
            "cluster.num_cpus=2",
            f"eval.output_dir={out}",
            f"cluster.stall_min_s={SIGNAL_STALL_MIN_S}",
        ]
    )
    pid = job.worker("eval_env", 0)
    wait_until(lambda: _recorded(out) >= 3, job.job, "3 recorded trials")
    os.kill(pid, signal.SIGSTOP)
    time.sleep(2)  # the evaluation hangs on the stopped worker now
    if sent == "SIGTERM":
        job.job.send_signal(signal.SIGTERM)  # as a scheduler sends it: to the main process
    else:
        job.interrupt()
    code, err, seconds = job.finish()
    assert code == (143 if sent == "SIGTERM" else 130), err
    assert f"rlinf-vla eval: stopped by {sent}" in err
    assert "SIGTERM received" not in err  # no stack dump (and abort) from Ray's handler
    assert seconds < 20, f"{sent} took {seconds:.0f} s to stop the evaluation"
    recorded = re.search(rf"evaluation stopped: interrupted; (\d+) of {TRIALS} trials", err)
    assert recorded, err
    assert f"with eval.output_dir={out} runs the other" in err
    _assert_reports_hold_every_recorded_trial(out, int(recorded.group(1)))
    assert process_gone(pid), "the stopped worker was left behind"


@pytest.mark.slow
def test_a_stopped_env_worker_is_named_and_the_rerun_finishes_the_evaluation(ray_cluster, tmp_path):
    from rlinf_vla.eval import run
    from tests.eval.conftest import eval_job

    out = tmp_path / "eval"
    job = eval_job(*EVAL, f"eval.output_dir={out}")
    stopped: dict[str, float] = {}

    def stop_a_worker() -> None:
        # This process's Ray instance runs the workers: they descend from it.
        wait_until(lambda: 1 in worker_pids(os.getpid(), "eval_env"), None, "the env workers")
        wait_until(lambda: _recorded(out) >= 3, None, "3 recorded trials")
        stopped["pid"] = worker_pids(os.getpid(), "eval_env")[1]
        os.kill(stopped["pid"], signal.SIGSTOP)
        stopped["at"] = time.monotonic()

    stopper = threading.Thread(target=stop_a_worker, daemon=True)
    stopper.start()
    with pytest.raises(WorkerStalled) as caught:
        run(job)
    seconds = time.monotonic() - stopped["at"]
    stopper.join()
    error = caught.value
    assert (error.group, error.rank) == ("eval_env", 1)
    assert error.waiting[0].startswith("eval_env[1].")
    assert f"(pid {stopped['pid']} on " in str(error) and "the process is stopped" in str(error)
    assert STALL_MIN_S <= error.limit_s <= error.waited_s
    assert seconds < error.limit_s + 10, f"the stall was reported after {seconds:.0f} s"
    assert process_gone(stopped["pid"]), "the stopped worker was left behind"
    _assert_reports_hold_every_recorded_trial(out, _recorded(out))

    # Nothing recorded is lost or run twice: the same command finishes the plan.
    results = run(eval_job(*EVAL, f"eval.output_dir={out}"))
    assert results["suites"]["toy"]["trials"] == TRIALS
    lines = (out / "trials.jsonl").read_text().splitlines()
    keys = [(r["task"], r["init_state"]) for r in map(json.loads, lines)]
    assert len(keys) == len(set(keys)) == TRIALS
