"""The cluster: a connection to Ray and the list of devices workers are placed on.

``Cluster()`` starts an embedded local Ray instance (the default); ``Cluster(address="auto")``
or ``Cluster(address="ray://host:10001")`` connects to a running one. The cluster numbers
its devices globally, node by node: the GPUs of each node when it has any, otherwise CPU
"slots" (by default one per CPU core, configurable; a worker on a slot computes with the slot's
share of the node's cores as torch threads). Workers are pinned to a device's node
and see only that device (``CUDA_VISIBLE_DEVICES``); Ray's own GPU accounting is not used,
so several workers may share a device (collocated placement).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rlinf_vla.config import ConfigError, RunAborted, check_at_least
from rlinf_vla.runtime.reaper import Reaper, node_pids, watch
from rlinf_vla.runtime.stall import StallPolicy

logger = logging.getLogger(__name__)


def _token_auth_notice(record: logging.LogRecord) -> bool:
    """False for Ray's notice that a new local instance uses token authentication (printed at
    every start; the authentication stays on). Ray's other authentication warnings pass."""
    return not record.getMessage().startswith("Token authentication is enabled")


# The logger of the module that prints it (a no-op if Ray moves it).
logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
    _token_auth_notice
)


@dataclass
class ClusterConfig:
    """The ``cluster`` section of a run config.

    Attributes:
        address: ``None`` starts a local Ray instance; ``"auto"``, ``"host:port"`` or
            ``"ray://host:port"`` connects to a running cluster.
        num_nodes: wait until this many nodes are alive (``None``: use what is there).
        num_cpus: CPUs of the local instance (``None``: all cores). Only with ``address=None``.
        num_gpus: GPUs of the local instance (``None``: all visible). Only with ``address=None``.
        devices_per_node: devices per node; on GPU nodes at most the node's GPU count
            (``None``: all of them), on CPU-only nodes the number of CPU slots (``None``: one
            per CPU core).
        namespace: the Ray namespace for named actors (channels, workers).
        wait_timeout_s: how long to wait for ``num_nodes`` nodes.
        start_timeout_s: seconds each worker may take to start (imports, building models and
            simulators; ``None``: no limit).
        stall_factor: a worker call that runs longer than this many times the longest earlier
            call of its method (and longer than ``stall_min_s``) is stalled: the run stops
            naming the workers that have not answered (``None``: calls have no deadline). A
            method's first call has none. See :mod:`rlinf_vla.runtime.stall`.
        stall_min_s: no call is stalled before this many seconds.
        lean: a local instance runs its workers, and the simulator processes they start, at
            the driver's CPU priority, where Ray's default (``worker_niceness`` 15) puts them
            below its own daemons; runs its daemons other than the raylet (GCS, log monitor,
            autoscaler monitor, dashboard and agents) at the lowest priority; and starts
            without what a run never reads: Ray's metrics, the task events behind its state
            API, idle workers started ahead of demand (:data:`LEAN_RAY_ENV`). On a small
            machine the simulators and the policy then get the cores first. Only with
            ``address=None``: the processes of a cluster one joins are not this run's.
        pipes: a channel kept in a worker's process answers the workers on its node over a
            Unix socket instead of Ray calls (:mod:`rlinf_vla.runtime.channel`): in
            ``rlinf-vla train``, the env workers' chunk steps to the rollout workers on their
            node. ``false``: Ray calls everywhere.
    """

    address: str | None = None
    num_nodes: int | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None
    devices_per_node: int | None = None
    namespace: str = "rlinf_vla"
    wait_timeout_s: float = 60.0
    start_timeout_s: float | None = 600.0
    stall_factor: float | None = 5.0
    stall_min_s: float = 120.0
    lean: bool = True
    pipes: bool = True

    def __post_init__(self) -> None:
        check_at_least(self, "cluster", ("num_nodes", "num_cpus", "devices_per_node"), 1)
        bad = [
            f"cluster.{key} must be > 0, got {getattr(self, key)}"
            for key in ("wait_timeout_s", "start_timeout_s", "stall_min_s")
            if getattr(self, key) is not None and getattr(self, key) <= 0
        ]
        if self.stall_factor is not None and self.stall_factor < 1:
            bad.append(
                f"cluster.stall_factor must be >= 1 (or null: no deadline), got {self.stall_factor}"
            )
        if bad:
            raise ConfigError("; ".join(bad))
        if self.num_gpus is not None and self.num_gpus < 0:
            raise ConfigError(f"cluster.num_gpus must be >= 0, got {self.num_gpus}")
        if self.address is not None and (self.num_cpus is not None or self.num_gpus is not None):
            raise ConfigError(
                "cluster.num_cpus / cluster.num_gpus size a local instance; "
                "they cannot be set together with cluster.address"
            )


#: The environment a lean local instance starts in (``ClusterConfig.lean``): workers at the
#: driver's priority (Ray's default niceness for them is 15, below its daemons'); Ray's metrics
#: collection, its task events (the state API and dashboard read them; nothing here does) and
#: its idle workers started ahead of demand turned off. The daemons and workers take it from
#: the driver while ``ray.init`` starts them; the driver's own environment is restored after.
LEAN_RAY_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_enable_metrics_collection": "0",
    "RAY_task_events_report_interval_ms": "0",
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
}

#: The niceness of a lean local instance's daemons other than the raylet (the lowest priority).
DAEMON_NICE = 19

#: Ray's agents, which the raylet starts beside its workers: daemons too.
_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def proc_text(pid: int, name: str) -> str:
    """``/proc/<pid>/<name>`` as text, NULs as spaces (``""`` where unreadable)."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def child_processes() -> dict[int, list[int]]:
    """Every process's children, by parent id, from ``/proc`` (``{}`` without it)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        stat = proc_text(int(entry), "stat") if entry.isdigit() else ""
        if stat:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    return children


def lower_daemon_priority(pids: list[int], nice: int = DAEMON_NICE) -> None:
    """Give every thread of the local instance's daemons in ``pids`` (the processes
    ``ray.init`` started) and of the agents the raylet started the niceness ``nice``; the
    raylet keeps its own, since the workers it starts inherit it. Niceness is per thread on
    Linux (threads started later inherit their creator's); without ``/proc`` and for
    processes gone already nothing happens."""
    daemons = []
    children = child_processes()
    for pid in pids:
        if proc_text(pid, "comm") == "raylet":
            agents = children.get(pid, [])
            daemons += [c for c in agents if proc_text(c, "cmdline").startswith(_AGENTS)]
        else:
            daemons.append(pid)
    for pid in daemons:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except OSError:  # gone, or not ours to renice
            continue


@contextlib.contextmanager
def added_environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` added for the block (variables already set keep their
    value); the added ones are removed after it."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


#: Addresses ``ray.init`` resolves itself (``None`` starts a local instance).
_NOT_NETWORK_ADDRESSES = (None, "auto", "local")


def check_address(address: str | None, timeout_s: float = 3.0) -> None:
    """``ConfigError`` naming ``cluster.address`` unless something accepts TCP connections at
    its ``host:port`` within ``timeout_s`` (``ray.init`` would otherwise retry for a minute and
    more with only Ray's own warnings). ``None``, ``auto`` and ``local`` are not checked."""
    import socket

    if address in _NOT_NETWORK_ADDRESSES:
        return
    rest = address.removeprefix("ray://")
    host, sep, port_text = rest.rpartition(":")
    host = host.strip("[]")  # [::1]:6379
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(
            f"cluster.address={address!r}: expected host:port (the Ray head's GCS port, e.g. "
            "10.0.0.1:6379), ray://host:port (Ray Client, port 10001) or auto"
        )
    try:
        with socket.create_connection((host, int(port_text)), timeout=timeout_s):
            pass
    except OSError as e:
        reason = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise ConfigError(
            f"cluster.address={address!r}: nothing answers at {host}:{port_text} ({reason}); "
            "start the Ray head there (`ray start --head`), correct the address, or leave "
            "cluster.address unset to start a local Ray instance"
        ) from None


def _main_thread_sigterm_handler() -> Any:
    """The Python-level SIGTERM handler, or ``None`` off the main thread (where Python cannot
    set one)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.getsignal(signal.SIGTERM)


def _keep_sigterm_handler(before: Any) -> None:
    """Undo what ``ray.init`` did to SIGTERM in the driver: it sets a Python handler that
    raises ``SystemExit(15)``, then its core worker puts a C-level handler in front that prints
    a stack dump and arms a 3-second ``alarm`` which aborts the process (exit 134) if it is
    still alive by then, in the middle of writing reports or shutting down workers. The
    caller's own handler (e.g. the CLI's, see :mod:`rlinf_vla.cli`) is put back; with none,
    Ray's Python handler stays, without the C-level one. Either way through
    :func:`_remembering`, so that what it raises survives a Ray call (see
    :func:`raised_by_signal`)."""
    import signal

    handler = before if callable(before) else signal.getsignal(signal.SIGTERM)
    if callable(handler):
        signal.signal(signal.SIGTERM, _remembering(handler))


#: What the SIGTERM handler raised last, until :func:`raised_by_signal` takes it.
_signal_raised: BaseException | None = None


def _remembering(handler: Any) -> Any:
    """``handler``, remembering the exception it raises."""
    if getattr(handler, "remembers", False):
        return handler

    def remember(signum: int, frame: Any) -> None:
        global _signal_raised
        try:
            handler(signum, frame)
        except BaseException as e:
            _signal_raised = e
            raise

    remember.remembers = True  # type: ignore[attr-defined]
    return remember


def raised_by_signal(interrupt: KeyboardInterrupt) -> BaseException:
    """The exception a signal handler raised while Ray waited (``ray.wait``, ``ray.get``): Ray
    runs Python's signal handlers inside its wait and turns whatever they raise into a bare
    ``KeyboardInterrupt``, which would make SIGTERM look like Ctrl-C. Returns ``interrupt``
    itself when no SIGTERM handler raised since the last call."""
    global _signal_raised
    raised, _signal_raised = _signal_raised, None
    if raised is None or type(interrupt) is not KeyboardInterrupt:
        return interrupt
    return raised


@dataclass(frozen=True)
class Device:
    """One device of the cluster.

    Attributes:
        rank: global index, used in placements (``"0-3"``).
        node_rank: index of the node (the head node is 0).
        node_id: Ray's node id.
        node_ip: the node's IP address.
        local_index: the device's index on its node (the CUDA ordinal for GPUs).
        kind: ``"cuda"`` or ``"cpu"``.
        threads: for a CPU slot, the torch threads a worker on it computes with: the node's
            CPUs divided evenly among its slots (at least 1), at most ``OMP_NUM_THREADS`` when
            the process that makes the cluster has it set. ``None`` for a GPU.
    """

    rank: int
    node_rank: int
    node_id: str
    node_ip: str
    local_index: int
    kind: str
    threads: int | None = None

    def __str__(self) -> str:
        return f"{self.kind}:{self.local_index}@node{self.node_rank}"


def _omp_threads() -> int | None:
    """``OMP_NUM_THREADS`` of this process as a positive int (``None``: unset or not a count)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def node_devices(gpus: int, cpus: int, cap: int | None) -> tuple[str, int, int | None]:
    """The kind, count and torch threads of one node's devices: its GPUs (at most ``cap``),
    or, without GPUs, ``cap`` CPU slots (default: one per core) sharing its ``cpus`` cores
    evenly (at least 1, at most ``OMP_NUM_THREADS`` when set; see :class:`Device`)."""
    if gpus > 0:
        return "cuda", gpus if cap is None else min(cap, gpus), None
    count = cap if cap is not None else cpus
    threads = max(1, cpus // count)
    return "cpu", count, min(threads, _omp_threads() or threads)


class Cluster:
    """A Ray cluster and its devices.

    Example::

        with Cluster(ClusterConfig(num_cpus=2)) as cluster:
            print(cluster.devices)
    """

    def __init__(self, config: ClusterConfig | None = None, **overrides: Any) -> None:
        import ray

        if config is None:
            config = ClusterConfig(**overrides)
        elif overrides:
            raise TypeError("pass either a ClusterConfig or keyword overrides, not both")
        self.config = config
        #: The deadlines of the calls on this cluster's workers.
        self.stall = StallPolicy(config.stall_factor, config.stall_min_s, config.start_timeout_s)
        self._owns_ray = False
        self._reaper: Reaper | None = None
        if ray.is_initialized():
            logger.info("using the Ray instance already initialised in this process")
        else:
            os.environ.setdefault("RAY_DEDUP_LOGS", "0")
            kwargs: dict[str, Any] = {
                "namespace": config.namespace,
                "include_dashboard": False,
                "log_to_driver": True,
            }
            if config.address is None:
                # "local": an instance of its own, even where other Ray instances run on the
                # machine (another run's: ray.init() would join the newest of them)
                kwargs.update(address="local", num_cpus=config.num_cpus, num_gpus=config.num_gpus)
            else:
                check_address(config.address)
                kwargs["address"] = config.address
            sigterm = _main_thread_sigterm_handler()
            lean = config.lean and config.address is None
            try:
                with added_environment(LEAN_RAY_ENV if lean else {}):
                    ray.init(**kwargs)
            except Exception as e:  # Ray raises a bare Exception when its node times out
                # Ray's own traceback says little; one line says what to try
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                where = (
                    "a local Ray instance did not start"
                    if config.address is None
                    else f"Ray at cluster.address={config.address!r} did not answer"
                )
                raise RunAborted(
                    f"{where} ({type(e).__name__}: {first}); Ray gives its processes 30 s to "
                    "start: on a loaded machine try again, and stop stale Ray processes "
                    "(`ray stop`)"
                ) from None
            self._owns_ray = True
            if lean:
                lower_daemon_priority(node_pids())
            if config.address is None:  # an instance of our own, not a cluster we joined
                # a driver killed outright runs no exit code: this watcher stops its processes
                self._reaper = watch(node_pids())
            if sigterm is not None:
                _keep_sigterm_handler(sigterm)
        self._wait_for_nodes()
        self.devices: list[Device] = self._enumerate_devices()

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def num_nodes(self) -> int:
        return len({d.node_id for d in self.devices})

    def _alive_nodes(self) -> list[dict[str, Any]]:
        import ray

        return [n for n in ray.nodes() if n.get("Alive")]

    def _wait_for_nodes(self) -> None:
        want = self.config.num_nodes
        if want is None:
            return
        deadline = time.monotonic() + self.config.wait_timeout_s
        while (have := len(self._alive_nodes())) < want:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"cluster.num_nodes={want} but only {have} Ray node(s) are alive after "
                    f"{self.config.wait_timeout_s:.0f} s"
                )
            time.sleep(0.5)

    def _enumerate_devices(self) -> list[Device]:
        import ray

        head_id = ray.get_runtime_context().get_node_id()
        # The driver's node first, then the others in a stable order.
        nodes = sorted(
            self._alive_nodes(),
            key=lambda n: (n["NodeID"] != head_id, n["NodeManagerAddress"], n["NodeID"]),
        )
        devices: list[Device] = []
        cap = self.config.devices_per_node
        for node_rank, node in enumerate(nodes):
            resources = node.get("Resources", {})
            gpus = int(resources.get("GPU", 0))
            cpus = max(1, int(resources.get("CPU", 1)))
            kind, count, threads = node_devices(gpus, cpus, cap)
            for local in range(count):
                devices.append(
                    Device(
                        rank=len(devices),
                        node_rank=node_rank,
                        node_id=node["NodeID"],
                        node_ip=node["NodeManagerAddress"],
                        local_index=local,
                        kind=kind,
                        threads=threads,
                    )
                )
        if not devices:
            raise RuntimeError("the Ray cluster has no alive node")
        return devices

    def device(self, rank: int) -> Device:
        if not 0 <= rank < len(self.devices):
            raise IndexError(f"device {rank} does not exist; the cluster has {len(self.devices)}")
        return self.devices[rank]

    def shutdown(self) -> None:
        """Disconnect from Ray, stopping the local instance if this cluster started it.

        All workers and channels created through this cluster end with it.
        """
        import ray

        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        if self._reaper is not None:
            self._reaper.close()  # kills what ray.shutdown left, if anything
            self._reaper = None
        self._owns_ray = False

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        kinds = sorted({d.kind for d in self.devices})
        return f"Cluster(nodes={self.num_nodes}, devices={self.num_devices}, kinds={kinds})"


def local_device_count(cluster: ClusterConfig) -> int | None:
    """Devices of a local cluster, computed without starting it (``None`` for a remote one)."""
    if cluster.address is not None:
        return None
    if cluster.devices_per_node is not None:
        return cluster.devices_per_node
    try:
        import torch

        gpus = torch.cuda.device_count() if cluster.num_gpus is None else cluster.num_gpus
    except ImportError:
        gpus = 0
    if gpus:
        return gpus
    return cluster.num_cpus or os.cpu_count() or 1
