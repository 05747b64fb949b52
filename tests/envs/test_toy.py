"""The toy env and the shared machinery (chunks, auto-reset, groups, stages, offload, video)."""

from __future__ import annotations

import glob
import time

import pytest
import torch

from rlinf_vla.envs import group_reset_ids, make_env, make_stage_envs
from rlinf_vla.envs.toy.env import ToyEnv


def _run_episodes(env: ToyEnv, policy, chunk: int, episodes: int) -> float:
    env.reset()
    done = succ = 0
    while done < episodes:
        res = env.chunk_step(policy(env, chunk))
        d = res.info["done"]
        done += int(d.sum())
        succ += int((res.success & d).sum())
    return succ / done


_GEN = torch.Generator().manual_seed(0)


def _random(env: ToyEnv, chunk: int) -> torch.Tensor:
    return torch.rand(env.num_envs, chunk, env.action_dim, generator=_GEN) * 2 - 1


# The success statistics below do not depend on the rendered images (positions and rewards
# are computed from the state; the same seeds give the same episodes at any image size), so
# these envs render 8 px images: a quarter of the time of the default 64 px.
STATS_IMAGE_SIZE = 8


def test_oracle_always_succeeds() -> None:
    env = make_env("toy", num_envs=64, seed=1, image_size=STATS_IMAGE_SIZE)
    assert _run_episodes(env, lambda e, k: e.oracle_actions(k), chunk=4, episodes=500) == 1.0


def test_random_policy_rarely_succeeds() -> None:
    env = make_env("toy", num_envs=64, seed=2, image_size=STATS_IMAGE_SIZE)
    rate = _run_episodes(env, _random, chunk=4, episodes=1000)
    assert rate < 0.10


def test_success_terminates_with_reward_and_masks_rest_of_chunk() -> None:
    env = make_env("toy", num_envs=8)
    env.reset(torch.arange(8))
    res = env.chunk_step(env.oracle_actions(chunk=30))
    assert res.success.all()
    assert (res.terminated.sum(1) == 1).all()
    assert not res.truncated.any()
    step = res.terminated.float().argmax(1)
    assert torch.equal(res.reward.sum(1), torch.ones(8))
    assert torch.equal(res.reward.argmax(1), step)
    for i in range(8):  # nothing after the end of the episode
        assert not res.reward[i, step[i] + 1 :].any()
    # final_obs shows the agent on the target; obs is a fresh episode
    assert res.final_obs is not None
    target = res.final_obs.state
    assert not torch.allclose(target, res.obs.state)
    assert (res.info["elapsed_steps"] == 0).all()


def test_truncation_is_not_termination() -> None:
    env = make_env("toy", num_envs=2, max_episode_steps=3)
    env.reset()
    res = env.chunk_step(torch.zeros(2, 5, 7))
    assert res.truncated[:, 2].all() and not res.terminated.any()
    assert res.truncated.sum() == 2
    assert not res.success.any()


def test_ignore_terminations_runs_to_time_limit() -> None:
    env = make_env("toy", num_envs=4, max_episode_steps=20, ignore_terminations=True)
    env.reset()
    res = env.chunk_step(env.oracle_actions(chunk=20))
    assert res.success.all()
    assert not res.terminated.any()
    assert res.truncated[:, -1].all()
    assert (res.reward[:, -1] == 1).all()  # still on the target at the end


def test_auto_reset_off_keeps_envs_ended_until_reset() -> None:
    env = make_env("toy", num_envs=2, max_episode_steps=2, auto_reset=False)
    env.reset()
    res = env.chunk_step(torch.zeros(2, 3, 7))
    assert res.truncated[:, 1].all()
    res = env.chunk_step(torch.zeros(2, 3, 7))
    assert not (res.truncated | res.terminated).any() and not res.reward.any()
    env.reset()
    res = env.chunk_step(torch.zeros(2, 1, 7))
    assert (res.info["elapsed_steps"] == 1).all()


def test_same_seed_same_rollout_and_groups_share_ids() -> None:
    def rollout(seed: int) -> list[torch.Tensor]:
        env = make_env("toy", num_envs=6, group_size=3, seed=seed, max_episode_steps=4)
        obs = [env.reset().images["main"]]
        for _ in range(3):
            obs.append(env.chunk_step(torch.ones(6, 3, 7) * 0.3).obs.images["main"])
        ids = env.reset_ids
        assert torch.equal(ids[:3], ids[:1].expand(3)) and torch.equal(ids[3:], ids[3:4].expand(3))
        assert ids[0] != ids[3]
        return obs

    a, b, c = rollout(0), rollout(0), rollout(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])


def test_group_reset_ids_helper() -> None:
    assert group_reset_ids(torch.tensor([4, 9]), 3).tolist() == [4, 4, 4, 9, 9, 9]


def test_reset_ids_wrong_shape() -> None:
    env = make_env("toy", num_envs=3)
    with pytest.raises(ValueError, match=r"\[num_envs\] = \[3\]"):
        env.reset(torch.arange(2))


def test_scene_depends_only_on_reset_id() -> None:
    a = make_env("toy", num_envs=2, seed=0).reset(torch.tensor([5, 6]))
    b = make_env("toy", num_envs=3, seed=9).reset(torch.tensor([0, 6, 5]))
    assert torch.equal(a.images["main"][0], b.images["main"][2])
    assert torch.equal(a.images["main"][1], b.images["main"][1])
    assert a.instruction[0] == b.instruction[2]


def test_stage_envs_continue_global_numbering() -> None:
    full = make_env("toy", num_envs=8, group_size=2)
    stages = make_stage_envs("toy", num_stages=2, num_envs=8, group_size=2)
    assert [s.num_envs for s in stages] == [4, 4]
    whole = full.reset().images["main"]
    parts = torch.cat([s.reset().images["main"] for s in stages])
    assert torch.equal(whole, parts)
    with pytest.raises(ValueError, match="num_stages=3"):
        make_stage_envs("toy", num_stages=3, num_envs=8, group_size=2)


def test_offload_onload_keeps_state() -> None:
    env = make_env("toy", num_envs=4)
    env.reset(torch.arange(4))
    env.chunk_step(torch.full((4, 2, 7), 0.5))
    before = env.elapsed_steps, env._pos.clone()
    env.offload()
    with pytest.raises(RuntimeError, match="offloaded"):
        env.chunk_step(torch.zeros(4, 1, 7))
    env.onload()
    assert torch.equal(env.elapsed_steps, before[0]) and torch.equal(env._pos, before[1])
    res = env.chunk_step(torch.zeros(4, 1, 7))
    assert (res.info["elapsed_steps"] == 3).all()


def test_step_time_emulates_slow_simulator() -> None:
    env = make_env("toy", num_envs=4, step_time_s=0.01, step_time_per_env_s=0.005)
    env.reset()
    t = time.perf_counter()
    env.chunk_step(torch.zeros(4, 5, 7))
    assert time.perf_counter() - t >= 5 * (0.01 + 4 * 0.005)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_toy_on_device(device: str) -> None:
    env = make_env("toy", num_envs=4, device=device)
    obs = env.reset(torch.arange(4))
    assert obs.images["main"].device.type == device
    ref = make_env("toy", num_envs=4).reset(torch.arange(4))
    assert torch.equal(obs.images["main"].cpu(), ref.images["main"])
    res = env.chunk_step(env.oracle_actions(chunk=20))
    assert res.success.all()


def test_video_recording(tmp_path) -> None:
    pytest.importorskip("imageio")
    env = make_env(
        "toy", num_envs=4, video_dir=str(tmp_path), video_env_ids=(0, 2), max_episode_steps=8
    )
    env.reset(torch.arange(4))
    env.chunk_step(env.oracle_actions(chunk=5))
    env.chunk_step(torch.zeros(4, 5, 7))
    env.close()
    files = sorted(glob.glob(str(tmp_path / "*.mp4")))
    names = [f.rsplit("/", 1)[1] for f in files]
    assert any(n.startswith("toy_env0_ep0_") for n in names)
    assert any(n.startswith("toy_env2_ep0_") for n in names)
    assert not any("env1" in n or "env3" in n for n in names)
    import imageio.v2 as imageio

    frames = imageio.mimread(files[0])
    assert len(frames) >= 2 and frames[0].shape[1] == 320


def test_annotate_draws_text() -> None:
    pytest.importorskip("PIL")
    import numpy as np

    from rlinf_vla.envs.video import annotate

    frame = np.zeros((64, 64, 3), dtype=np.uint8)
    out = annotate(frame, "move to the blue square", step=3, success=True)
    assert out.shape == (48 + 320 + 16, 320, 3)
    assert out[:48].any()  # instruction text
    assert (out[48:52, :, 1] > 200).any()  # green success border


def test_center_start_and_single_object() -> None:
    env = make_env("toy", num_envs=16, num_objects=1, agent_start="center")
    obs = env.reset(torch.arange(16))
    assert torch.equal(obs.state, torch.full((16, 2), 0.5))
    # the only object (the target) lies in one of the 8 outer cells, never the centre one
    cell = (env.target_pos * 3).floor()
    assert not ((cell == 1).all(dim=1)).any()
    assert len({tuple(c) for c in cell.tolist()}) > 3  # targets really vary with the reset id


def test_dense_reward_is_progress_plus_success() -> None:
    sparse = make_env("toy", num_envs=4, max_episode_steps=30)
    dense = make_env("toy", num_envs=4, max_episode_steps=30, reward_mode="dense")
    ids = torch.arange(4) + 100
    o = sparse.reset(ids)
    dense.reset(ids)
    d0 = torch.linalg.vector_norm(o.state - sparse.target_pos, dim=1)
    a = torch.zeros(4, 1, 7)
    a[:, 0, 0] = 1.0  # one full step in +x
    rs, rd = sparse.chunk_step(a), dense.chunk_step(a)
    d1 = torch.linalg.vector_norm(rd.obs.state - dense.target_pos, dim=1)
    assert torch.allclose(rd.reward[:, 0], rs.reward[:, 0] + 0.1 * (d0 - d1) / 0.06, atol=1e-5)


def test_bad_new_options_fail() -> None:
    with pytest.raises(ValueError, match="reward_mode"):
        make_env("toy", reward_mode="shaped")
    with pytest.raises(ValueError, match="agent_start"):
        make_env("toy", agent_start="corner")
    with pytest.raises(ValueError, match="num_objects"):
        make_env("toy", num_objects=0)
