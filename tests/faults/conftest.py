"""Helpers of the fault tests: runs of the real CLI in a process of their own (a session of its
own, so that a Ctrl-C can be sent to all of it as a terminal does), and the ids of their Ray
worker processes, found through ``/proc`` (a worker's environment names its group and rank)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("MS_SKIP_ASSET_DOWNLOAD_PROMPT", "1")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _descends_from(pid: int, root: int) -> bool:
    while pid > 1:
        try:
            pid = _parent(pid)
        except (OSError, ValueError, IndexError):
            return False
        if pid == root:
            return True
    return False


def worker_pids(root: int, group: str) -> dict[int, int]:
    """rank -> process id of the Ray workers of ``group`` started under process ``root`` (the
    driver: the local Ray instance it starts is its child). Other users' and other runs'
    workers are not descendants of ``root``."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if env.get(b"RLINF_VLA_GROUP") == group.encode() and _descends_from(int(entry), root):
            found[int(env[b"RLINF_VLA_RANK"])] = int(entry)
    return found


def wait_until(condition: Callable[[], bool], job: subprocess.Popen | None, what: str) -> None:
    """Wait (at most 300 s) until ``condition()``; fails at once if ``job`` exits first."""
    deadline = time.monotonic() + 300
    while not condition():
        if job is not None and job.poll() is not None:
            _, err = job.communicate()
            pytest.fail(f"the run exited with {job.returncode} before {what}:\n{err[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} after 300 s"
        time.sleep(0.2)


def process_gone(pid: int, within_s: float = 10) -> bool:
    """Whether process ``pid`` has exited (a zombie, not yet reaped, counts) within
    ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def checkpoint_done(run: Path, iteration: int) -> bool:
    return (run / "checkpoints" / f"iter_{iteration}" / "COMPLETE").exists()


def _sigint_as_in_a_terminal() -> None:
    """In the child, before it runs the CLI: SIGINT's default action, as a terminal's foreground
    command has it. A shell without job control starts a background command (``cmd &``,
    ``nohup``) with SIGINT ignored, its children inherit that, and Python then installs no
    ``KeyboardInterrupt`` handler: with the suite started that way every Ctrl-C these tests
    send would be ignored (the runs then end at their stall deadline, exit 1)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class CliRun:
    """``rlinf-vla <args>`` in a new session, SIGINT handled as in a terminal's foreground
    command; :meth:`finish` waits for it."""

    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.job = subprocess.Popen(
            [sys.executable, "-m", "rlinf_vla.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=_sigint_as_in_a_terminal,
        )
        self.pid = self.job.pid

    def worker(self, group: str, rank: int = 0) -> int:
        """The process id of worker ``group[rank]`` (waiting until it exists)."""
        found: dict[int, int] = {}

        def started() -> bool:
            found.update(worker_pids(self.pid, group))
            return rank in found

        wait_until(started, self.job, f"a {group}[{rank}] worker")
        return found[rank]

    def finish(self, timeout: float = 240) -> tuple[int, str, float]:
        """Exit code, stderr and the seconds it took to exit from this call on."""
        start = time.monotonic()
        try:
            _, err = self.job.communicate(timeout=timeout)
        finally:
            self.kill()
        return self.job.returncode, err, time.monotonic() - start

    def interrupt(self) -> None:
        """Ctrl-C as a terminal sends it: SIGINT to every process of the session."""
        os.killpg(self.pid, signal.SIGINT)

    def kill(self) -> None:
        """SIGKILL whatever of the session is left (after a failed assertion)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.job.wait()
