"""Scripted experts behind ``VectorEnv.expert_actions``: the ManiSkill experts solve fixed scenes
(in-process cores for speed, and once through the subprocess workers), recover from a
disturbance, compute the same actions one env at a time as in a batch, and fail clearly for
tasks and control modes they do not support; the toy env's expert reaches its targets."""

from __future__ import annotations

import types

import pytest
import torch

from rlinf_vla.envs import make_env
from rlinf_vla.envs.base import EnvConfig, StepOutput, VectorEnv

# Expert-solved scenes per task (reset ids), each within the task's 50-step limit.
SEEDS = (0, 1, 2)
TASKS = ("PickCube-v1", "PushCube-v1", "StackCube-v1")
LIMIT = 50
# The actors each expert reads (the first is the one it grasps or pushes).
ACTORS = {
    "PickCube-v1": ("cube", "goal_site"),
    "PushCube-v1": ("obj", "goal_region"),
    "StackCube-v1": ("cubeA", "cubeB"),
}


@pytest.fixture(scope="module")
def maniskill():
    return pytest.importorskip("mani_skill")


@pytest.fixture(scope="module")
def cores(maniskill):
    """``cores(task, **config)``: a ManiSkill env core in this process (what a CPU worker runs),
    tiny images, cached for the module. They stay alive together: the first picture of a core
    built after all others were freed compiles the renderer's shaders again (seconds)."""
    from rlinf_vla.envs.maniskill.config import ManiSkillEnvConfig
    from rlinf_vla.envs.maniskill.env import ManiSkillCore

    built: dict[tuple, ManiSkillCore] = {}

    def get(task: str, **overrides):
        key = (task, *sorted(overrides.items()))
        if key not in built:
            built[key] = ManiSkillCore(ManiSkillEnvConfig(task=task, image_size=16, **overrides))
        return built[key]

    yield get
    for core in built.values():
        core.close()


@pytest.fixture(params=TASKS)
def core(request, cores):
    return cores(request.param)


def _run(core, reset_id: int, steps: int = LIMIT) -> int | None:
    """Steps the expert needed to succeed from ``reset_id`` (``None``: not within ``steps``)."""
    core.reset(reset_id)
    for t in range(steps):
        action = core.expert_action()
        assert action.shape == (7,) and action.dtype.name == "float32"
        assert abs(action).max() <= 1.0
        _, _, _, success = core.step(action, False)
        if success:
            return t + 1
    return None


@pytest.mark.sim
def test_expert_solves_fixed_scenes(core) -> None:
    lengths = {rid: _run(core, rid) for rid in SEEDS}
    assert all(n is not None for n in lengths.values()), (core.cfg.task, lengths)


@pytest.mark.sim
def test_expert_acts_the_same_on_a_batch_as_one_env_at_a_time(core) -> None:
    """Snapshots of three states (different phases) stacked into one batch of fake actors give
    the actions the expert computed for each state alone: the code is batch-shaped, as the GPU
    simulator (all envs in one process) needs."""
    from mani_skill.utils.structs import Pose

    env, names = core.env, ACTORS[core.cfg.task]
    snaps, actions = [], []
    for rid, steps in ((0, 0), (1, 9), (2, 16)):
        core.reset(rid)
        for _ in range(steps):
            core.step(core.expert_action(), False)
        actions.append(core.expert_action())
        expert = core.expert
        snaps.append(
            {
                "tcp": env.agent.tcp.pose.raw_pose.clone(),
                "root": expert.arm.root_link.pose.raw_pose.clone(),
                "qpos": env.agent.robot.get_qpos().clone(),
                "grasp": env.agent.is_grasping(getattr(env, names[0])).clone(),
                **{n: getattr(env, n).pose.raw_pose.clone() for n in names},
            }
        )
    batch = {k: torch.cat([s[k] for s in snaps]) for k in snaps[0]}

    def actor(raw: torch.Tensor) -> types.SimpleNamespace:
        return types.SimpleNamespace(pose=Pose.create(raw))

    fake_env = types.SimpleNamespace(
        **{n: actor(batch[n]) for n in names},
        agent=types.SimpleNamespace(
            tcp=actor(batch["tcp"]),
            robot=types.SimpleNamespace(get_qpos=lambda: batch["qpos"]),
            is_grasping=lambda obj: batch["grasp"],
        ),
    )
    expert = core.expert
    real_env, real_arm = expert.env, expert.arm
    try:
        expert.env = fake_env
        expert.arm = types.SimpleNamespace(root_link=actor(batch["root"]))
        batched = expert.act()
    finally:
        expert.env, expert.arm = real_env, real_arm
    assert batched.shape == (3, 7)
    torch.testing.assert_close(batched, torch.stack([torch.from_numpy(a) for a in actions]))


@pytest.mark.sim
def test_pick_expert_regrasps_a_cube_knocked_out_of_the_hand(cores) -> None:
    from mani_skill.utils.structs import Pose

    core = cores("PickCube-v1")
    core.reset(0)
    env = core.env
    moved = False
    for _ in range(80):
        held = bool(env.agent.is_grasping(env.cube)[0]) and env.cube.pose.p[0, 2] > 0.05
        if held and not moved:  # drop it on the table, on the other side
            p = env.cube.pose.p.clone()
            p[0, :2] = -p[0, :2] * 0.5 - 0.03
            p[0, 2] = 0.02
            env.cube.set_pose(Pose.create_from_pq(p, env.cube.pose.q))
            moved = True
        if core.step(core.expert_action(), False)[3]:
            break
    else:
        pytest.fail("no success within 80 steps after the disturbance")
    assert moved


@pytest.mark.sim
def test_gripper_follows_the_env_convention(cores) -> None:
    native = cores("PushCube-v1", gripper_convention="native")
    native.reset(0)
    assert native.expert_action()[-1] == -1.0  # pushes with closed fingers: ManiSkill's -1


@pytest.mark.sim
def test_expert_actions_through_the_cpu_workers(maniskill) -> None:
    env = make_env(
        "maniskill",
        task="PickCube-v1",
        num_envs=2,
        sim_backend="cpu",
        image_size=16,
        auto_reset=False,
    )
    try:
        env.reset(torch.tensor([3, 4]))
        solved = torch.zeros(2, dtype=torch.bool)
        for _ in range(env.max_episode_steps):
            actions = env.expert_actions()
            assert actions.shape == (2, 7) and actions.dtype == torch.float32
            solved |= env.chunk_step(actions[:, None]).success
            if solved.all():
                break
        assert solved.all(), solved
    finally:
        env.close()


@pytest.mark.sim
@pytest.mark.parametrize(
    ("task", "control_mode", "match"),
    [
        ("PullCube-v1", "pd_ee_delta_pose", "tasks with an expert: .*PickCube-v1"),
        ("PickCube-v1", "pd_joint_delta_pos", "control_mode='pd_ee_delta_pose'"),
    ],
)
def test_unsupported_task_or_control_mode_fails_clearly(cores, task, control_mode, match) -> None:
    core = cores(task, control_mode=control_mode)
    core.reset(0)
    with pytest.raises(ValueError, match=match):
        core.expert_action()


def test_expert_registry_names_supported_tasks() -> None:
    from rlinf_vla.envs.maniskill.experts import EXPERTS, check_expert

    assert set(TASKS) <= set(EXPERTS)
    with pytest.raises(
        ValueError, match=r"no scripted expert for ManiSkill task 'PegInsertionSide"
    ):
        check_expert("PegInsertionSide-v1", "pd_ee_delta_pose")
    with pytest.raises(ValueError, match="pd_joint_pos"):
        check_expert("PickCube-v1", "pd_joint_pos")


class _NoExpert(VectorEnv):
    """The smallest env: no expert."""

    @property
    def action_dim(self) -> int:
        return 2

    def _reset_envs(self, env_ids, reset_ids):
        raise NotImplementedError

    def _step_envs(self, actions, active, need_obs) -> StepOutput:
        raise NotImplementedError


def test_default_expert_actions_fail_naming_the_env() -> None:
    env = _NoExpert(EnvConfig(), default_max_episode_steps=5)
    with pytest.raises(NotImplementedError, match=r"_NoExpert.*no scripted expert"):
        env.expert_actions()


def test_toy_expert_reaches_every_target() -> None:
    env = make_env("toy", num_envs=16, auto_reset=False)
    env.reset(torch.arange(16))
    solved = torch.zeros(16, dtype=torch.bool)
    for _ in range(env.max_episode_steps):
        actions = env.expert_actions()
        assert actions.shape == (16, env.action_dim) and actions.dtype == torch.float32
        solved |= env.chunk_step(actions[:, None]).success
    assert solved.all()


# -- DAgger's labels: chunk_step(actions, expert=True) ------------------------------------------
def _labels_one_step_at_a_time(env, reset_ids, actions) -> torch.Tensor:
    """The expert's own action before each step of ``actions [B, K, A]``, asking it step by
    step on an env that executes the chunk one action at a time (``auto_reset=False``)."""
    env.reset(reset_ids)
    out = []
    for k in range(actions.shape[1]):
        out.append(env.expert_actions())
        env.chunk_step(actions[:, k : k + 1])
    return torch.stack(out, dim=1)


def test_dagger_labels_are_the_toy_experts_actions_in_the_visited_states() -> None:
    # by hand: the toy expert heads straight at the target, (target - pos) / step clipped to 1
    env = make_env("toy", num_envs=3, action_dim=2, auto_reset=False, num_objects=1)
    env.reset(torch.tensor([5, 6, 7]))
    actions = torch.rand(3, 4, 2, generator=torch.Generator().manual_seed(0)) * 2 - 1
    want, pos = [], env._pos.clone()
    for k in range(4):
        want.append(((env.target_pos - pos) / env.cfg.step_size).clamp(-1, 1))
        pos = (pos + actions[:, k] * env.cfg.step_size).clamp(0, 1)
    result = env.chunk_step(actions, expert=True)
    torch.testing.assert_close(result.info["expert_actions"], torch.stack(want, 1))
    assert "expert_actions" not in env.chunk_step(actions).info  # only when asked


def test_dagger_labels_of_an_env_that_ended_repeat_its_last_label() -> None:
    env = make_env("toy", num_envs=2, action_dim=2, max_episode_steps=2, auto_reset=True)
    env.reset(torch.tensor([1, 2]))
    result = env.chunk_step(torch.zeros(2, 4, 2), expert=True)
    labels = result.info["expert_actions"]
    assert result.truncated[:, 1].all()  # both ended at the chunk's second step
    assert torch.equal(labels[:, 2], labels[:, 1]) and torch.equal(labels[:, 3], labels[:, 1])
    assert not torch.equal(labels[:, 0], torch.zeros_like(labels[:, 0]))


@pytest.mark.sim
def test_dagger_labels_are_the_maniskill_experts_actions_in_the_visited_states(
    maniskill,
) -> None:
    # the same scenes and the same random chunk on two envs: one labels the chunk's states in
    # chunk_step, the other steps one action at a time and asks the expert before each step
    config = {"task": "PushCube-v1", "num_envs": 2, "sim_backend": "cpu", "image_size": 16}
    ids = torch.tensor([11, 12])
    actions = torch.rand(2, 3, 7, generator=torch.Generator().manual_seed(1)) * 2 - 1
    stepwise = make_env("maniskill", **config, auto_reset=False)
    try:
        want = _labels_one_step_at_a_time(stepwise, ids, actions)
    finally:
        stepwise.close()
    env = make_env("maniskill", **config)
    try:
        env.reset(ids)
        got = env.chunk_step(actions, expert=True).info["expert_actions"]
    finally:
        env.close()
    assert got.shape == (2, 3, 7)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not torch.allclose(got[:, 0], got[:, 2])  # the states moved between the labels
