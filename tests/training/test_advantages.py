"""The actor's batch: advantages of a rollout as the actor computes them, against numbers worked
out by hand, and the frozen features the rollout sends with it."""

import dataclasses

import pytest
import torch

from rlinf_vla.config import ConfigError
from rlinf_vla.pipelines.rollout import Trajectory
from rlinf_vla.training.algo_config import AlgoConfig
from rlinf_vla.training.batch import build_batch
from rlinf_vla.training.batch import trajectory_advantages as _advantages
from rlinf_vla.types import Observation


def _trajectory(reward, terminated, truncated, value, final_value):
    T, b, K = reward.shape
    obs = [
        Observation(
            images={"main": torch.zeros(b, 2, 2, 3, dtype=torch.uint8)},
            state=None,
            instruction=["x"] * b,
        )
    ] * T
    return Trajectory(
        obs=obs,
        replay={"tokens": torch.arange(T * b).reshape(T, b)},
        actions=torch.zeros(T, b, K, 1),
        logprob=torch.zeros(T, b),
        value=value,
        final_value=final_value,
        reward=reward,
        terminated=terminated,
        truncated=truncated,
        invalid=torch.zeros(T, b, dtype=torch.bool),
        source=(0, 0),
    )


def _time_limit_rollout():
    """One env, T=3 chunks of K=2 steps, cut by the time limit inside chunk 1 (final value 3)."""
    reward = torch.tensor([[[1.0, 0.5]], [[0.0, 2.0]], [[1.0, 1.0]]])  # chunk rewards 1.5, 2, 2
    truncated = torch.zeros(3, 1, 2, dtype=torch.bool)
    truncated[1, 0, 0] = True
    terminated = torch.zeros(3, 1, 2, dtype=torch.bool)
    value = torch.tensor([[0.5], [1.0], [0.25], [4.0]])
    final_value = torch.tensor([[0.0], [3.0], [0.0]])
    return _trajectory(reward, terminated, truncated, value, final_value)


def test_ppo_gae_over_chunks_by_hand():
    # Chunk 1 bootstraps from final_value and chunk 0's recursion stops there.
    adv, ret, mask = _advantages(_time_limit_rollout(), AlgoConfig(gamma=0.5, lam=0.5))
    # chunk 2: delta = 2 + 0.5 * 4 - 0.25 = 3.75
    # chunk 1 (truncated): delta = 2 + 0.5 * 3 - 1 = 2.5, no carry from chunk 2
    # chunk 0: delta = 1.5 + 0.5 * 1 - 0.5 = 1.5, plus 0.25 * 2.5 = 2.125
    assert torch.allclose(adv[:, 0], torch.tensor([2.125, 2.5, 3.75]))
    assert torch.allclose(ret[:, 0], torch.tensor([2.625, 3.5, 4.0]))
    assert mask.all()


def test_ppo_gae_with_the_time_limit_terminal():
    # The same rollout with algo.bootstrap_truncated=false: chunk 1, cut by the time limit,
    # continues from 0 instead of final_value; chunks 0 and 2 as before.
    algo = AlgoConfig(gamma=0.5, lam=0.5, bootstrap_truncated=False)
    adv, ret, _ = _advantages(_time_limit_rollout(), algo)
    # chunk 2: 3.75 as before; the rollout's end still bootstraps from values[3] = 4
    # chunk 1: delta = 2 + 0.5 * 0 - 1 = 1
    # chunk 0: delta = 1.5, plus 0.25 * 1 = 1.75
    assert torch.allclose(adv[:, 0], torch.tensor([1.75, 1.0, 3.75]))
    assert torch.allclose(ret[:, 0], torch.tensor([2.25, 2.0, 4.0]))


def test_ppo_gae_with_scaled_rewards():
    # The same rollout with algo.reward_scale=2: the rewards double, the critic's values (the
    # scale it has learned) are used as they are.
    algo = AlgoConfig(gamma=0.5, lam=0.5, reward_scale=2.0)
    adv, ret, _ = _advantages(_time_limit_rollout(), algo)
    # chunk 2: delta = 4 + 0.5 * 4 - 0.25 = 5.75
    # chunk 1 (truncated): delta = 4 + 0.5 * 3 - 1 = 4.5
    # chunk 0: delta = 3 + 0.5 * 1 - 0.5 = 3, plus 0.25 * 4.5 = 4.125
    assert torch.allclose(adv[:, 0], torch.tensor([4.125, 4.5, 5.75]))
    assert torch.allclose(ret[:, 0], torch.tensor([4.625, 5.5, 6.0]))


def test_a_reward_scale_of_zero_is_refused():
    with pytest.raises(ConfigError, match=r"algo.reward_scale must be > 0, got 0.0"):
        AlgoConfig(reward_scale=0.0)


def test_grpo_scores_first_episode_per_group():
    # 4 envs in 2 groups of 2, T=3 chunks of K=1. Env 0 succeeds at chunk 1 (reward 1), then
    # a second episode earns another reward that must not count; env 1 never succeeds; env 2
    # and env 3 both succeed: equal scores give advantage 0.
    reward = torch.zeros(3, 4, 1)
    terminated = torch.zeros(3, 4, 1, dtype=torch.bool)
    reward[1, 0, 0] = 1.0
    terminated[1, 0, 0] = True
    reward[2, 0, 0] = 1.0  # second episode of env 0
    for env, t in ((2, 0), (3, 2)):
        reward[t, env, 0] = 1.0
        terminated[t, env, 0] = True
    truncated = torch.zeros_like(terminated)
    zeros = torch.zeros(3, 4)
    traj = _trajectory(reward, terminated, truncated, torch.zeros(4, 4), zeros)
    adv, ret, mask = _advantages(traj, AlgoConfig(name="grpo", group_size=2))
    # GRPO's default gamma is 1: the score is the plain return.
    # group (env0, env1): scores (1, 0): mean 0.5, unbiased std sqrt(0.5) -> +-0.7071
    s = 0.5 / 0.5**0.5
    expected = torch.tensor([s, -s, 0.0, 0.0])
    assert torch.allclose(adv, expected.expand(3, -1), atol=1e-4)
    assert torch.equal(ret[0], torch.tensor([1.0, 0.0, 1.0, 1.0]))
    # env 0's second episode (chunk 2) and env 2's steps after its success are masked out.
    assert mask.T.tolist() == [
        [True, True, False],
        [True, True, True],
        [True, False, False],
        [True, True, True],
    ]
    # gamma < 1: the score is discounted per chunk step (env 0 succeeds at t=1, env 3 at t=2),
    # so the sooner success of the group (env 2, env 3) gets the positive advantage.
    adv, ret, _ = _advantages(traj, AlgoConfig(name="grpo", group_size=2, gamma=0.5))
    assert torch.equal(ret[0], torch.tensor([0.5, 0.0, 1.0, 0.25]))
    assert torch.allclose(adv[0], torch.tensor([s, -s, s, -s]), atol=1e-4)


def test_the_presets_defaults_and_overrides_and_unknown_names_fail():
    import yaml

    from rlinf_vla.algos.presets import PRESET_DIR

    for name in ("ppo", "grpo", "dapo", "reinforce_pp", "rloo"):
        written = yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())
        algo = AlgoConfig(name=name)
        for key, value in written.items():
            assert getattr(algo, key) == value, (name, key)
    assert AlgoConfig().gamma == 0.99 and AlgoConfig().lam == 0.95
    assert AlgoConfig(name="grpo").gamma == 1.0 and AlgoConfig(name="grpo").group_size == 4
    assert AlgoConfig(name="grpo", group_size=2, gamma=0.8).gamma == 0.8
    assert AlgoConfig(name="ppo").group_size == 1
    with pytest.raises(ConfigError, match="known: dagger, dapo, grpo, ppo, reinforce_pp, rloo"):
        AlgoConfig(name="reinforce")
    with pytest.raises(ConfigError, match=r"algo\.clip_low must lie in \[0, 1\).*algo\.lr"):
        AlgoConfig(clip_low=-0.5, lr=-1)


def _episodes():
    """4 envs in 2 groups of 2, T=3 chunks of K=1: env 0 succeeds at chunk 1 then earns a
    reward in a second episode, env 1 never succeeds, env 2 succeeds at chunk 0 and env 3 at
    chunk 2."""
    reward = torch.zeros(3, 4, 1)
    terminated = torch.zeros(3, 4, 1, dtype=torch.bool)
    for env, t in ((0, 1), (2, 0), (3, 2)):
        reward[t, env, 0] = 1.0
        terminated[t, env, 0] = True
    reward[2, 0, 0] = 1.0  # second episode of env 0
    zeros = torch.zeros(3, 4)
    return _trajectory(reward, terminated, torch.zeros_like(terminated), torch.zeros(4, 4), zeros)


def test_rloo_baselines_each_episode_by_the_other_of_its_group():
    adv, ret, mask = _advantages(_episodes(), AlgoConfig(name="rloo", group_size=2, gamma=0.5))
    # scores: env0 0.5 (t=1), env1 0, env2 1 (t=0), env3 0.25 (t=2); with G=2 the baseline of
    # each is the other's score: 0.5, -0.5, 0.75, -0.75
    assert torch.equal(ret[0], torch.tensor([0.5, 0.0, 1.0, 0.25]))
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.75, -0.75]).expand(3, -1))
    assert mask[:, 0].tolist() == [True, True, False]


def test_dapo_masks_out_groups_whose_episodes_all_scored_the_same():
    traj = _episodes()
    adv, _, mask = _advantages(traj, AlgoConfig(name="dapo", group_size=2))
    # undiscounted scores: (1, 0) and (1, 1): the second group teaches nothing
    assert not mask[:, 2:].any()
    assert mask[:, 0].tolist() == [True, True, False] and mask[:, 1].all()
    s = 0.5 / 0.5**0.5
    assert torch.allclose(adv[:, :2], torch.tensor([s, -s]).expand(3, -1), atol=1e-4)


def test_reinforce_pp_discounts_within_episodes_and_whitens_over_the_batch():
    adv, ret, mask = _advantages(_episodes(), AlgoConfig(name="reinforce_pp", gamma=0.5))
    # env 0: rewards (0, 1 | 1): G = (0.5, 1 | 1); env 1: 0; env 2: (1 | 0, 0) -> (1, 0, 0);
    # env 3: (0, 0, 1) -> (0.25, 0.5, 1)
    expected = torch.tensor([[0.5, 0.0, 1.0, 0.25], [1.0, 0.0, 0.0, 0.5], [1.0, 0.0, 0.0, 1.0]])
    assert torch.allclose(ret, expected)
    whitened = (expected - expected.mean()) / (expected.std() + 1e-8)
    assert torch.allclose(adv, whitened, atol=1e-5)
    assert mask.all()


def test_build_batch_flattens_time_and_envs():
    reward = torch.zeros(2, 3, 1)
    flags = torch.zeros(2, 3, 1, dtype=torch.bool)
    traj = _trajectory(reward, flags, flags, torch.zeros(3, 3), torch.zeros(2, 3))
    batch = build_batch([traj, traj], AlgoConfig())
    assert len(batch) == 12
    assert batch.obs.batch_size == 12
    assert batch.replay["tokens"].tolist() == [0, 1, 2, 3, 4, 5] * 2


def test_build_batch_keeps_the_rollouts_features_in_sample_order():
    reward = torch.zeros(2, 3, 1)
    flags = torch.zeros(2, 3, 1, dtype=torch.bool)
    traj = _trajectory(reward, flags, flags, torch.zeros(3, 3), torch.zeros(2, 3))
    assert build_batch([traj], AlgoConfig()).features is None
    with_features = [
        dataclasses.replace(traj, features=torch.arange(12.0).reshape(2, 3, 2) + 100 * i)
        for i in range(2)
    ]
    batch = build_batch(with_features, AlgoConfig())
    # sample n = (trajectory, t, env) in the order of the replay's tokens
    expected = [[100 * i + 2 * n, 100 * i + 2 * n + 1] for i in range(2) for n in range(6)]
    assert batch.features.tolist() == expected
    assert batch.select(torch.tensor([7, 0])).features.tolist() == [expected[7], expected[0]]
    # one trajectory without them (a policy that does not compute them): none at all
    assert build_batch([with_features[0], traj], AlgoConfig()).features is None


def test_the_actor_takes_the_frozen_features_the_rollout_sent():
    from rlinf_vla.training.batch import Batch
    from tests.training.actors import local_actor

    actor = local_actor(
        "openvla",
        {"name": "ppo"},
        preset="tiny",
        lora_rank=4,
        lora_target_modules=".*lm_head",
        seed=0,
    )
    obs = Observation(
        images={"main": torch.randint(0, 256, (3, 32, 32, 3), dtype=torch.uint8)},
        state=None,
        instruction=["pick up the cube"] * 3,
    )
    out, sent = actor.policy.act_with_features(obs)
    batch = Batch(
        obs=obs,
        replay=out.replay,
        old_logprob=out.logprob,
        old_value=out.value,
        advantages=torch.zeros(3),
        returns=torch.zeros(3),
        mask=torch.ones(3, dtype=torch.bool),
    )
    computed = actor.updater.frozen_features(
        batch
    )  # none sent: the actor's own (teacher-forced) pass
    torch.testing.assert_close(computed, sent, rtol=1e-5, atol=1e-5)

    def frozen_pass(*args):
        raise AssertionError("the actor ran the frozen pass although the rollout sent it")

    actor.policy.frozen_features = frozen_pass
    marked = sent + 1.0
    assert torch.equal(
        actor.updater.frozen_features(dataclasses.replace(batch, features=marked)), marked
    )


def test_a_new_group_estimator_needs_only_its_function_and_a_preset(monkeypatch, tmp_path):
    """The recipe of docs/algorithms.md: register the function with its kind, write the YAML;
    the embodied trainer calls it as its kind says (here a "best of the others" baseline, by
    hand)."""
    from rlinf_vla.algos import ADVANTAGES, ALGORITHMS
    from rlinf_vla.algos.advantages import Estimator
    from rlinf_vla.algos.presets import load_preset

    def max_baseline(*, scores, group_size):
        """``A_i = s_i - max_{j != i} s_j``. Shapes: ``scores [N]`` -> ``[N]``."""
        s = scores.view(-1, group_size)
        others = torch.stack(
            [torch.cat([row[:i], row[i + 1 :]]).max() for row in s for i in range(group_size)]
        )
        return scores - others, scores.clone()

    monkeypatch.setitem(ADVANTAGES._entries, "max_baseline", Estimator(max_baseline, "group"))
    (tmp_path / "vs_best.yaml").write_text(
        "name: vs_best\nadvantage: max_baseline\nuse_critic: false\nagg: token-mean\n"
    )
    monkeypatch.setitem(ALGORITHMS._entries, "vs_best", load_preset(tmp_path / "vs_best.yaml"))
    adv, _, mask = _advantages(_episodes(), AlgoConfig(name="vs_best", group_size=2))
    # scores (1, 0 | 1, 1): 1 - 0, 0 - 1, 1 - 1, 1 - 1
    assert torch.equal(adv[0], torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert mask[:, 0].tolist() == [True, True, False]
