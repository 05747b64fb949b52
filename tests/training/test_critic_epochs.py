"""``algo.critic_epochs``: passes after the update epochs that fit the critic alone."""

import pytest
import torch

from rlinf_vla.config import ConfigError
from rlinf_vla.training.algo_config import AlgoConfig
from rlinf_vla.training.batch import Batch
from tests.policies.conftest import bounds_stats, make_obs
from tests.training.actors import local_actor

N = 8


def _actor(policy: str, critic_epochs: int, **kw):
    algo = {
        "name": "ppo",
        "update_epochs": 1,
        "minibatch_size": 4,
        "micro_batch_size": 2,
        "lr": 1e-3,
        "value_lr": 1e-3,
        "critic_epochs": critic_epochs,
        "normalize_advantages": False,
        "cache_frozen_features": False,
    }
    return local_actor(policy, algo, preset="tiny", chunk_size=2, seed=0, **kw)


def _batch(policy, size: int) -> Batch:
    g = torch.Generator().manual_seed(1)
    obs = make_obs(N, ("main",), 8 if "oft" in type(policy).__name__.lower() else None, size, 1)
    with torch.no_grad():
        out = policy.act(obs)
    return Batch(
        obs=obs,
        replay=out.replay,
        old_logprob=out.logprob,
        old_value=out.value,
        advantages=torch.randn(N, generator=g),
        returns=3.0 + torch.randn(N, generator=g),  # far from the fresh critic's ~0
        mask=torch.ones(N, dtype=torch.bool),
    )


def _value_mse(policy, batch: Batch) -> float:
    with torch.no_grad():
        replay = dict(batch.replay)
        return float((policy.critic_values(batch.obs, replay) - batch.returns).square().mean())


OFT = dict(norm_stats=bounds_stats(7, 8), image_keys=("main",), value_encoder="cnn")


@pytest.mark.parametrize(
    ("policy", "kw", "size"),
    [("openvla_oft", OFT, 64), ("openvla", {}, 32)],
    ids=["own encoder", "value head on the backbone"],
)
def test_the_critic_passes_fit_the_critic_and_leave_the_actor_as_it_was(policy, kw, size):
    plain, fitted = _actor(policy, 0, **kw), _actor(policy, 10, **kw)
    batch = _batch(plain.policy, size)
    mse0 = _value_mse(plain.policy, batch)
    plain_metrics = plain.updater.update(batch, iteration=0, total_iterations=1)
    metrics = fitted.updater.update(batch, iteration=0, total_iterations=1)
    # 10 passes of 2 minibatches of 4
    assert metrics["train/critic_update_steps"] == 20
    assert "train/critic_update_steps" not in plain_metrics
    # the update epochs are the same in both; the critic's passes then move the critic alone
    p0, p1 = dict(plain.policy.named_parameters()), dict(fitted.policy.named_parameters())
    critic = {n for n in p0 if n.startswith(("value_head.", "value_encoder."))}
    actor = [n for n in p0 if n not in critic and p0[n].requires_grad]
    assert actor and all(torch.equal(p0[n], p1[n]) for n in actor)
    assert any(not torch.equal(p0[n], p1[n]) for n in critic)
    # and fit it: the value error on the batch falls well below what one update leaves
    assert _value_mse(fitted.policy, batch) < 0.5 * _value_mse(plain.policy, batch) < mse0


def test_critic_epochs_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"algo.critic_epochs must be >= 0, got -1"):
        AlgoConfig(name="ppo", critic_epochs=-1)
    with pytest.raises(ConfigError, match=r"algo.critic_epochs must be 0 with algo.fsdp"):
        AlgoConfig(name="ppo", critic_epochs=2, fsdp=True)


def test_critic_epochs_are_refused_without_a_critic() -> None:
    from rlinf_vla.cli import compose
    from rlinf_vla.pipelines.config import validate

    cfg = compose("train", ["env=toy", "algo=grpo", "algo.critic_epochs=3"])
    with pytest.raises(ConfigError, match=r"algo.critic_epochs has no effect .*critic"):
        validate(cfg)
