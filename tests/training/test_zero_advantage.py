"""``algo.skip_zero_advantage``: a minibatch without signal (every advantage exactly 0, no
other loss term) makes no optimizer step, so AdamW's weight decay and momentum do not move the
policy in it."""

import pytest
import torch

from rlinf_vla.pipelines.actor import ActorWorker
from tests.policies.conftest import make_obs
from tests.training.actors import local_actor, own_actions_batch

N = 4


def _actor(**algo) -> ActorWorker:
    algo = {
        "name": "grpo",
        "group_size": 2,
        "update_epochs": 1,
        "minibatch_size": N,
        "micro_batch_size": N,
        "weight_decay": 0.1,  # a step with a zero gradient still moves every weight
        **algo,
    }
    return local_actor("openvla", algo, preset="tiny", seed=0)


def _update(actor: ActorWorker, advantages: torch.Tensor) -> tuple[dict, float]:
    """One ``_train`` on a batch of the policy's own actions; returns its metrics and the
    largest change of any weight."""
    batch = own_actions_batch(
        actor.policy, make_obs(N, seed=1), advantages, torch.ones(N, dtype=torch.bool)
    )
    before = {n: p.detach().clone() for n, p in actor.policy.named_parameters()}
    metrics = actor.updater.update(batch, iteration=0, total_iterations=1)
    moved = max(
        float((p.detach() - before[n]).abs().max()) for n, p in actor.policy.named_parameters()
    )
    return metrics, moved


def test_a_minibatch_without_signal_makes_no_step() -> None:
    metrics, moved = _update(_actor(), torch.zeros(N))
    assert moved == 0.0
    assert metrics["train/skipped_zero_advantage"] == 1.0


@pytest.mark.parametrize(
    ("algo", "advantages"),
    [
        ({"skip_zero_advantage": False}, torch.zeros(N)),  # the step of weight decay alone
        ({"entropy_coef": 0.01}, torch.zeros(N)),  # the entropy term has a gradient
        ({}, torch.tensor([0.0, 0.0, 1.0, -1.0])),  # one group with signal
    ],
    ids=["off", "entropy-term", "signal"],
)
def test_otherwise_the_step_is_taken(algo, advantages) -> None:
    metrics, moved = _update(_actor(**algo), advantages)
    assert moved > 0.0
    assert metrics["train/skipped_zero_advantage"] == 0.0
