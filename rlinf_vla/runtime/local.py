"""Single-process execution: worker groups, channels and collectives in threads of this process.

The same objects as the Ray runtime, without Ray: :class:`LocalCluster` lists this machine's
devices, :class:`LocalGroup` builds each worker of a group in this process and runs its calls
in a thread of its own (in order, like a Ray actor), :class:`LocalChannel` hands items from one
thread to another by reference (nothing is serialised or copied) and a local collective lends
the source's tensors to the receivers. Code written against :class:`~rlinf_vla.runtime.Worker`,
``WorkerGroup`` and ``Channel`` runs unchanged::

    with LocalCluster(ClusterConfig()) as cluster:   # Doubler: rlinf_vla.runtime.worker's example
        group = LocalGroup(cluster, Doubler, "doubler", [0], args=(2,))
        group.run(10).wait()                 # [20]

What it saves against Ray on one machine: the actor processes (each with its own torch,
simulator libraries and memory), and for every message a serialisation, an object-store copy
and a round trip through the channel actor. What it gives up: workers cannot be on other nodes,
every worker shares this process's torch threads and global random state, and a worker that
crashes the process (a segfault) takes the run with it (a simulator subprocess that dies is
still restarted by its env, :mod:`rlinf_vla.envs.vector`). Threads overlap where the work leaves
Python: torch kernels, waits on simulator subprocesses, sleeps.

Calls return the same :class:`~rlinf_vla.runtime.worker.GroupResult` futures as Ray groups, so
:func:`~rlinf_vla.runtime.worker.wait_all` reports the first exception with the worker's name
and traceback, and applies the same deadlines.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from rlinf_vla.runtime.channel import DEFAULT_KEY, check_batch
from rlinf_vla.runtime.cluster import ClusterConfig, Device, added_environment, node_devices
from rlinf_vla.runtime.stall import Process, StallPolicy
from rlinf_vla.runtime.worker import (
    GroupBase,
    GroupResult,
    WorkerContext,
    guarded,
    invoke,
    node_world_sizes,
)

LOCAL_NODE = "local"


class LocalCluster:
    """This machine's devices, without Ray: its GPUs, or CPU slots when it has none.

    Numbered as :class:`~rlinf_vla.runtime.Cluster` numbers a single node's devices
    (``cluster.devices_per_node`` caps the GPUs, or sets the CPU slots; a CPU slot computes
    with ``cores / slots`` torch threads). ``cluster.address`` must be unset: a local cluster
    has no other nodes.
    """

    def __init__(self, config: ClusterConfig | None = None) -> None:
        import torch

        config = config or ClusterConfig()
        if config.address is not None:
            raise ValueError(
                f"cluster.address={config.address!r}: the single-process executor runs on this "
                "machine only (use a Ray placement to run on a cluster)"
            )
        self.config = config
        self.stall = StallPolicy(config.stall_factor, config.stall_min_s, config.start_timeout_s)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if config.num_gpus is not None:
            gpus = min(gpus, config.num_gpus)
        cpus = config.num_cpus or os.cpu_count() or 1
        kind, count, threads = node_devices(gpus, cpus, config.devices_per_node)
        ip = "127.0.0.1"
        self.devices = [
            Device(
                rank=k,
                node_rank=0,
                node_id=LOCAL_NODE,
                node_ip=ip,
                local_index=k,
                kind=kind,
                threads=threads,
            )
            for k in range(count)
        ]

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def num_nodes(self) -> int:
        return 1

    def device(self, rank: int) -> Device:
        if not 0 <= rank < len(self.devices):
            raise IndexError(f"device {rank} does not exist; the cluster has {len(self.devices)}")
        return self.devices[rank]

    def shutdown(self) -> None:
        """Nothing to stop: the groups end with their :meth:`LocalGroup.shutdown`."""

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"LocalCluster(devices={self.num_devices}, kind={self.devices[0].kind})"


#: What Ray sets in a worker process, and so what the subprocesses a worker starts (the
#: simulators) inherit: one OpenMP thread, sleeping when idle (docs/runtime.md, "CPU threads").
WORKER_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


@contextlib.contextmanager
def worker_environment() -> Iterator[None]:
    """This process's environment, for the block, as a Ray worker's (:data:`WORKER_ENVIRONMENT`,
    where the caller has not set the variable), so that simulator subprocesses started in the
    block compute as they would under a Ray worker; restored after it. It changes neither this
    process's torch threads (``torch_threads`` sets those) nor subprocesses already running."""
    with added_environment(WORKER_ENVIRONMENT):
        yield


class ChannelClosed(RuntimeError):
    """A local channel was closed while a thread waited on it."""


class LocalChannel:
    """The :class:`~rlinf_vla.runtime.Channel` interface between threads of one process.

    Items are handed over by reference: a consumer receives the very object the producer put
    (do not modify an item after putting it). ``close`` wakes every waiting thread with
    :class:`ChannelClosed`, so the threads of a failed run end.
    """

    def __init__(self, name: str, maxsize: int = 0) -> None:
        if maxsize < 0:
            raise ValueError(f"maxsize must be >= 0, got {maxsize}")
        self.name, self.maxsize = name, maxsize
        self._queues: dict[str, deque[Any]] = defaultdict(deque)
        self._cond = threading.Condition()
        self._closed = False

    @classmethod
    def create(cls, name: str, maxsize: int = 0) -> LocalChannel:
        return cls(name, maxsize)

    def _wait(self, ready: Any, timeout: float | None) -> bool:
        """Wait (holding the condition) until ``ready()``; ``False`` after ``timeout``."""
        ok = self._cond.wait_for(lambda: self._closed or ready(), timeout)
        if self._closed:
            raise ChannelClosed(f"channel {self.name!r} was closed")
        return ok

    def put(self, key: str, item: Any, timeout: float | None = None) -> None:
        with self._cond:  # the key's queue is made under the lock: two threads may meet it first
            queue = self._queues[key]
            if not self._wait(lambda: self.maxsize <= 0 or len(queue) < self.maxsize, timeout):
                raise TimeoutError(f"channel {self.name!r} stayed full for {timeout} s")
            queue.append(item)
            self._cond.notify_all()

    def get(self, key: str = DEFAULT_KEY, timeout: float | None = None) -> Any:
        return self.get_batch(key, 1, timeout)[0]

    def get_batch(self, key: str, n: int, timeout: float | None = None) -> list[Any]:
        check_batch(self.name, self.maxsize, n)
        with self._cond:
            queue = self._queues[key]
            if not self._wait(lambda: len(queue) >= n, timeout):
                raise TimeoutError(
                    f"channel {self.name!r}: nothing under key {key!r} for {timeout} s"
                )
            out = [queue.popleft() for _ in range(n)]
            self._cond.notify_all()
            return out

    def exchange(self, put_key: str, item: Any, get_key: str, timeout: float | None = None) -> Any:
        self.put(put_key, item)
        return self.get(get_key, timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Puts are applied when they return: nothing to wait for."""

    def qsize(self, key: str = DEFAULT_KEY) -> int:
        with self._cond:
            return len(self._queues[key]) if key in self._queues else 0

    def sizes(self) -> dict[str, int]:
        with self._cond:
            return {k: len(q) for k, q in self._queues.items() if q}

    def take_timers(self) -> dict[str, float]:
        """Seconds spent serialising and fetching payloads: none in one process."""
        return {"send_s": 0.0, "fetch_s": 0.0}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queues.clear()
            self._cond.notify_all()

    def __repr__(self) -> str:
        return f"LocalChannel({self.name!r}, maxsize={self.maxsize})"


class _Host(threading.Thread):
    """One worker's thread: runs its calls one after another, answering futures."""

    def __init__(self, label: str) -> None:
        super().__init__(name=label, daemon=True)
        self.calls: deque[tuple[Any, Future] | None] = deque()
        self.ready = threading.Semaphore(0)
        self.start()

    def submit(self, fn: Any) -> Future:
        future: Future = Future()
        self.calls.append((fn, future))
        self.ready.release()
        return future

    def stop(self) -> None:
        self.calls.append(None)
        self.ready.release()

    def run(self) -> None:
        while True:
            self.ready.acquire()
            call = self.calls.popleft()
            if call is None:
                return
            fn, future = call
            future.set_result(fn())


class LocalGroup(GroupBase):
    """The :class:`~rlinf_vla.runtime.WorkerGroup` interface, its workers in this process.

    The workers are built one after another in the calling thread (in rank order, so their
    random state is the same from run to run); each then answers its calls in a thread of its
    own. ``wait`` and ``timeout`` are accepted for the interface and change nothing (the
    workers are built before the constructor returns). The workers compute
    with this process's torch threads: the caller sets them (on a CPU slot, its ``threads``;
    :func:`~rlinf_vla.runtime.torch_threads`).
    """

    def __init__(
        self,
        cluster: LocalCluster,
        worker_cls: type,
        name: str,
        devices: Iterable[int],
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        env_vars: dict[str, str] | None = None,
        max_concurrency: int = 1,
        timeout: float | None = None,
        wait: bool = True,
    ) -> None:
        if env_vars:
            raise ValueError(f"worker group {name!r}: env_vars need worker processes (Ray)")
        if max_concurrency != 1:
            raise ValueError(f"worker group {name!r}: a local worker runs one call at a time")
        self._place(cluster, worker_cls, name, devices)
        self._workers: list[Any] = []
        self._hosts: list[_Host] = []
        futures = []
        on_node = node_world_sizes(self.devices)
        for rank, device in enumerate(self.devices):
            ctx = WorkerContext(
                name,
                rank,
                len(self.devices),
                device,
                in_process=True,
                node_world_size=on_node[rank],
            )

            def build(ctx: WorkerContext = ctx) -> Process:
                worker = worker_cls.__new__(worker_cls)
                worker._ctx = ctx
                worker._local_collectives = {}
                worker.__init__(*args, **(kwargs or {}))
                self._workers.append(worker)
                return Process.this()

            future: Future = Future()
            future.set_result(guarded(f"{worker_cls.__name__}.__init__", build))
            futures.append(future)
            self._hosts.append(_Host(f"{name}[{rank}]"))
        self._starting = GroupResult(self, "__init__", list(range(len(futures))), futures)
        self._wait_started()

    @property
    def world_size(self) -> int:
        return len(self._hosts)

    def _submit(self, method: str, ranks: list[int], args: tuple, kwargs: dict) -> list[Any]:
        return [
            self._hosts[r].submit(
                lambda worker=self._workers[r]: guarded(
                    method, invoke, worker, method, args, kwargs
                )
            )
            for r in ranks
        ]

    def worker(self, rank: int) -> Any:
        """The worker object of ``rank`` (this process holds it)."""
        return self._workers[rank]

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the threads once their current call returns, and wait up to ``timeout_s`` for
        each to end (a call blocked on a channel ends when the channel is closed: close it
        first). A thread still running at the interpreter's exit would be cancelled inside
        the torch code it runs, which aborts the process; the threads are daemons, so none
        that does not end keeps the process alive."""
        for host in self._hosts:
            host.stop()
        for host in self._hosts:
            if host is not threading.current_thread():
                host.join(timeout_s)
        self._hosts, self._workers = [], []
        self._starting = None

    def __repr__(self) -> str:
        return f"LocalGroup({self.name!r}, {self.worker_cls.__name__}, devices={[d.rank for d in self.devices]})"


class LocalCollective:
    """A collective's view from one member: broadcasts lend the source's objects."""

    def __init__(self, name: str, rank: int, shared: _Rendezvous) -> None:
        self.name, self.rank, self._shared = name, rank, shared
        self.world_size = shared.world_size

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self._shared.exchange(obj if self.rank == src else None, self.rank == src)

    def broadcast_tensors(self, tensors: Any, src: int = 0) -> Any:
        """The source's tensors themselves (receivers copy what they keep, e.g. with
        ``load_state_dict``)."""
        return self.broadcast_object(tensors, src)

    def barrier(self) -> None:
        self._shared.exchange(None, self.rank == 0)


class _Rendezvous:
    """Members meet; the source's value is handed to all of them."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)
        self._value: Any = None

    def exchange(self, value: Any, is_source: bool) -> Any:
        if is_source:
            self._value = value
        self._barrier.wait()  # the value is set
        out = self._value
        self._barrier.wait()  # everyone has read it: the next exchange may overwrite it
        return out


def create_local_collective(
    name: str, members: Sequence[tuple[LocalGroup, int]], timeout_s: float = 300.0
) -> None:
    """Form the collective ``name`` from ``(group, rank)`` pairs of local groups."""
    shared = _Rendezvous(len(members), timeout_s)
    for i, (group, rank) in enumerate(members):
        group.worker(rank)._local_collectives[name] = LocalCollective(name, i, shared)


__all__ = [
    "ChannelClosed",
    "LocalChannel",
    "LocalCluster",
    "LocalCollective",
    "LocalGroup",
    "create_local_collective",
]
