"""``algo.episode_weight`` of ``rlinf-vla train``: under group advantages each scored episode
weighs the same in the policy term (``equal``), or each chunk step does (``step``); weights and
losses against numbers worked out by hand."""

import pytest
import torch

from rlinf_vla.algos.granularity import episode_weights
from rlinf_vla.training.algo_config import AlgoConfig
from rlinf_vla.training.batch import build_batch
from tests.policies.conftest import make_obs
from tests.training.actors import one_step_grpo_actor, own_actions_batch
from tests.training.test_advantages import _episodes


def test_episode_weights_by_hand():
    # env 0's episode runs 3 steps, env 1's 1 step, env 2 has none (a dropped group)
    mask = torch.tensor([[True, True, False], [True, False, False], [True, False, False]])
    w = episode_weights(mask)
    # 4 valid steps over 2 episodes: mean length 2 -> 2/3 per step of env 0, 2/1 for env 1
    expected = torch.tensor([[2 / 3, 2.0, 0.0], [2 / 3, 0.0, 0.0], [2 / 3, 0.0, 0.0]])
    assert torch.allclose(w, expected)
    assert float(w.sum()) == pytest.approx(float(mask.sum()))  # mean 1 over the valid steps
    # each episode's steps add up to the same total
    assert w.sum(dim=0)[:2].tolist() == pytest.approx([2.0, 2.0])


def test_grpo_batch_weighs_each_first_episode_equally():
    # _episodes(): first episodes of 2, 3, 1 and 3 chunk steps (envs 0..3), T = 3
    batch = build_batch([_episodes()], AlgoConfig(name="grpo", group_size=2))
    # samples are (t, env) flattened: mean length 9 / 4 = 2.25
    per_env = torch.tensor([2.25 / 2, 2.25 / 3, 2.25 / 1, 2.25 / 3])
    valid = batch.mask.reshape(3, 4)
    expected = torch.where(valid, per_env.expand(3, -1), torch.zeros(3, 4)).flatten()
    assert torch.allclose(batch.weight, expected)
    # one weight per chunk step (every step 1), and none for PPO's GAE batches
    step = AlgoConfig(name="grpo", group_size=2, episode_weight="step")
    assert build_batch([_episodes()], step).weight is None
    assert build_batch([_episodes()], AlgoConfig(name="ppo")).weight is None


N = 6
LENGTHS = [1, 3]  # chunk steps of two episodes of one group: samples 0 | 1, 2, 3; 4, 5 masked
VALID = torch.tensor([True, True, True, True, False, False])
ADV = torch.tensor([0.7071, -0.7071, -0.7071, -0.7071, 0.0, 0.0])  # success, failure


@pytest.mark.parametrize("mode", ["equal", "step"])
def test_policy_loss_of_the_first_step_by_hand(mode):
    actor = one_step_grpo_actor(N, episode_weight=mode)
    weight = torch.tensor([2.0, 2 / 3, 2 / 3, 2 / 3, 0.0, 0.0]) if mode == "equal" else None
    batch = own_actions_batch(actor.policy, make_obs(N, seed=2), ADV, VALID, weight=weight)
    metrics = actor.updater.update(batch, iteration=0, total_iterations=1)
    # at the first step every ratio is 1, so each valid sample's loss is -A
    # equal: each episode weighs the same, -(A_success + A_failure) / 2 = 0;
    # step: each chunk step weighs the same, -(1 x 0.7071 - 3 x 0.7071) / 4
    by_hand = 0.0 if mode == "equal" else 2 * 0.7071 / 4
    assert metrics["train/policy_loss"] == pytest.approx(by_hand, abs=1e-5)
