"""How much memory a worker holds: resident RAM of its process tree, peak GPU memory.

Every :class:`~rlinf_vla.runtime.Worker` answers :meth:`~rlinf_vla.runtime.Worker.memory`;
the trainers log the largest value over each group's ranks as ``memory/<group>_<kind>_gib``
every iteration, so a run that creeps towards an out-of-memory error shows it in its metrics
before it happens, and which component is to blame; ``memory/total_rss_gib`` is what all the
run's workers hold together, the figure to size a machine by.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlinf_vla.runtime.cluster import child_processes

__all__ = [
    "group_memory_metrics",
    "process_tree_rss",
    "read_memory",
    "with_memory_hint",
    "worker_memory",
]

_GIB = 2**30


def _rss(pid: int) -> int:
    """Resident bytes of one process, a shared page counting for its share: the proportional
    set size (``Pss`` of ``/proc/<pid>/smaps_rollup``), or the plain resident set size where
    the kernel has no rollup (before Linux 4.14). 0 if the process ended meanwhile."""
    proc = Path("/proc") / str(pid)
    try:
        for line in (proc / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, IndexError, ValueError):
        pass
    try:
        resident = int((proc / "statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return resident * os.sysconf("SC_PAGE_SIZE")


def process_tree_rss(pid: int | None = None) -> float | None:
    """Resident memory in GiB of process ``pid`` (default: this one) and all its descendants
    (e.g. the simulator subprocesses of an env worker). A page shared by ``n`` processes counts
    ``1/n`` in each (proportional set size), so the sum counts it once: a forked subprocess's
    copy-on-write pages, and the torch and simulator libraries every worker maps, are not
    counted again per process. ``None`` where ``/proc`` is missing (not Linux)."""
    if not Path("/proc/self/statm").exists():
        return None
    pid = os.getpid() if pid is None else pid
    children = child_processes()
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, ()))
    return sum(_rss(p) for p in tree) / _GIB


#: Seconds for which :func:`worker_memory` reuses its process tree's resident memory. The
#: proportional set size makes the kernel walk every page table of a process: 27 ms for a
#: process with torch loaded and 30-32 ms for a ManiSkill simulator on the 2-core development
#: machine, 64 ms for an env worker of 4 envs with its two simulators. Read at the end of
#: every iteration of every worker, that is about 0.25 CPU-seconds per iteration of a
#: 2-worker ``collocated`` run of the tiny policy on ManiSkill (rollouts of 0.8 s), on a
#: machine of 2 cores.
RSS_REFRESH_S = 10.0

_last_rss: list[float] = []  # [time.monotonic() of the reading, GiB]


def worker_memory(device: object, refresh_s: float = RSS_REFRESH_S) -> dict[str, float]:
    """A worker's memory in GiB: ``rss`` (see :func:`process_tree_rss`; read again at most
    every ``refresh_s`` seconds, :data:`RSS_REFRESH_S`) and, on a CUDA ``device`` this process
    has used, ``gpu``: what torch has allocated there now (an offloaded model holds none), and
    ``gpu_peak``: the most it allocated since the previous call, which resets it."""
    out: dict[str, float] = {}
    now = time.monotonic()
    if _last_rss and now - _last_rss[0] < refresh_s:
        rss: float | None = _last_rss[1]
    else:
        rss = process_tree_rss()
        if rss is not None:
            _last_rss[:] = [now, rss]
    if rss is not None:
        out["rss"] = rss
    import torch

    if getattr(device, "type", None) == "cuda" and torch.cuda.is_initialized():
        out["gpu"] = torch.cuda.memory_allocated(device) / _GIB
        out["gpu_peak"] = torch.cuda.max_memory_allocated(device) / _GIB
        torch.cuda.reset_peak_memory_stats(device)
    return out


def read_memory(groups: Mapping[str, Any]) -> dict[str, list[dict[str, float]]]:
    """The :meth:`~rlinf_vla.runtime.Worker.memory` of every rank of ``groups`` (name ->
    worker group), read once per process: ranks that share a process (every group of
    ``placement=local``) get that process's one reading. Read again in the same process, the
    peak GPU memory would cover only the time since the first reading (which resets it), and
    the same process tree would be read once more."""
    from rlinf_vla.runtime.worker import wait_all

    first: dict[tuple[Any, Any], tuple[str, int]] = {}  # process -> the rank that reads it
    reader: dict[tuple[str, int], tuple[str, int]] = {}
    calls, asked = [], []
    for name, group in groups.items():
        mine = []
        for rank in range(group.world_size):
            process = group.process(rank)
            where = (process.host, process.pid) if process is not None else (name, rank)
            reader[name, rank] = first.setdefault(where, (name, rank))
            if reader[name, rank] == (name, rank):
                mine.append(rank)
        if mine:
            calls.append(group.memory(ranks=mine))
            asked.append((name, mine))
    readings: dict[tuple[str, int], dict[str, float]] = {}
    for (name, ranks), values in zip(asked, wait_all(calls), strict=True):
        readings.update({(name, r): v for r, v in zip(ranks, values, strict=True)})
    return {
        name: [readings[reader[name, r]] for r in range(group.world_size)]
        for name, group in groups.items()
    }


def group_memory_metrics(groups: Mapping[str, Sequence[Mapping[str, float]]]) -> dict[str, float]:
    """``memory/<group>_<kind>_gib``: the largest value over each group's ranks; and
    ``memory/total_rss_gib``: the resident memory of every rank of every group added up, each
    process once. Ranks that share a process share one reading (:func:`read_memory` hands each
    of them the same object), which counts once; resident memory counts a page that several
    processes map by its share in each (:func:`process_tree_rss`), so the sum is what the
    workers hold together, the driver and Ray's own processes aside.

    Args:
        groups: group name -> the :func:`worker_memory` of each rank.
    """
    metrics: dict[str, float] = {}
    for name, ranks in groups.items():
        for kind in sorted({k for r in ranks for k in r}):
            metrics[f"memory/{name}_{kind}_gib"] = max(r[kind] for r in ranks if kind in r)
    readings = {id(r): r for ranks in groups.values() for r in ranks if "rss" in r}
    if readings:
        metrics["memory/total_rss_gib"] = sum(r["rss"] for r in readings.values())
    return metrics


def with_memory_hint(
    error: Exception, memory: Mapping[str, Sequence[Mapping[str, float]]], iteration: int
) -> Exception:
    """``error`` with the dead worker's last memory reading added, when it is a
    :class:`~rlinf_vla.runtime.WorkerError` for a worker process that died (the kernel's or
    Ray's out-of-memory killer leaves just that). Any other error comes back unchanged.

    Args:
        memory: group name -> the :func:`worker_memory` of each rank, read after ``iteration``.
    """
    from rlinf_vla.runtime.worker import WorkerError

    if not isinstance(error, WorkerError) or not error.died:
        return error
    ranks = memory.get(error.group, ())
    if error.rank >= len(ranks):
        return error
    reading = ranks[error.rank]
    parts = [f"{reading['rss']:.1f} GiB resident"] if "rss" in reading else []
    if "gpu_peak" in reading:
        parts.append(f"{reading['gpu_peak']:.1f} GiB GPU peak")
    if not parts:
        return error
    hint = (
        f"\n(after iteration {iteration} this worker held {', '.join(parts)}; a process killed "
        "for memory dies like this: see the memory/* metrics, and lower the envs or the batch "
        "per worker, or give the component more devices)"
    )
    return WorkerError(
        error.group, error.rank, error.node, error.method, error.remote_traceback + hint, died=True
    )
