"""``algo.log_std_lr``: the policy's log-std in its own AdamW group at its own rate."""

import pytest
import torch

from rlinf_vla.config import ConfigError
from rlinf_vla.pipelines.actor import ActorWorker
from rlinf_vla.training.algo_config import AlgoConfig
from tests.training.actors import local_actor

LR = 1e-4


def _actor(**algo) -> ActorWorker:
    algo = {"name": "ppo", "lr": LR, "max_grad_norm": 1e9, **algo}
    policy = {"preset": "tiny", "chunk_size": 2, "seed": 0, "action_head": "l1_gaussian"}
    return local_actor("openvla_oft", algo, **policy)


def _step_with_log_std_gradient(actor: ActorWorker) -> torch.Tensor:
    """One optimizer step where only the log-std has a gradient (mixed signs); returns the
    log-std's change."""
    log_std = actor.policy.log_std
    before = log_std.detach().clone()
    actor.learner.zero_grad()
    log_std.grad = torch.tensor([1.0, -2.0, 0.5, -0.25, 3.0, -1.0, 0.1])
    actor.learner.set_lr(0, 10)
    actor.learner.step()
    return log_std.detach() - before


@pytest.mark.parametrize("log_std_lr", [None, 3e-2])
def test_log_std_moves_by_its_own_rate(log_std_lr) -> None:
    actor = _actor(log_std_lr=log_std_lr)
    rates = [g["lr"] for g in actor.learner.optimizer.param_groups]
    groups_of_log_std = [
        i
        for i, g in enumerate(actor.learner.optimizer.param_groups)
        if any(p is actor.policy.log_std for p in g["params"])
    ]
    grad = torch.tensor([1.0, -2.0, 0.5, -0.25, 3.0, -1.0, 0.1])
    delta = _step_with_log_std_gradient(actor)
    # Adam's first step moves every element by lr * g / (|g| + eps) ~ lr * sign(g)
    rate = LR if log_std_lr is None else log_std_lr
    # (float32 log-stds near -2: the change is exact to ~2e-7, 1e-2 of a 1e-4 step)
    torch.testing.assert_close(delta, -rate * grad.sign(), rtol=1e-2, atol=0.0)
    if log_std_lr is None:  # today's two groups: the log-std with the rest of the policy
        assert groups_of_log_std == [0] and rates == [LR, 1e-3]
    else:
        assert groups_of_log_std == [2] and rates == [LR, 1e-3, log_std_lr]
        assert actor.learner.optimizer.param_groups[2]["params"] == [actor.policy.log_std]


def test_log_std_lr_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"algo\.log_std_lr must be > 0"):
        AlgoConfig(name="ppo", log_std_lr=0.0)
