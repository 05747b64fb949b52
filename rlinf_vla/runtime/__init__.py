"""The Ray-based runtime: cluster, workers and worker groups, channels, placement, offload.

It knows nothing about reinforcement learning. See docs/runtime.md.
"""

from rlinf_vla.runtime.channel import Channel
from rlinf_vla.runtime.cluster import Cluster, ClusterConfig, Device
from rlinf_vla.runtime.collective import Collective, create_collective
from rlinf_vla.runtime.offload import (
    offload_module,
    offload_optimizer,
    onload_module,
    onload_optimizer,
    resident,
)
from rlinf_vla.runtime.placement import Placement, PlacementConfig, parse_devices, resolve_placement
from rlinf_vla.runtime.threads import torch_threads
from rlinf_vla.runtime.worker import (
    GroupResult,
    Worker,
    WorkerError,
    WorkerGroup,
    WorkerStalled,
    split_evenly,
    wait_all,
    wait_started,
)

__all__ = [
    "Channel",
    "Cluster",
    "ClusterConfig",
    "Collective",
    "Device",
    "GroupResult",
    "Placement",
    "PlacementConfig",
    "Worker",
    "WorkerError",
    "WorkerGroup",
    "WorkerStalled",
    "create_collective",
    "offload_module",
    "offload_optimizer",
    "onload_module",
    "onload_optimizer",
    "parse_devices",
    "resident",
    "resolve_placement",
    "split_evenly",
    "torch_threads",
    "wait_all",
    "wait_started",
]
