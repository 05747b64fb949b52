"""An actor worker without a Ray actor around it, for tests of its update on one CPU rank."""

from typing import Any

from rlinf_vla.pipelines.actor import ActorWorker
from rlinf_vla.policies import policy_config
from rlinf_vla.runtime import Device
from rlinf_vla.runtime.worker import WorkerContext


def local_actor(policy_name: str, algo: dict[str, Any], **policy: Any) -> ActorWorker:
    """``ActorWorker(policy_name, policy_config(policy_name, **policy), algo)`` as rank 0 of 1
    on the CPU, built in this process."""
    from rlinf_vla.config import from_section
    from rlinf_vla.training.algo_config import AlgoConfig

    actor = ActorWorker.__new__(ActorWorker)
    actor._ctx = WorkerContext("actor", 0, 1, Device(0, 0, "local", "127.0.0.1", 0, "cpu"))
    typed = from_section(AlgoConfig, algo, "algo")
    actor.__init__(policy_name, policy_config(policy_name, **policy), typed, seed=0)
    return actor


def own_actions_batch(policy: Any, obs: Any, advantages: Any, mask: Any, **fields: Any) -> Any:
    """A rollout batch of ``policy``'s own actions on ``obs`` (old log-probs from the same
    weights, so every ratio starts at 1), with the given advantages and loss mask; zero old
    values and returns unless ``fields`` (any other ``Batch`` field) say otherwise."""
    import torch

    from rlinf_vla.training.batch import Batch

    with torch.no_grad():
        out = policy.act(obs)
    n = obs.batch_size
    given = {"old_value": torch.zeros(n), "returns": torch.zeros(n), **fields}
    return Batch(
        obs=obs,
        replay=out.replay,
        old_logprob=out.logprob,
        advantages=advantages,
        mask=mask,
        **given,
    )


def one_step_grpo_actor(n: int, **algo: Any) -> ActorWorker:
    """A GRPO actor on the tiny OpenVLA (chunk 2) whose update is one optimizer step over a
    batch of ``n`` samples (2 per micro-batch), with the other ``algo`` keys given."""
    keys = {
        "name": "grpo",
        "group_size": 2,
        "update_epochs": 1,
        "minibatch_size": n,
        "micro_batch_size": 2,
        "skip_zero_advantage": False,
        **algo,
    }
    return local_actor("openvla", keys, preset="tiny", chunk_size=2, seed=0)
