"""``algo.target_kl``: an iteration's update stops at the first minibatch whose approx. KL to
the rollout's policy passes 1.5 x the target, without that minibatch's step."""

import pytest
import torch

from rlinf_vla.config import ConfigError
from rlinf_vla.pipelines.actor import ActorWorker
from rlinf_vla.training.algo_config import AlgoConfig
from tests.policies.conftest import make_obs
from tests.training.actors import one_step_grpo_actor, own_actions_batch

N = 2  # one minibatch per epoch


def _actor(**algo) -> ActorWorker:
    # one step moves the policy well past any small target at this rate
    return one_step_grpo_actor(N, **{"update_epochs": 3, "micro_batch_size": 1, "lr": 1e-2, **algo})


def _update(actor: ActorWorker) -> tuple[dict, dict]:
    """One ``_train`` on a batch of the policy's own actions (every ratio starts at 1);
    returns its metrics and the weights after it."""
    batch = own_actions_batch(
        actor.policy, make_obs(N, seed=1), torch.tensor([1.0, -1.0]), torch.ones(N, dtype=bool)
    )
    metrics = actor.updater.update(batch, iteration=0, total_iterations=1)
    return metrics, {n: p.detach().clone() for n, p in actor.policy.named_parameters()}


def test_the_update_stops_before_the_step_of_a_minibatch_past_the_target() -> None:
    stopped, weights = _update(_actor(target_kl=1e-6))
    # the first epoch starts at the rollout's policy (KL ~0) and steps; the second, one step
    # away, is past 1.5e-6 and stops the update
    assert stopped["train/update_steps"] == 1.0
    assert stopped["train/kl_stopped"] == 1.0
    assert stopped["train/approx_kl"] < 1e-6  # the metrics are those of the step taken
    one_epoch, one_step = _update(_actor(update_epochs=1))
    assert one_epoch["train/update_steps"] == 1.0
    for name, w in one_step.items():  # the stopped minibatch's gradient was not applied
        torch.testing.assert_close(weights[name], w, rtol=0, atol=0)


def test_every_epoch_runs_under_the_target_or_without_one() -> None:
    free, _ = _update(_actor())
    assert free["train/update_steps"] == 3.0 and "train/kl_stopped" not in free
    assert free["train/approx_kl"] > 1.5e-6  # the later epochs moved past the small target
    loose, _ = _update(_actor(target_kl=1e3))  # KL ~50 per step here
    assert loose["train/update_steps"] == 3.0 and loose["train/kl_stopped"] == 0.0


@pytest.mark.parametrize("value", [0.0, -0.01])
def test_the_target_must_be_positive(value) -> None:
    with pytest.raises(ConfigError, match=r"algo\.target_kl must be > 0 or null"):
        AlgoConfig(name="ppo", target_kl=value)
