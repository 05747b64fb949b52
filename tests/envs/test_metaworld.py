"""MetaWorld: task sets and instructions, reset-id mapping, determinism, images, the shipped
expert, crash recovery."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from rlinf_vla.envs import make_env
from rlinf_vla.envs.metaworld.config import (
    INSTRUCTIONS,
    MT10,
    MT50,
    VARIATIONS_PER_TASK,
    MetaWorldEnvConfig,
)

FAST = {"image_size": 64, "fast_render": True}
NEEDS_METAWORLD = "MetaWorld is not installed: pip install 'rlinf-vla[metaworld]'"


def _require_metaworld() -> None:
    pytest.importorskip("metaworld", reason=NEEDS_METAWORLD)


def test_task_sets_and_instructions() -> None:
    assert len(MT50) == 50 and len(set(MT50)) == 50
    assert set(MT10) <= set(MT50)
    assert all(s and s == s.strip() and s[0].islower() for s in INSTRUCTIONS.values())
    assert MetaWorldEnvConfig().tasks == ("pick-place-v3",)
    assert MetaWorldEnvConfig(task_set="MT10").tasks == MT10
    assert MetaWorldEnvConfig(task_set="MT50").describe() == "MT50"
    assert MetaWorldEnvConfig(task="reach-v3").describe() == "MT1 reach-v3"
    assert MetaWorldEnvConfig(state_mode="full").spec().state_dim == 39
    assert MetaWorldEnvConfig().spec().action_dim == 4
    assert MetaWorldEnvConfig().episode_steps() == 500
    assert MetaWorldEnvConfig(max_episode_steps=100).episode_steps() == 100


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ValueError, match="pick-place-v3"):
        MetaWorldEnvConfig(task="pick-place-v9")
    with pytest.raises(ValueError, match="MT10"):
        MetaWorldEnvConfig(task_set="MT45")
    with pytest.raises(ValueError, match="corner2"):
        MetaWorldEnvConfig(camera="front")


def test_reset_id_mapping_and_eval_trials() -> None:
    task_variation = MetaWorldEnvConfig(task_set="MT10").task_variation  # the default layout
    pairs = {task_variation(r) for r in range(VARIATIONS_PER_TASK * 10)}
    assert len(pairs) == 500
    assert task_variation(3 * 50 + 7) == (3, 7)
    assert task_variation(10 * 50 + 7) == (0, 7)  # wraps around
    trials = MetaWorldEnvConfig(task_set="MT10").eval_trials("metaworld", None, 3, seed=0)
    assert [t["task"] for t in trials[::3]] == list(MT10)
    assert [t["reset_id"] for t in trials[3:6]] == [50, 51, 52]
    with pytest.raises(ValueError, match="trials_per_task"):
        MetaWorldEnvConfig().eval_configs("metaworld", None, 51)


def test_interleaved_reset_ids_spread_an_evaluation_block_over_the_tasks() -> None:
    # train's and sft's evaluations take consecutive ids from a block (2**31 - 2**21 for the
    # validation scenes); by task, 40 of them hold one or two tasks, interleaved 4 of each
    from rlinf_vla.pipelines.evaluation import VALIDATION_RESET_ID_BASE

    cfg = MetaWorldEnvConfig(task_set="MT10", reset_id_layout="interleaved")
    block = range(VALIDATION_RESET_ID_BASE, VALIDATION_RESET_ID_BASE + 40)
    tasks = [cfg.task_variation(r)[0] for r in block]
    assert sorted(tasks) == sorted(list(range(10)) * 4)
    assert len({cfg.task_variation(r) for r in block}) == 40
    by_task = MetaWorldEnvConfig(task_set="MT10")
    assert len({by_task.task_variation(r)[0] for r in block}) == 2
    pairs = {cfg.task_variation(r) for r in range(500)}
    assert len(pairs) == 500
    assert all(cfg.task_variation(cfg.reset_id(p, s)) == (p, s) for p, s in pairs)
    assert all(by_task.task_variation(by_task.reset_id(p, s)) == (p, s) for p, s in pairs)
    trials = cfg.eval_trials("metaworld", None, 2, seed=0)
    assert [cfg.task_variation(t["reset_id"]) for t in trials[2:4]] == [(1, 0), (1, 1)]
    with pytest.raises(ValueError, match="reset_id_layout"):
        MetaWorldEnvConfig(reset_id_layout="random")


def test_task_per_env_keeps_the_drawn_configuration_in_the_envs_own_task() -> None:
    # 6 envs from global env 4 in groups of 2: tasks (4 + i) // 2 % 10 = 2, 2, 3, 3, 4, 4
    cfg = MetaWorldEnvConfig(task_set="MT10", num_envs=6, group_size=2, env_offset=4)
    ids = torch.tensor([123, 123, 7, 7, 499, 499])  # by task: (2, 23), (0, 7), (9, 49)
    assert torch.equal(cfg.pin_task(torch.arange(6), ids), ids)  # off: as drawn
    cfg = MetaWorldEnvConfig(
        task_set="MT10", num_envs=6, group_size=2, env_offset=4, task_per_env=True
    )
    pinned = cfg.pin_task(torch.arange(6), ids)
    assert pinned.tolist() == [123, 123, 157, 157, 249, 249]  # 50 t + configuration
    assert [cfg.task_variation(r) for r in pinned.tolist()][::2] == [(2, 23), (3, 7), (4, 49)]
    cfg = MetaWorldEnvConfig(task_set="MT10", reset_id_layout="interleaved", task_per_env=True)
    # interleaved: id 123 is task 3, configuration 12 -> in task 1: 10 x 12 + 1
    assert cfg.pin_task(torch.tensor([1]), torch.tensor([123])).tolist() == [121]


@pytest.mark.sim
def test_task_per_env_plays_each_envs_task_in_every_episode() -> None:
    _require_metaworld()
    env = make_env(
        "metaworld", task_set="MT10", num_envs=2, task_per_env=True, max_episode_steps=2, **FAST
    )
    try:
        env.reset()
        tasks, configurations = [], set()
        for _ in range(4):  # each chunk of 2 steps ends every episode; the next ones start
            tasks.append(env.task_of(env.reset_ids))
            configurations |= {env.config.task_variation(int(r))[1] for r in env.reset_ids}
            res = env.chunk_step(torch.zeros(2, 2, 4))
            assert (res.terminated | res.truncated).any(dim=1).all()
        assert tasks == [list(MT10[:2])] * 4
        assert len(configurations) > 2  # the configurations are still drawn
    finally:
        env.close()


@pytest.mark.sim
def test_task_lists_match_metaworld() -> None:
    _require_metaworld()
    from metaworld import env_dict
    from metaworld.policies import ENV_POLICY_MAP

    assert tuple(env_dict.MT10_V3) == MT10
    assert tuple(env_dict.MT50_V3) == MT50
    assert set(ENV_POLICY_MAP) == set(MT50)


@pytest.fixture(scope="module")
def mt10():
    """Two MT10 envs with the non-default options (the contract tests cover the defaults)."""
    _require_metaworld()
    env = make_env(
        "metaworld",
        task_set="MT10",
        num_envs=2,
        auto_reset=False,
        state_mode="full",
        reward_mode="dense",
        camera="corner",
        **FAST,
    )
    yield env
    env.close()


@pytest.mark.sim
def test_mt10_tasks_and_instructions(mt10) -> None:
    ids = torch.tensor([3 * VARIATIONS_PER_TASK + 1, 9 * VARIATIONS_PER_TASK])
    obs = mt10.reset(ids)
    assert mt10.task_of(ids) == ["door-open-v3", "window-close-v3"]
    assert obs.instruction == [INSTRUCTIONS["door-open-v3"], INSTRUCTIONS["window-close-v3"]]
    assert mt10.num_reset_ids == 500
    assert mt10.max_episode_steps == 500
    assert obs.state.shape == (2, 39)  # state_mode="full": MetaWorld's whole observation
    assert torch.count_nonzero(obs.state[:, 36:]) > 0  # with the goal position
    res = mt10.chunk_step(torch.zeros(2, 2, 4))
    assert ((res.reward > 0.0) & (res.reward < 10.0)).all()  # MetaWorld's shaped reward


@pytest.mark.sim
def test_normalized_dense_reward_is_metaworlds_own_over_ten() -> None:
    _require_metaworld()
    import metaworld

    actions = np.linspace(-0.8, 0.8, 3 * 4, dtype=np.float32).reshape(3, 4)
    env = make_env(
        "metaworld",
        task="reach-v3",
        num_envs=1,
        auto_reset=False,
        reward_mode="normalized_dense",
        **FAST,
    )
    try:
        env.reset(torch.tensor([7]))  # configuration 7 of scene seed 0
        got = env.chunk_step(torch.from_numpy(actions)[None]).reward[0].tolist()
    finally:
        env.close()
    # the same configuration and actions in MetaWorld itself
    raw = metaworld.env_dict.ALL_V3_ENVIRONMENTS["reach-v3"]()
    raw.set_task(list(metaworld.MT1("reach-v3", seed=0).train_tasks)[7])
    raw.reset()
    expected = [raw.step(a)[1] / 10 for a in actions]
    assert 0 < max(expected) < 1
    assert got == pytest.approx(expected, rel=1e-6)


@pytest.mark.sim
def test_full_state_is_the_spec_state_size(mt10) -> None:
    assert mt10.reset(torch.tensor([0, 1])).state.shape[-1] == mt10.config.spec().state_dim


@pytest.mark.sim
def test_same_reset_id_gives_the_same_scene(mt10) -> None:
    pick = 2 * VARIATIONS_PER_TASK  # pick-place-v3, configuration 0
    first = mt10.reset(torch.tensor([pick + 4, pick + 4]))  # two processes, one id
    assert torch.equal(first.images["main"][0], first.images["main"][1])
    assert torch.equal(first.state[0], first.state[1])
    state = mt10.sim_state(0)
    other = mt10.reset(torch.tensor([3, pick + 5]))  # another task, another configuration
    assert not torch.equal(other.images["main"][1], first.images["main"][1])
    mt10.chunk_step(torch.rand(2, 3, 4) * 2 - 1)
    again = mt10.reset(torch.tensor([pick + 4, pick + 4]))  # after other episodes: the same
    assert torch.equal(again.images["main"], first.images["main"])
    assert torch.equal(again.state, first.state)
    for key, value in mt10.sim_state(0).items():
        np.testing.assert_array_equal(value, state[key], err_msg=key)


@pytest.mark.sim
def test_images_change_when_the_arm_moves(mt10) -> None:
    obs = mt10.reset(torch.tensor([100, 100]))  # one scene in both envs
    assert obs.images["main"].shape == (2, 64, 64, 3)
    assert torch.equal(obs.images["main"][0], obs.images["main"][1])
    actions = torch.zeros(2, 12, 4)
    actions[:, :, 3] = -1.0  # the gripper stays open, as the reset leaves it
    actions[0, :, 2] = 1.0  # env 0 lifts its hand, env 1 holds still
    res = mt10.chunk_step(actions)
    diff = (res.obs.images["main"][0].int() - res.obs.images["main"][1].int()).abs()
    assert diff.max() > 100 and (diff.amax(-1) > 32).float().mean() > 0.01  # the arm's pixels
    assert res.obs.state[0, 2] - obs.state[0, 2] > 0.05  # about 1 cm per step
    assert abs(res.obs.state[1, 2] - obs.state[1, 2]) < 0.005


@pytest.mark.sim
def test_shipped_expert_solves_pick_place(mt10) -> None:
    mt10.reset(torch.tensor([100, 101]))  # pick-place-v3, configurations 0 and 1
    success = torch.zeros(2, dtype=torch.bool)
    for _ in range(150):
        res = mt10.chunk_step(mt10.expert_actions()[:, None])
        success |= res.success
        if res.info["done"].all():
            break
    assert success.all()
    assert res.terminated.any(1).all()  # success ends the episode
    assert (res.info["elapsed_steps"] < 150).all()


@pytest.mark.sim
def test_killed_worker_is_restarted_and_episode_invalid(mt10) -> None:
    mt10.reset(torch.tensor([100, 101]))
    proc = mt10.workers.process(1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    res = mt10.chunk_step(torch.zeros(2, 2, 4))
    assert res.info["invalid"].tolist() == [False, True]
    assert res.truncated[1, 0] and not res.success[1]
    assert mt10.workers.restarts == [0, 1]
    obs = mt10.reset(torch.tensor([100, 100]))  # the restarted worker serves the same scene
    assert torch.equal(obs.images["main"][0], obs.images["main"][1])
