"""The gymnasium vector view of the envs, driven through gymnasium's own wrappers."""

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode
from gymnasium.wrappers.vector import RecordEpisodeStatistics, RescaleAction

from rlinf_vla.envs import make_env, make_gym_env


def test_spaces_hold_what_reset_and_step_return():
    env = make_gym_env("toy", num_envs=3, image_size=32)
    assert env.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
    assert env.single_action_space.shape == (7,) and env.action_space.shape == (3, 7)
    assert env.single_observation_space["images"]["main"].shape == (32, 32, 3)
    assert env.single_observation_space["state"].shape == (2,)
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    assert obs["images"]["main"].dtype == np.uint8 and obs["images"]["main"].shape == (3, 32, 32, 3)
    assert len(obs["instruction"]) == 3 and all(isinstance(s, str) for s in obs["instruction"])
    obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
    assert env.observation_space.contains(obs)
    assert reward.shape == terminated.shape == truncated.shape == (3,)
    assert set(info) >= {"success", "_success", "invalid", "reset_id"}
    with pytest.raises(ValueError, match=r"\[num_envs, action_dim\] = \[3, 7\]"):
        env.step(np.zeros((3, 1, 7)))
    env.close()


def test_a_seed_selects_the_scenes_as_gymnasium_seeds_vector_envs():
    env = make_gym_env("toy", num_envs=3)
    first, info = env.reset(seed=5)
    assert info["reset_id"].tolist() == [5, 6, 7]
    again, _ = env.reset(seed=5)
    assert np.array_equal(first["images"]["main"], again["images"]["main"])
    twin = make_env("toy", num_envs=3)  # the same scenes through the env itself
    assert np.array_equal(twin.reset([5, 6, 7]).images["main"].numpy(), first["images"]["main"])
    _, info = env.reset(options={"reset_ids": [9, 9, 2]})
    assert info["reset_id"].tolist() == [9, 9, 2]
    env.close()
    twin.close()


def test_record_episode_statistics_sees_each_episode_the_env_played():
    env = RecordEpisodeStatistics(make_gym_env("toy", num_envs=4))
    inner = env.unwrapped
    env.reset(seed=0)
    returns, lengths = np.zeros(4), np.zeros(4, dtype=int)
    episodes = []
    for _ in range(40):
        # the toy env's oracle acts: every episode succeeds within its 16 steps
        obs, reward, terminated, truncated, info = env.step(inner.env.expert_actions().numpy())
        returns += reward
        lengths += 1
        ended = terminated | truncated
        if ended.any():
            assert info["_episode"].tolist() == ended.tolist()
            assert info["_final_obs"].tolist() == ended.tolist()
            for i in np.flatnonzero(ended):
                assert info["episode"]["r"][i] == returns[i] == 1.0
                assert info["episode"]["l"][i] == lengths[i]
                assert info["final_info"]["success"][i]
                # the final observation is the episode's last, the returned one the next's first
                assert not np.array_equal(info["final_obs"][i]["state"], obs["state"][i])
                episodes.append(int(lengths[i]))
            returns[ended], lengths[ended] = 0, 0
    assert len(episodes) >= 8 and max(episodes) <= 16


def test_gymnasiums_action_rescaling_reaches_the_env():
    rescaled = RescaleAction(make_gym_env("toy", num_envs=2), np.float32(0), np.float32(1))
    twin = make_gym_env("toy", num_envs=2)
    other = make_gym_env("toy", num_envs=2)
    for env in (rescaled, twin, other):
        env.reset(seed=1)
    action = np.full((2, 7), 0.75, dtype=np.float32)
    a, *_ = rescaled.step(action)  # [0, 1] -> [-1, 1]: 0.75 -> 0.5
    b, *_ = twin.step(np.full((2, 7), 0.5, dtype=np.float32))
    c, *_ = other.step(action)
    assert np.allclose(a["state"], b["state"])
    assert not np.allclose(a["state"], c["state"])
