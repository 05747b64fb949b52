"""Tensor transport between workers over torch.distributed (NCCL between GPUs, gloo otherwise).

The driver forms a collective from ranks of one or more worker groups::

    create_collective("weights", [(actor, [0]), (rollout, None)])   # actor 0 + all rollout

and every member can then use it inside its methods::

    coll = self.collective("weights")       # this worker's rank in it: coll.rank
    state = coll.broadcast_tensors(model.state_dict() if coll.rank == 0 else None, src=0)

Each collective is its own process group built on a private TCP store, so a worker can belong
to several (say, its FSDP group and a weight-sync group) without a global default group.
Collective ranks follow the order of the members given to :func:`create_collective`.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rlinf_vla.runtime.cluster import Device
    from rlinf_vla.runtime.worker import WorkerGroup

_COLLECTIVES: dict[str, Collective] = {}


class Collective:
    """One process group, seen from one member. Every operation blocks until it completes."""

    def __init__(self, name: str, rank: int, world_size: int, backend: str, pg: Any, store: Any):
        self.name, self.rank, self.world_size, self.backend = name, rank, world_size, backend
        self._pg, self._store = pg, store  # the store must outlive the process group
        self.device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``dst`` (which must call :meth:`recv`)."""
        self._pg.send([tensor.contiguous()], dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receive into the preallocated ``tensor`` from rank ``src``; returns it."""
        self._pg.recv([tensor], src, tag).wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with its value on ``src`` (same shape everywhere)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._pg.broadcast([tensor], opts).wait()
        return tensor

    def all_reduce(self, tensor: torch.Tensor, average: bool = False) -> torch.Tensor:
        """Sum ``tensor`` over all ranks in place (``average``: divide by the world size)."""
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._pg.allreduce([tensor], opts).wait()
        if average:
            tensor /= self.world_size
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Broadcast any picklable object from ``src``; other ranks pass ``None``."""
        if self.rank == src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        size = self.broadcast(size.to(self.device), src)
        if self.rank != src:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        data = self.broadcast(data.to(self.device), src)
        return obj if self.rank == src else pickle.loads(data.cpu().numpy().tobytes())

    def broadcast_tensors(
        self, tensors: dict[str, torch.Tensor] | None, src: int = 0
    ) -> dict[str, torch.Tensor]:
        """Broadcast a dict of named tensors (e.g. a state dict) from ``src``.

        The names, shapes and dtypes go first; then one flat buffer per dtype, so a model's
        weights cost one collective per dtype rather than one per parameter. Returns the
        received tensors (on ``src``, the given ones) on this collective's device.
        """
        meta = None
        if self.rank == src:
            assert tensors is not None, "the source rank must pass the tensors"
            meta = [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
        meta = self.broadcast_object(meta, src)
        out: dict[str, torch.Tensor] = {}
        for dtype in sorted({m[2] for m in meta}, key=str):
            group = [m for m in meta if m[2] == dtype]
            numel = sum(_numel(shape) for _, shape, _ in group)
            if self.rank == src:
                flat = torch.cat(
                    [tensors[k].detach().reshape(-1).to(self.device) for k, _, _ in group]
                )
            else:
                flat = torch.empty(numel, dtype=dtype, device=self.device)
            self.broadcast(flat, src)
            offset = 0
            for key, shape, _ in group:
                n = _numel(shape)
                out[key] = flat[offset : offset + n].view(shape)
                offset += n
        return out if self.rank != src else {k: t for k, t in tensors.items()}

    def barrier(self) -> None:
        self.broadcast(torch.zeros(1, device=self.device), 0)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def get(name: str, joined: dict[str, Any] | None = None) -> Any:
    """The collective ``name`` joined by this process (or among ``joined``: a local worker's
    own, :mod:`rlinf_vla.runtime.local`)."""
    joined = _COLLECTIVES if joined is None else joined
    if name not in joined:
        known = ", ".join(sorted(joined)) or "none"
        raise KeyError(f"this worker is not in a collective named {name!r} (joined: {known})")
    return joined[name]


def join(
    name: str,
    rank: int,
    world_size: int,
    addr: str,
    port: int,
    backend: str,
    timeout_s: float,
    as_default: bool = False,
) -> None:
    """Join the collective ``name`` from inside a worker process (called by the driver)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        addr, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    if as_default:
        if dist.is_initialized():
            raise RuntimeError(
                f"collective {name!r}: this process already has a default process group"
            )
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        pg = dist.distributed_c10d._get_default_group()
        _COLLECTIVES[name] = Collective(name, rank, world_size, backend, pg, store)
        return
    if backend == "nccl":
        torch.cuda.set_device(0)
        pg = dist.ProcessGroupNCCL(store, rank, world_size)
    elif backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    else:
        raise ValueError(f"unknown backend {backend!r}; use 'nccl' or 'gloo'")
    _COLLECTIVES[name] = Collective(name, rank, world_size, backend, pg, store)


def auto_backend(devices: Sequence[Device]) -> str:
    """``"nccl"`` when every member is on a GPU and no two share one, else ``"gloo"``.

    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), which is what collocated
    components are (the actor and the rollout worker on GPU 0 share the weights collective);
    gloo carries their tensors through host memory instead.
    """
    gpus = [(d.node_id, d.local_index) for d in devices if d.kind == "cuda"]
    return "nccl" if len(gpus) == len(devices) and len(set(gpus)) == len(gpus) else "gloo"


def create_collective(
    name: str,
    members: Sequence[tuple[WorkerGroup, Sequence[int] | None]],
    backend: str = "auto",
    timeout_s: float = 300.0,
    as_default: bool = False,
) -> None:
    """Form the collective ``name`` from ``(group, ranks)`` pairs (``None``: all ranks).

    ``backend="auto"`` picks NCCL when every member is on a GPU of its own, gloo otherwise
    (see :func:`auto_backend`).
    ``as_default=True`` also makes it each member's torch.distributed default process group
    (what FSDP2 and DTensor use); a process can have only one.

    Raises:
        WorkerError: a member failed to join (e.g. the rendezvous timed out).
    """
    from rlinf_vla.runtime.worker import GroupResult, wait_all

    flat = [
        (g, r) for g, ranks in members for r in (range(g.world_size) if ranks is None else ranks)
    ]
    if len(flat) < 2:
        raise ValueError(f"collective {name!r} needs at least two members, got {len(flat)}")
    if len(set((id(g), r) for g, r in flat)) != len(flat):
        raise ValueError(f"collective {name!r} lists a worker twice")
    from rlinf_vla.runtime.local import LocalGroup, create_local_collective

    if all(isinstance(g, LocalGroup) for g, _ in flat):
        if as_default:
            raise ValueError(f"collective {name!r}: local groups have no default process group")
        create_local_collective(name, flat, timeout_s)
        return
    if backend == "auto":
        backend = auto_backend([g.devices[r] for g, r in flat])
    import ray

    first_group, first_rank = flat[0]
    addr, port = ray.get(first_group.actor(first_rank).free_port.remote())
    results = [
        GroupResult(
            g,
            "join_collective",
            [r],
            [
                g.actor(r).join_collective.remote(
                    name, i, len(flat), addr, port, backend, timeout_s, as_default
                )
            ],
        )
        for i, (g, r) in enumerate(flat)
    ]
    wait_all(results, timeout=timeout_s + 30)
