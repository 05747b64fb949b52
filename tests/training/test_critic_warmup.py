"""``algo.critic_warmup_iterations``: in the first iterations only the value head learns."""

import pytest
import torch

from rlinf_vla.config import ConfigError
from rlinf_vla.pipelines.actor import ActorWorker
from rlinf_vla.training.algo_config import AlgoConfig
from tests.training.actors import local_actor
from tests.training.test_accumulation import _batch

VALID = torch.ones(8, dtype=torch.bool)


def _actor(critic_warmup: int) -> ActorWorker:
    algo = {
        "name": "ppo",
        "update_epochs": 1,
        "minibatch_size": 8,
        "micro_batch_size": 8,
        "lr": 1e-2,
        "critic_warmup_iterations": critic_warmup,
        "normalize_advantages": False,
        "cache_frozen_features": False,
    }
    return local_actor("openvla", algo, preset="tiny", chunk_size=2, seed=0)


def _changed(actor: ActorWorker, iteration: int) -> tuple[set[str], set[str]]:
    """One update at ``iteration``: the names of the policy's and the value head's parameters
    that changed."""
    batch = _batch(actor.policy, VALID)
    before = {n: p.detach().clone() for n, p in actor.policy.named_parameters() if p.requires_grad}
    metrics = actor.updater.update(batch, iteration=iteration, total_iterations=10)
    changed = {n for n, p in actor.policy.named_parameters() if n in before}
    changed = {
        n for n in changed if not torch.equal(before[n], dict(actor.policy.named_parameters())[n])
    }
    value = {n for n in changed if "value_head" in n}
    assert metrics["train/lr"] == (0.0 if iteration < actor.algo.critic_warmup_iterations else 1e-2)
    return changed - value, value


def test_only_the_value_head_learns_during_the_critic_warmup() -> None:
    actor = _actor(critic_warmup=2)
    policy, value = _changed(actor, iteration=1)
    assert value, "the value head must learn during the warm-up"
    assert not policy, f"policy weights moved during the critic warm-up: {sorted(policy)[:3]}"
    policy, value = _changed(actor, iteration=2)
    assert policy and value, "after the warm-up both learn"


def test_without_warmup_the_policy_learns_from_the_first_iteration() -> None:
    policy, value = _changed(_actor(critic_warmup=0), iteration=0)
    assert policy and value


def test_a_negative_critic_warmup_is_refused() -> None:
    with pytest.raises(ConfigError, match="critic_warmup_iterations"):
        AlgoConfig(name="ppo", critic_warmup_iterations=-1)


@pytest.mark.parametrize("algo", ["grpo", "rloo", "reinforce_pp"])
def test_critic_warmup_is_refused_without_a_critic(algo) -> None:
    from rlinf_vla.cli import compose
    from rlinf_vla.pipelines.config import validate

    cfg = compose("train", ["env=toy", f"algo={algo}", "algo.critic_warmup_iterations=3"])
    with pytest.raises(ConfigError, match=r"algo.critic_warmup_iterations has no effect .*critic"):
        validate(cfg)
