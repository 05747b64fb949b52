"""Workers and worker groups: N Ray actors of one class, called together, failing loudly.

Subclass :class:`Worker`, then launch a group of it on some devices::

    class Doubler(Worker):
        def __init__(self, factor: int):
            self.factor = factor

        def run(self, x):
            return self.factor * x + self.rank

    group = WorkerGroup(cluster, Doubler, name="doubler", devices=[0, 1], args=(2,))
    group.run(10).wait()            # [20, 21]
    group.run(10, ranks=[1]).wait()  # [21]

Every worker knows its ``rank``, ``world_size``, ``group_name``, ``node_id`` and ``device``
before its ``__init__`` runs. Calls return a :class:`GroupResult` future; the first exception
raised in any worker surfaces in the driver as one :class:`WorkerError` naming the group, the
rank, the node and carrying the remote traceback. A worker process that dies is reported the
same way, never as a hang, and so is one that stops answering: every call has a deadline
derived from the earlier calls of its method (:mod:`rlinf_vla.runtime.stall`), past which
:class:`WorkerStalled` names the workers that have not answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import socket
import time
import traceback
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rlinf_vla.runtime.cluster import Cluster, Device, raised_by_signal
from rlinf_vla.runtime.stall import Process, StallPolicy

W = TypeVar("W", bound="Worker")

#: Longest single wait on Ray inside :func:`wait_all`, in seconds: deadlines are checked and
#: Ctrl-C is handled at least this often.
POLL_S = 0.5


class WorkerError(RuntimeError):
    """An exception raised in (or the death of) a worker, as seen from the driver.

    Attributes:
        group: the worker group's name.
        rank: the failing worker's rank in its group.
        node: the IP address of the worker's node.
        method: the method that failed.
        remote_traceback: the formatted traceback from the worker process.
        died: the worker process itself died (killed, crashed, out of memory) rather than
            raising an exception; ``remote_traceback`` then holds what Ray said of it.
    """

    def __init__(
        self,
        group: str,
        rank: int,
        node: str,
        method: str,
        remote_traceback: str,
        died: bool = False,
    ):
        self.group, self.rank, self.node = group, rank, node
        self.method, self.remote_traceback, self.died = method, remote_traceback, died
        super().__init__(
            f"worker {group}[{rank}] on node {node} failed in {method}():\n"
            f"{remote_traceback.rstrip()}"
        )

    def __reduce__(self):  # picklable across processes
        args = (self.group, self.rank, self.node, self.method, self.remote_traceback, self.died)
        return (WorkerError, args)


class WorkerStalled(WorkerError):
    """Workers that did not answer a call within its deadline (see
    :class:`~rlinf_vla.runtime.stall.StallPolicy`). A stalled call raises nothing by itself:
    this is the driver giving up on it.

    Attributes (``group``, ``rank``, ``node``, ``method``: the first stalled worker, a stopped
    process first):
        message: the workers that have not answered, their processes, and the deadline's rule.
        waiting: ``group[rank].method`` of every call that had not answered, stalled ones first.
        waited_s: how long the first stalled call had run.
        limit_s: its deadline in seconds.
    """

    def __init__(
        self,
        group: str,
        rank: int,
        node: str,
        method: str,
        message: str,
        waiting: list[str],
        waited_s: float,
        limit_s: float,
    ):
        RuntimeError.__init__(self, message)
        self.group, self.rank, self.node, self.method = group, rank, node, method
        self.remote_traceback, self.died = "", False
        self.message, self.waiting, self.waited_s, self.limit_s = (
            message,
            waiting,
            waited_s,
            limit_s,
        )

    def __reduce__(self):
        args = (self.group, self.rank, self.node, self.method, self.message, self.waiting)
        return (WorkerStalled, (*args, self.waited_s, self.limit_s))


@dataclass(frozen=True)
class WorkerContext:
    """What a worker knows about where it runs."""

    group_name: str
    rank: int
    world_size: int
    device: Device
    #: built in the driver's process (:mod:`rlinf_vla.runtime.local`), which sees every GPU
    in_process: bool = False
    #: the workers of the group on this worker's node, itself included (they share its cores)
    node_world_size: int = 1


def node_world_sizes(devices: Sequence[Device]) -> list[int]:
    """For each of ``devices`` (a group's, by rank), how many of them are on its node."""
    per_node = Counter(d.node_id for d in devices)
    return [per_node[d.node_id] for d in devices]


@dataclass(frozen=True)
class _Failure:
    """Returned by a worker host instead of raising, so the driver can name the worker."""

    method: str
    traceback: str


class Worker:
    """Base class of every worker. Public methods are callable on a :class:`WorkerGroup`.

    Attributes available in ``__init__`` and every method:
        rank, world_size, group_name: the worker's place in its group.
        node_world_size: the workers of its group on its node, itself included.
        device_info: the :class:`Device` it was placed on.
        device: the ``torch.device`` to put tensors on (``cuda:0`` or ``cpu``; each worker
            sees only its own GPU).
        node_id, node_ip: the Ray node the worker runs on.
        logger: a logger named after the worker.
    """

    _ctx: WorkerContext

    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._ctx.world_size

    @property
    def group_name(self) -> str:
        return self._ctx.group_name

    @property
    def node_world_size(self) -> int:
        return self._ctx.node_world_size

    @property
    def device_info(self) -> Device:
        return self._ctx.device

    @property
    def device(self):
        import torch

        if self._ctx.device.kind == "cuda" and torch.cuda.is_available():
            # a Ray worker sees only its GPU (CUDA_VISIBLE_DEVICES); a local one sees them all
            return torch.device("cuda", self._ctx.device.local_index if self._ctx.in_process else 0)
        return torch.device("cpu")

    @property
    def node_id(self) -> str:
        return self._ctx.device.node_id

    @property
    def node_ip(self) -> str:
        return self._ctx.device.node_ip

    @property
    def logger(self) -> logging.Logger:
        return logging.getLogger(f"rlinf_vla.worker.{self.group_name}.{self.rank}")

    def memory(self) -> dict[str, float]:
        """This worker's memory in GiB: ``rss``, the resident RAM of its process and its
        subprocesses, and on a GPU ``gpu`` (allocated now) and ``gpu_peak`` (the most
        allocated since the previous call); see :mod:`rlinf_vla.runtime.memory`."""
        from rlinf_vla.runtime.memory import worker_memory

        return worker_memory(self.device)

    def collective(self, name: str):
        """The :class:`~rlinf_vla.runtime.collective.Collective` named ``name`` this worker joined."""
        from rlinf_vla.runtime import collective

        # a worker of a local group holds its own (rlinf_vla.runtime.local)
        return collective.get(name, self.__dict__.get("_local_collectives"))


class _WorkerHost:
    """The Ray actor behind each worker: builds the user's object and runs its methods.

    Exceptions are turned into :class:`_Failure` values carrying the traceback, so the driver
    can report them with the worker's name instead of Ray's generic wrapping.
    """

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def init(self, cls: type[Worker], ctx: WorkerContext, args: tuple, kwargs: dict) -> Any:
        """Build the worker; returns its :class:`~rlinf_vla.runtime.stall.Process`."""

        def build() -> Process:
            if ctx.device.threads is not None:
                # Ray starts the process with OMP_NUM_THREADS=1; a CPU slot of several cores
                # computes with all of them (subprocesses keep the variable: one thread).
                import torch

                torch.set_num_threads(ctx.device.threads)
            worker = cls.__new__(cls)
            worker._ctx = ctx
            worker.__init__(*args, **kwargs)
            self.worker = worker
            return Process.this()

        return guarded(f"{cls.__name__}.__init__", build)

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        return guarded(method, invoke, self.worker, method, args, kwargs)

    def join_collective(self, *args: Any) -> Any:
        from rlinf_vla.runtime import collective

        return guarded("join_collective", collective.join, *args)

    def free_port(self) -> tuple[str, int]:
        """An IP address of this node and a TCP port free on it (for rendezvous)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]


def _channel_host_class() -> type:
    """:class:`_WorkerHost` that can also keep channels' queues (``WorkerGroup(channels=True)``):
    its ``channel_call`` runs in the concurrency group ``channel``, threads of its own beside
    the worker's calls, so a put or get is answered while the worker computes."""
    global _CHANNEL_HOST
    if _CHANNEL_HOST is None:
        import ray

        from rlinf_vla.runtime.channel import hosted_call

        class _ChannelHost(_WorkerHost):
            @ray.method(concurrency_group="channel")
            def channel_call(self, name: str, op: str, *arg: Any) -> Any:
                return hosted_call(name, op, *arg)

        _CHANNEL_HOST = _ChannelHost
    return _CHANNEL_HOST


_CHANNEL_HOST: type | None = None


def invoke(worker: Worker, method: str, args: tuple, kwargs: dict) -> Any:
    """``worker.method(*args, **kwargs)``; a coroutine method is run to completion."""
    result = getattr(worker, method)(*args, **kwargs)
    return asyncio.run(_await(result)) if inspect.isawaitable(result) else result


def guarded(label: str, fn: Any, *args: Any) -> Any:
    """Run ``fn``; an exception becomes a :class:`_Failure` carrying its traceback."""
    try:
        return fn(*args)
    except BaseException as e:
        tb = traceback.TracebackException.from_exception(e)
        # Drop this module's own frames: the user's code is what matters.
        tb.stack = traceback.StackSummary.from_list([f for f in tb.stack if f.filename != __file__])
        return _Failure(label, "".join(tb.format()))


async def _await(awaitable):
    return await awaitable


class GroupResult:
    """Futures of one call on some ranks of a group.

    ``wait()`` returns the results in rank order; ``done()`` polls; ``await result`` works in
    async code. ``limit_s``: seconds the call may run before :func:`wait_all` reports it as
    stalled (``None``: no deadline); ``issued``: when it was made (``time.monotonic()``).
    """

    def __init__(
        self,
        group: WorkerGroup,
        method: str,
        ranks: list[int],
        refs: list[Any],
        limit_s: float | None = None,
    ):
        self.group, self.method, self.ranks, self.refs = group, method, ranks, refs
        self.limit_s = limit_s
        self.issued = time.monotonic()

    def done(self) -> bool:
        if self.refs and isinstance(self.refs[0], Future):  # a local group's
            return all(f.done() for f in self.refs)
        import ray

        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Block until every rank returned.

        Raises:
            WorkerError: the first failure (exception or dead worker) in completion order,
                as soon as it happens, without waiting for the other ranks.
            WorkerStalled: a rank did not answer within the call's deadline.
            TimeoutError: ``timeout`` seconds passed; names the ranks still running.
        """
        return wait_all([self], timeout=timeout)[0]

    def __await__(self):
        return asyncio.to_thread(self.wait).__await__()

    def __repr__(self) -> str:
        return f"GroupResult({self.group.name}.{self.method}, ranks={self.ranks})"


def wait_all(results: Sequence[GroupResult], timeout: float | None = None) -> list[list[Any]]:
    """Wait for several group calls at once; the first failure in any of them is raised.

    Waiting on all concurrent calls together matters: when one group fails while another
    blocks on it (say, on a channel), the failure surfaces instead of a hang. Each returned
    call's duration is recorded for its method's deadline (:mod:`rlinf_vla.runtime.stall`).

    Raises:
        WorkerError: the first failure, as soon as it happens.
        WorkerStalled: a call ran past its deadline; names every worker not yet answered.
        TimeoutError: ``timeout`` seconds passed; names the calls still running.
    """
    owner: dict[Any, tuple[GroupResult, int]] = {}
    for result in results:
        for rank, ref in zip(result.ranks, result.refs, strict=True):
            owner[ref] = (result, rank)
    pending = list(owner)
    values: dict[Any, Any] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        # Short waits: a stalled call is noticed, and Ctrl-C handled, within POLL_S.
        wait_s = POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic()))
        try:
            ready, pending = _wait_one(pending, wait_s)
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM in Ray's disguise
            raise raised_by_signal(e) from None
        now = time.monotonic()
        if not ready:
            if deadline is not None and now >= deadline:
                still = ", ".join(
                    f"{r.group.name}[{rank}].{r.method}" for r, rank in map(owner.get, pending)
                )
                raise TimeoutError(f"no result after {timeout} s from: {still}")
            late = [
                ref
                for ref in pending
                if owner[ref][0].limit_s is not None
                and now - owner[ref][0].issued > owner[ref][0].limit_s
            ]
            if late:
                raise _stalled([owner[ref] for ref in late], [owner[ref] for ref in pending], now)
            continue
        ref = ready[0]
        result, rank = owner[ref]
        values[ref] = _unwrap(result, rank, ref)
        result.group._observe(result.method, now - result.issued)
    return [[values[ref] for ref in result.refs] for result in results]


def _wait_one(pending: list[Any], timeout: float) -> tuple[list[Any], list[Any]]:
    """At most one finished call of ``pending`` (Ray object refs, or the futures of local
    groups) within ``timeout`` seconds: ``(ready, still pending)``."""
    local = [ref for ref in pending if isinstance(ref, Future)]
    if not local:
        import ray

        return ray.wait(pending, num_returns=1, timeout=timeout)
    if len(local) != len(pending):
        raise TypeError("wait_all: cannot wait on Ray and local worker groups together")
    done, _ = futures_wait(local, timeout=timeout, return_when=FIRST_COMPLETED)
    first = next((ref for ref in pending if ref in done), None)
    return ([], pending) if first is None else ([first], [r for r in pending if r is not first])


def _stalled(
    late: list[tuple[GroupResult, int]], pending: list[tuple[GroupResult, int]], now: float
) -> WorkerStalled:
    """The :class:`WorkerStalled` for the calls ``late`` (past their deadline) among those
    ``pending``. Every pending worker is named, a stopped process first (the likely cause: the
    others may just be waiting for it), then the late calls, in the order they were made."""

    def stopped(item: tuple[GroupResult, int]) -> bool:
        process = item[0].group.process(item[1])
        return process is not None and "stopped" in (process.state() or "")

    def who(item: tuple[GroupResult, int]) -> str:
        result, r = item
        process = result.group.process(r)
        where = f"node {result.group.devices[r].node_ip}" if process is None else process.describe()
        return f"{result.group.name}[{r}].{result.method}() ({where})"

    named = sorted(pending, key=lambda item: (not stopped(item), item not in late))
    trigger = late[0][0]
    waited = now - trigger.issued
    if trigger.method == "__init__":
        rule = "the start timeout, cluster.start_timeout_s"
    else:
        longest = trigger.group._longest.get(trigger.method, 0.0)
        rule = trigger.group.stall.explain(trigger.method, longest)
    message = (
        f"no answer from {len(named)} worker call(s): {trigger.group.name}.{trigger.method}() "
        f"has run {waited:.0f} s, past its deadline of {trigger.limit_s:.0f} s ({rule})\n"
        + "\n".join(f"  {who(item)}" for item in named)
    )
    head, rank = named[0]
    return WorkerStalled(
        head.group.name,
        rank,
        head.group.devices[rank].node_ip,
        head.method,
        message,
        [f"{r.group.name}[{k}].{r.method}" for r, k in named],
        waited,
        trigger.limit_s,
    )


def wait_started(groups: Sequence[WorkerGroup], timeout: float | None = None) -> None:
    """Wait until every worker of ``groups`` (launched with ``wait=False``) has started.

    The workers' ``__init__`` run concurrently. If one fails, every group is shut down and its
    :class:`WorkerError` is raised; one that takes longer than its group's start timeout
    raises :class:`WorkerStalled`. ``timeout``: an overall limit on top (``TimeoutError``).
    """
    pending = [g for g in groups if g._starting is not None]
    if not pending:
        return
    try:
        started = wait_all([g._starting for g in pending], timeout=timeout)
    except BaseException:
        for g in groups:
            g.shutdown()
        raise
    for g, processes in zip(pending, started, strict=True):
        g._processes = processes
        g._starting = None


def _unwrap(result: GroupResult, rank: int, ref: Any) -> Any:
    group = result.group
    node = group.devices[rank].node_ip
    if isinstance(ref, Future):  # a local group's call: it returns a value or a _Failure
        value = ref.result()
        if isinstance(value, _Failure):
            raise WorkerError(group.name, rank, node, value.method, value.traceback)
        return value
    import ray
    from ray.exceptions import OutOfMemoryError, RayActorError, RayTaskError

    try:
        value = ray.get(ref)
    except OutOfMemoryError as e:  # Ray's memory monitor killed the process
        said = str(e).strip().splitlines()
        raise WorkerError(
            group.name,
            rank,
            node,
            result.method,
            "the worker process was killed for lack of memory on its node"
            + (f": {said[0]}" if said else ""),
            died=True,
        ) from None
    except RayActorError as e:
        raise WorkerError(
            group.name, rank, node, result.method, f"the worker process died: {e}", died=True
        ) from None
    except RayTaskError as e:  # an error outside the host's try (e.g. unpicklable arguments)
        raise WorkerError(group.name, rank, node, result.method, str(e)) from None
    if isinstance(value, _Failure):
        raise WorkerError(group.name, rank, node, value.method, value.traceback)
    return value


def split_evenly(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """``items`` in ``parts`` contiguous slices whose sizes differ by at most one (the first
    ``len(items) % parts`` get the extra item; some are empty when ``parts > len(items)``)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(list(items[start:end]))
        start = end
    return out


class GroupBase:
    """What every worker group offers, whoever runs its workers (Ray actors here, threads in
    :class:`~rlinf_vla.runtime.local.LocalGroup`): calls by method name on some or all
    ranks, returning :class:`GroupResult` futures with deadlines. A subclass sets ``name``,
    ``worker_cls``, ``devices``, ``stall``, ``_longest``, ``_processes`` and ``_starting``,
    and defines ``world_size`` and ``_submit``."""

    name: str
    worker_cls: type
    devices: list[Device]
    stall: StallPolicy
    _longest: dict[str, float]
    _processes: list[Process] | None
    _starting: GroupResult | None

    def _place(self, cluster: Any, worker_cls: type, name: str, devices: Iterable[int]) -> None:
        """Check ``worker_cls`` and ``devices`` and set what every group holds."""
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"{worker_cls!r} is not a subclass of rlinf_vla.runtime.Worker")
        self.name, self.worker_cls = name, worker_cls
        self.devices = [cluster.device(i) for i in devices]
        if not self.devices:
            raise ValueError(f"worker group {name!r} has no devices")
        self.stall = cluster.stall
        self._longest = {}  # method -> its longest call so far, in seconds
        self._processes = None  # known once the workers started

    @property
    def world_size(self) -> int:
        raise NotImplementedError

    def _submit(self, method: str, ranks: list[int], args: tuple, kwargs: dict) -> list[Any]:
        """Start ``method`` on ``ranks``; one future (or Ray object ref) per rank."""
        raise NotImplementedError

    def call(
        self, method: str, *args: Any, ranks: Iterable[int] | None = None, **kwargs: Any
    ) -> GroupResult:
        """Call ``method(*args, **kwargs)`` on ``ranks`` (default: all); returns futures."""
        self._check_method(method)
        self._wait_started()
        chosen = list(range(self.world_size)) if ranks is None else list(ranks)
        bad = [r for r in chosen if not 0 <= r < self.world_size]
        if bad:
            raise IndexError(
                f"worker group {self.name!r} has ranks 0-{self.world_size - 1}, not {bad}"
            )
        refs = self._submit(method, chosen, args, kwargs)
        return GroupResult(
            self, method, chosen, refs, limit_s=self.stall.limit(self._longest.get(method))
        )

    def scatter(
        self, method: str, *items: Sequence[Any], args: tuple = (), **kwargs: Any
    ) -> list[Any]:
        """Share the work in ``items`` (sequences of one length) over the ranks and wait.

        Each sequence is cut by :func:`split_evenly` into ``world_size`` contiguous shares;
        rank ``r`` runs ``method(*shares_r, *args, **kwargs)``, all ranks at once. Ranks whose
        share is empty are not called. Returns the called ranks' results in rank order.
        """
        lengths = {len(x) for x in items}
        if len(lengths) > 1:
            raise ValueError(f"scatter({method!r}): the sequences differ in length: {lengths}")
        shares = [split_evenly(x, self.world_size) for x in items]
        calls = [
            self.call(method, *(s[r] for s in shares), *args, ranks=[r], **kwargs)
            for r in range(self.world_size)
            if not items or shares[0][r]
        ]
        return [result for c in calls for result in c.wait()]

    def __getattr__(self, method: str):
        if method.startswith("_") or "worker_cls" not in self.__dict__:
            raise AttributeError(method)
        self._check_method(method)

        def bound(*args: Any, ranks: Iterable[int] | None = None, **kwargs: Any) -> GroupResult:
            return self.call(method, *args, ranks=ranks, **kwargs)

        bound.__name__ = method
        return bound

    def _check_method(self, method: str) -> None:
        if method.startswith("_") or not callable(getattr(self.worker_cls, method, None)):
            raise AttributeError(f"{self.worker_cls.__name__} has no public method {method!r}")

    def _wait_started(self) -> None:
        if self._starting is not None:
            wait_started([self])

    def process(self, rank: int) -> Process | None:
        """The process id and host of a rank (``None`` until the workers have started)."""
        return None if self._processes is None else self._processes[rank]

    def _observe(self, method: str, seconds: float) -> None:
        """Record a returned call's duration, which sets the deadline of later calls."""
        if method != "__init__":
            self._longest[method] = max(seconds, self._longest.get(method, 0.0))


class WorkerGroup(GroupBase, Generic[W]):
    """N workers of one :class:`Worker` subclass, placed on devices, called together.

    Args:
        cluster: the cluster to launch on.
        worker_cls: the :class:`Worker` subclass.
        name: the group's name (used in errors, logs and Ray actor names).
        devices: global device indices (see ``cluster.devices``), one entry per worker;
            repeat an index to put several workers on one device.
        args, kwargs: passed to every worker's ``__init__``.
        env_vars: extra environment variables for the worker processes.
        max_concurrency: how many calls one worker may run at once (1: strictly in order).
        channels: the workers can host channels' queues (``Channel.create(..., host=
            group.actor(rank))``), answered in up to ``MAX_BLOCKED_CALLS`` threads of their own.
        timeout: seconds each worker may take to start (``None``: the cluster's
            ``start_timeout_s``); a worker that takes longer raises :class:`WorkerStalled`.
        wait: wait here until every worker's ``__init__`` has returned (the default). With
            ``wait=False`` the constructor returns once the workers are launched; pass several
            such groups to :func:`wait_started` to let their ``__init__`` run at the same time
            (a worker's start is mostly imports and building models). The first call on a group
            whose start was not waited for waits for it.

    A public method ``m`` of the worker class is called on all ranks as ``group.m(...)``, or
    on some ranks as ``group.m(..., ranks=[0, 2])``; ``group.call("m", ...)`` is the same.

    Every call has a deadline from the cluster's :class:`~rlinf_vla.runtime.stall.StallPolicy`
    and the longest earlier call of its method (none for a method's first call).
    """

    def __init__(
        self,
        cluster: Cluster,
        worker_cls: type[W],
        name: str,
        devices: Iterable[int],
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        env_vars: dict[str, str] | None = None,
        max_concurrency: int = 1,
        channels: bool = False,
        timeout: float | None = None,
        wait: bool = True,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from rlinf_vla.runtime.channel import MAX_BLOCKED_CALLS

        self._place(cluster, worker_cls, name, devices)
        host_cls = (
            ray.remote(concurrency_groups={"channel": MAX_BLOCKED_CALLS})(_channel_host_class())
            if channels
            else ray.remote(_WorkerHost)
        )
        self._actors = []
        for rank, device in enumerate(self.devices):
            env = {
                "RLINF_VLA_GROUP": name,
                "RLINF_VLA_RANK": str(rank),
                "RLINF_VLA_WORLD_SIZE": str(len(self.devices)),
                "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
            }
            # A GPU worker sees only its GPU. CPU devices exist only on nodes without GPUs, so
            # there is nothing to hide there (an empty CUDA_VISIBLE_DEVICES also breaks
            # robosuite's EGL renderer).
            if device.kind == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = str(device.local_index)
            # OpenMP threads sleep between parallel regions instead of spinning: the workers
            # of one device (collocated, or pipelined stages) share its cores, and spinning
            # threads of one starve the others (a collocated toy run with 2 stages: 373 env
            # steps/s sleeping, 99 spinning, on 2 cores; docs/runtime.md). The caller's own
            # setting wins.
            env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
            env.update(env_vars or {})
            actor = host_cls.options(
                name=f"{name}:{rank}:{os.getpid()}:{id(self)}",
                num_cpus=0,
                max_concurrency=max_concurrency,
                max_restarts=0,
                runtime_env={"env_vars": env},
                scheduling_strategy=NodeAffinitySchedulingStrategy(device.node_id, soft=False),
            ).remote()
            self._actors.append(actor)
        size, on_node = len(self.devices), node_world_sizes(self.devices)
        refs = [
            actor.init.remote(
                worker_cls,
                WorkerContext(name, rank, size, device, node_world_size=on_node[rank]),
                args,
                kwargs or {},
            )
            for rank, (actor, device) in enumerate(zip(self._actors, self.devices, strict=True))
        ]
        start_limit = self.stall.start_timeout_s if timeout is None else timeout
        self._starting: GroupResult | None = GroupResult(
            self, "__init__", list(range(len(refs))), refs, limit_s=start_limit
        )
        if wait:
            self._wait_started()

    @property
    def world_size(self) -> int:
        return len(self._actors)

    def _submit(self, method: str, ranks: list[int], args: tuple, kwargs: dict) -> list[Any]:
        return [self._actors[r].call.remote(method, args, kwargs) for r in ranks]

    def actor(self, rank: int) -> Any:
        """The Ray actor handle of a rank (for advanced uses such as collectives)."""
        self._wait_started()
        return self._actors[rank]

    def shutdown(self) -> None:
        """Kill every worker of the group.

        A worker process that is stopped (``SIGSTOP``) cannot act on Ray's kill request and
        would stay behind on a long-lived cluster, and a stopped subprocess of a worker (a
        simulator) would not notice its parent's death; on this host they are sent
        ``SIGKILL``.
        """
        import ray

        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        for process in (self._processes or []) if self._actors else []:
            for pid in process.stopped_pids():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        self._actors = []
        self._starting = None

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, {self.worker_cls.__name__}, devices={[d.rank for d in self.devices]})"
