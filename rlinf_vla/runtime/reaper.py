"""A watcher that stops the local Ray instance's processes when the process that started it dies.

``ray.shutdown()`` stops them when the driver exits normally. A driver killed outright
(``SIGKILL``, the out-of-memory killer) runs no exit code: Ray's GCS and raylet end soon after,
but the agents the raylet started (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) outlive
them, re-parented to init, and hold memory until the machine restarts.

:func:`watch` starts a small process that reads a pipe from the driver: it learns the Ray
processes' tree every second (the node's processes and all their descendants, each with its
start time, so a reused process id is never taken for one of them) and, when the pipe closes
(the driver exited, however), kills every process of that tree still alive. On Linux only
(it reads ``/proc``); elsewhere it does nothing.
"""

from __future__ import annotations

import subprocess
import sys
from typing import IO

#: The watcher's program (run with ``python -c``; the node's process ids as arguments).
_PROGRAM = r"""
import os, select, signal, sys

roots = {int(p) for p in sys.argv[1:]}

def table():
    # pid -> (parent pid, start time) of every process
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        out[int(d)] = (int(fields[1]), fields[19])
    return out

def tree(procs):
    children = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    seen, stack = set(), [p for p in roots if p in procs]
    while stack:
        pid = stack.pop()
        if pid not in seen:
            seen.add(pid)
            stack.extend(children.get(pid, []))
    return {(pid, procs[pid][1]) for pid in seen}

known = set()
while True:
    ready, _, _ = select.select([sys.stdin], [], [], 1.0)
    known |= tree(table())
    if ready and not os.read(sys.stdin.fileno(), 1):
        break  # the driver closed the pipe or died
procs = table()
for pid, started in known:
    if pid in procs and procs[pid][1] == started and pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""


class Reaper:
    """The watcher of one Ray instance; :meth:`close` ends it (the driver is done with Ray)."""

    def __init__(self, process: subprocess.Popen[bytes] | None) -> None:
        self.process = process

    def close(self) -> None:
        """Close the pipe: the watcher kills what is left of the instance and exits."""
        if self.process is None:
            return
        pipe: IO[bytes] | None = self.process.stdin
        if pipe is not None:
            pipe.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.process = None


def node_pids() -> list[int]:
    """The process ids of the local Ray instance this process started (GCS, raylet, their
    monitors); ``[]`` when there is none or Ray does not say."""
    try:
        import ray

        node = ray._private.worker._global_node  # the instance ray.init started here
        return [int(p.process.pid) for procs in node.all_processes.values() for p in procs]
    except Exception:  # a Ray version without these attributes: no watcher
        return []


def watch(pids: list[int]) -> Reaper:
    """Start the watcher of the processes ``pids`` and their descendants (module docstring)."""
    if not pids or not sys.platform.startswith("linux"):
        return Reaper(None)
    process = subprocess.Popen(
        [sys.executable, "-c", _PROGRAM, *map(str, pids)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the driver's process group: a Ctrl-C does not stop it
        close_fds=True,
    )
    return Reaper(process)


__all__ = ["Reaper", "node_pids", "watch"]
