"""Stall detection: a deadline for every worker call, derived from the calls measured before it.

A worker that stops answering (a process stopped with ``SIGSTOP``, a simulator deadlocked, a
node frozen) does not raise anything: without a deadline the driver would wait until Ray's
health checks give up on the process, minutes later, or forever. So every call of a group gets
a deadline: once a method of a group has returned at least once, a later call of that method is
*stalled* when it runs longer than ``factor`` times the longest call of it seen so far, and
longer than ``min_s``::

    limit = max(min_s, factor * longest earlier call of this method of this group)

The first call of each method sets the scale and has no deadline (it often includes
compilation, simulator start-up or cache warm-up). A worker's start (its ``__init__``) has the
fixed limit ``start_timeout_s`` instead. :func:`~rlinf_vla.runtime.wait_all` checks the
deadlines while it waits and raises :class:`~rlinf_vla.runtime.WorkerStalled` naming the workers that have not
answered, with their process id, host and, on the driver's host, the process state (a stopped
process is named as such).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class StallPolicy:
    """How long a worker call may take (see the module docstring).

    Attributes:
        factor: a call is stalled after ``factor`` x the longest earlier call of its method
            (``None``: calls have no deadline).
        min_s: and never before this many seconds.
        start_timeout_s: seconds every worker of a group may take to start (``None``: no limit).
    """

    factor: float | None = 5.0
    min_s: float = 120.0
    start_timeout_s: float | None = 600.0

    def limit(self, longest: float | None) -> float | None:
        """Seconds a call may run, given the longest earlier call of its method (``None``:
        none returned yet, or no deadline at all)."""
        if self.factor is None or longest is None:
            return None
        return max(self.min_s, self.factor * longest)

    def explain(self, method: str, longest: float) -> str:
        """How a deadline of ``method`` came about, naming the keys that set it."""
        return (
            f"{self.factor:g} x the longest earlier {method}() ({longest:.1f} s), at least "
            f"{self.min_s:g} s: cluster.stall_factor, cluster.stall_min_s"
        )


@dataclass(frozen=True)
class Process:
    """Where a worker runs: its process id and host name."""

    pid: int
    host: str

    @staticmethod
    def this() -> Process:
        return Process(os.getpid(), socket.gethostname())

    def describe(self) -> str:
        """``pid 123 on host-a``, plus the process state when it is on this host and not
        running or sleeping (stopped, gone, a zombie, a stopped subprocess...)."""
        text = f"pid {self.pid} on {self.host}"
        state = self.state()
        return text if state is None else f"{text}, {state}"

    def state(self) -> str | None:
        """The process state in words when it matters, read from ``/proc``: the process's own,
        else that of a stopped subprocess (a simulator). ``None``: another host, or running /
        sleeping as an answering process does."""
        if self.host != socket.gethostname():
            return None
        code = _state_code(self.pid)
        if code is None:
            return "the process is gone"
        if code in _STATES:
            return _STATES[code]
        stopped = [child for child in _children(self.pid) if _state_code(child) == "T"]
        if stopped:
            return f"its subprocess {', '.join(map(str, stopped))} is stopped ({_SIGCONT})"
        return None

    def stopped_pids(self) -> list[int]:
        """This process and its subprocesses that are stopped (on this host): they cannot act
        on a request to exit, nor notice that their parent died."""
        if self.host != socket.gethostname():
            return []
        family = [self.pid, *_children(self.pid)]
        return [pid for pid in family if _state_code(pid) in ("T", "t")]


_SIGCONT = "SIGSTOP / SIGTSTP; SIGCONT resumes it"
_STATES = {
    "T": f"the process is stopped ({_SIGCONT})",
    "t": "the process is stopped by a debugger",
    "Z": "the process is a zombie (it exited)",
    "X": "the process is gone",
    "D": "the process is in an uninterruptible wait (disk, network file system)",
}


def _state_code(pid: int) -> str | None:
    """The one-letter state of process ``pid`` (``None``: there is no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # "pid (comm) S ...": the state follows the last parenthesis.
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    """The direct subprocesses of ``pid`` (empty where ``/proc`` does not list them)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []
