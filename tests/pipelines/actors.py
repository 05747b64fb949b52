"""An actor worker without a Ray actor around it, for tests of its update on one CPU rank."""

from typing import Any

from rlinf_vla.pipelines.actor import ActorWorker
from rlinf_vla.policies import policy_config
from rlinf_vla.runtime import Device
from rlinf_vla.runtime.worker import WorkerContext


def local_actor(policy_name: str, algo: dict[str, Any], **policy: Any) -> ActorWorker:
    """``ActorWorker(policy_name, policy_config(policy_name, **policy), algo)`` as rank 0 of 1
    on the CPU, built in this process."""
    actor = ActorWorker.__new__(ActorWorker)
    actor._ctx = WorkerContext("actor", 0, 1, Device(0, 0, "local", "127.0.0.1", 0, "cpu"))
    actor.__init__(policy_name, policy_config(policy_name, **policy), algo, seed=0)
    return actor
