"""``train/explained_variance``: how much of the rollout's returns the critic predicted."""

import dataclasses
import statistics

import pytest
import torch

from tests.training.actors import local_actor
from tests.training.test_accumulation import _batch

ALGO = {"update_epochs": 1, "minibatch_size": 8, "micro_batch_size": 8}


def test_a_critic_update_reports_the_rollouts_explained_variance() -> None:
    """Over the valid samples of the whole rollout, with the values it was played with
    (not the values after the update): 1 - Var(G - V) / Var(G), computed here by hand."""
    actor = local_actor("openvla", {"name": "ppo", **ALGO}, preset="tiny", chunk_size=2, seed=0)
    mask = torch.tensor([True] * 7 + [False])
    values = [0.5, 1.0, 2.5, 3.0, 3.5, 6.0, 6.0, 50.0]
    returns = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, -50.0]  # the last one is not a sample
    batch = dataclasses.replace(
        _batch(actor.policy, mask),
        old_value=torch.tensor(values),
        returns=torch.tensor(returns),
    )
    metrics = actor.updater.update(batch, iteration=0, total_iterations=1)

    g, v = returns[:7], values[:7]
    want = 1 - statistics.variance(
        [a - b for a, b in zip(g, v, strict=True)]
    ) / statistics.variance(g)
    assert want == pytest.approx(0.94898, abs=1e-5)
    assert metrics["train/explained_variance"] == pytest.approx(want, rel=1e-5)


def test_an_update_without_a_critic_reports_none() -> None:
    actor = local_actor("openvla", {"name": "grpo", **ALGO}, preset="tiny", chunk_size=2, seed=0)
    metrics = actor.updater.update(
        _batch(actor.policy, torch.ones(8, dtype=torch.bool)), 0, total_iterations=1
    )
    assert "train/explained_variance" not in metrics
