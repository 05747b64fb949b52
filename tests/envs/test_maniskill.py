"""ManiSkill3 on the CPU backend (envs in subprocesses)."""

from __future__ import annotations

import pytest
import torch

from rlinf_vla.envs import make_env

pytestmark = pytest.mark.sim


@pytest.fixture(scope="module")
def maniskill():
    return pytest.importorskip("mani_skill")


# PickCube with the Panda's hand camera, small images, the dense reward.
WRIST = {
    "task": "PickCube-v1",
    "num_envs": 1,
    "image_size": 64,
    "robot": "panda_wristcam",
    "reward_mode": "dense",
    "sim_backend": "cpu",
    "fast_render": False,  # the full meshes (the reference of the fast-render test)
}


@pytest.fixture(scope="module")
def wrist_env(maniskill):
    env = make_env("maniskill", **WRIST)
    yield env
    env.close()


def test_pickcube_with_cameras(wrist_env) -> None:
    env = wrist_env
    obs = env.reset(torch.tensor([0]))
    assert set(obs.images) == {"main", "wrist"}
    assert obs.images["main"].shape == (1, 64, 64, 3)
    assert obs.images["main"].float().std() > 5  # a real picture, not a blank frame
    assert obs.state.shape == (1, 16)  # 9 joint positions + TCP pose (7)
    assert obs.instruction == ["pick up the red cube and move it to the green target"]
    assert env.max_episode_steps == 50 and env.action_dim == 7


def test_dense_reward_and_gripper_convention(wrist_env) -> None:
    env = wrist_env
    env.reset(torch.tensor([1]))
    close = torch.zeros(1, 8, 7)
    close[..., 6] = 1.0  # +1 closes (the default "close_positive" convention)
    res = env.chunk_step(close)
    assert (res.reward > 0).all()  # dense reward: reaching term
    fingers_closed = res.obs.state[0, 7:9].abs().sum()
    res = env.chunk_step(-close)
    fingers_open = res.obs.state[0, 7:9].abs().sum()
    assert fingers_closed < fingers_open


def test_fast_render_draws_nearly_the_same_picture(wrist_env) -> None:
    """Decimated meshes: the same scene within a small fraction of a grey level on average
    (the arm's silhouette moves by a pixel here and there), but not the identical picture."""
    full = wrist_env.reset(torch.tensor([2]))
    fast_env = make_env("maniskill", **{**WRIST, "fast_render": True})
    try:
        fast = fast_env.reset(torch.tensor([2]))
        torch.testing.assert_close(fast.state, full.state)  # rendering only: same physics
        diff = (fast.images["main"].float() - full.images["main"].float()).abs()
        assert 0 < diff.mean() < 1.5, diff.mean()
        assert (diff.amax(-1) > 32).float().mean() < 0.02
        step = torch.zeros(1, 4, 7)
        torch.testing.assert_close(
            fast_env.chunk_step(step).obs.state, wrist_env.chunk_step(step).obs.state
        )
    finally:
        fast_env.close()


def test_unknown_task_lists_known(maniskill) -> None:
    with pytest.raises(ValueError, match="PickCube-v1"):
        make_env("maniskill", task="PickCubez-v9", sim_backend="cpu")


def test_missing_assets_fail_fast_with_download_command(maniskill) -> None:
    from mani_skill.utils import assets

    if assets.is_data_source_downloaded("ycb"):
        pytest.skip("YCB assets are installed here")
    with pytest.raises(RuntimeError, match=r"ycb(.|\n)*python -m mani_skill.utils.download_asset"):
        make_env("maniskill", task="PickSingleYCB-v1", sim_backend="cpu")


def test_gpu_backend_offline_names_the_physx_library_to_fetch(offline_without_physx_gpu) -> None:
    from rlinf_vla.envs.maniskill.env import MissingAssetError

    with pytest.raises(
        MissingAssetError,
        match=r"/\.sapien/physx/[^ ]+/libPhysXGpu_64\.so(.|\n)*/linux-so\.zip(.|\n)*"
        r"env\.sim_backend=cpu",
    ):
        make_env("maniskill", task="PickCube-v1", sim_backend="gpu")


def test_auto_backend_offline_falls_back_to_the_cpu_simulator(
    offline_without_physx_gpu, monkeypatch
) -> None:
    # On a CUDA machine that cannot get the PhysX GPU library, `auto` warns and runs on the CPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(UserWarning, match=r"libPhysXGpu_64\.so(.|\n)*Using the CPU simulator"):
        env = make_env("maniskill", task="PickCube-v1", num_envs=1, image_size=32)
    try:
        assert env.backend == "cpu"
        assert env.reset(torch.tensor([0])).images["main"].shape == (1, 32, 32, 3)
    finally:
        env.close()


@pytest.mark.gpu
def test_gpu_backend_batches_envs(maniskill) -> None:
    from rlinf_vla.envs.maniskill.env import MissingAssetError, enable_physx_gpu

    try:
        enable_physx_gpu()
    except MissingAssetError as e:  # an offline machine that never fetched it
        pytest.skip(str(e))
    env = make_env("maniskill", task="PickCube-v1", num_envs=8, image_size=64, sim_backend="gpu")
    try:
        ids = torch.tensor([3, 3, 4, 4, 5, 5, 6, 6])
        obs = env.reset(ids)
        assert obs.images["main"].shape == (8, 64, 64, 3)
        assert torch.equal(obs.images["main"][0], obs.images["main"][1])
        again = env.reset(ids)
        assert torch.equal(obs.images["main"], again.images["main"])
        res = env.chunk_step(torch.zeros(8, 4, 7))
        assert res.reward.shape == (8, 4)
        env.offload()
        env.onload()
        res = env.chunk_step(torch.zeros(8, 2, 7))
        assert (res.info["elapsed_steps"] == 6).all()
    finally:
        env.close()


def test_time_limit_is_the_task_registered_one(maniskill) -> None:
    # The env group's default leaves the time limit to ManiSkill's registry, for training and
    # evaluation alike (PegInsertionSide: 100 steps, not the 50 of PickCube).
    from mani_skill.utils.registration import REGISTERED_ENVS

    from rlinf_vla import cli
    from rlinf_vla.pipelines import validate

    job = validate(cli.compose("train", ["env=maniskill", "env.task=PegInsertionSide-v1"]))
    assert job.env_config.max_episode_steps is None
    registered = REGISTERED_ENVS["PegInsertionSide-v1"].max_episode_steps
    assert registered == 100
    assert job.env_config.episode_steps() == registered  # what the config checks use
    env = make_env("maniskill", **{**job.env, "num_envs": 1, "sim_backend": "cpu"})
    try:
        assert env.max_episode_steps == registered
    finally:
        env.close()


def test_privileged_state_is_the_tasks_own_state_observation(maniskill) -> None:
    # ManiSkill itself, in its state observation mode, from the same seed: the object and goal
    # poses follow the 16 proprio values, in ManiSkill's order.
    import gymnasium as gym

    raw = gym.make("PushCube-v1", num_envs=1, obs_mode="state_dict", sim_backend="physx_cpu")
    raw.reset(seed=5)
    extra = raw.unwrapped.get_obs()["extra"]
    want = torch.cat([extra["tcp_pose"], extra["goal_pos"], extra["obj_pose"]], dim=-1)[0]
    raw.close()
    env = make_env(
        "maniskill", task="PushCube-v1", num_envs=1, image_size=32, sim_backend="cpu",
        state_mode="privileged",
    )  # fmt: skip
    try:
        state = env.reset([5]).state[0]
    finally:
        env.close()
    assert state.shape == (16 + 7 + 3 + 7,)
    torch.testing.assert_close(state[16:], want.float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("task", ["PushCube-v1", "PickCube-v1"])
def test_proprio_state_is_the_robots_entries_of_maniskills_state_dict(maniskill, task) -> None:
    # state_mode=proprio (what a VLA sees besides its cameras): exactly the robot's entries of
    # ManiSkill's own state dict, the joint positions and the TCP pose, read from the same
    # scene; moving the cube and the goal changes none of it, while their entries change.
    import gymnasium as gym

    from rlinf_vla.envs import env_config
    from rlinf_vla.envs.maniskill.env import _state

    proprio = env_config("maniskill", task=task, state_mode="proprio")
    privileged = env_config("maniskill", task=task, state_mode="privileged")
    raw = gym.make(task, num_envs=1, obs_mode="state_dict", sim_backend="physx_cpu")
    try:
        raw.reset(seed=3)
        env = raw.unwrapped
        obs = env.get_obs()
        want = torch.cat([obs["agent"]["qpos"], obs["extra"]["tcp_pose"]], dim=-1)[0].float()
        state = _state(env, proprio)[0]
        assert state.shape == (proprio.spec().state_dim,) == (16,)
        torch.testing.assert_close(state, want, atol=0, rtol=0)

        objects = ["obj_pose", "goal_pos"]
        before = {k: obs["extra"][k].clone() for k in objects}
        full_before = _state(env, privileged)[0]
        push = task == "PushCube-v1"
        cube, goal = (env.obj, env.goal_region) if push else (env.cube, env.goal_site)
        for actor in (cube, goal):  # 5 cm away in x and y
            pose = actor.pose.raw_pose.clone()
            pose[:, :2] += 0.05
            actor.set_pose(type(actor.pose).create(pose))
        after = env.get_obs()["extra"]
        assert all(not torch.equal(before[k], after[k]) for k in objects)
        torch.testing.assert_close(_state(env, proprio)[0], want, atol=0, rtol=0)
        # the privileged mode of the same scene carries the moved objects
        full_after = _state(env, privileged)[0]
        torch.testing.assert_close(full_after[:16], want, atol=0, rtol=0)
        assert not torch.equal(full_before[16:], full_after[16:])
    finally:
        raw.close()


def test_privileged_state_size_is_left_to_the_simulator() -> None:
    # the task's own state differs in size per task (PushCube: 17 values, PickCube: more)
    from rlinf_vla.envs import env_config

    assert env_config("maniskill", task="PushCube-v1").spec().state_dim == 16
    assert (
        env_config("maniskill", task="PushCube-v1", state_mode="privileged").spec().state_dim
        is None
    )


def test_default_robot_with_a_hand_camera_gives_the_wrist_image(maniskill) -> None:
    """StackCube, PegInsertionSide and PlugCharger register ``panda_wristcam`` as their robot:
    with ``wrist`` and no ``robot`` the config (what pre-flight checks read) and the built env
    both have a wrist image; PickCube's default ``panda`` has none."""
    from rlinf_vla.envs.maniskill.config import ManiSkillEnvConfig

    def cameras(task: str, **kw) -> tuple[str, ...]:
        return ManiSkillEnvConfig(task=task, **kw).cameras

    for task in ("StackCube-v1", "PegInsertionSide-v1", "PlugCharger-v1"):
        assert cameras(task, wrist=True) == ("main", "wrist"), task
        assert cameras(task, wrist=False) == ("main",), task
    assert cameras("StackCube-v1", wrist=True, robot="panda") == ("main",)
    assert cameras("PickCube-v1", wrist=True) == ("main",)
    assert cameras("PickCube-v1", wrist=True, robot="panda_wristcam") == ("main", "wrist")
    env = make_env(
        "maniskill", task="StackCube-v1", num_envs=1, image_size=32, sim_backend="cpu", wrist=True
    )
    try:
        obs = env.reset(torch.tensor([0]))
    finally:
        env.close()
    assert set(obs.images) == {"main", "wrist"}
    assert obs.images["wrist"].shape == (1, 32, 32, 3)


def test_envs_sharing_a_subprocess_run_the_same_episodes(maniskill) -> None:
    # Two envs in one subprocess against one subprocess each: same scenes, same actions, the
    # same states and pictures.
    g = torch.Generator().manual_seed(0)
    actions = [torch.rand(2, 4, 7, generator=g) * 2 - 1 for _ in range(3)]
    runs = []
    for per_process in (1, 2):
        env = make_env(
            "maniskill", task="PushCube-v1", num_envs=2, image_size=32, sim_backend="cpu",
            state_mode="privileged", envs_per_process=per_process,
        )  # fmt: skip
        try:
            assert env.workers.num_processes == 2 // per_process
            obs = [env.reset([3, 7])]
            obs += [env.chunk_step(a).obs for a in actions]
        finally:
            env.close()
        runs.append(obs)
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a.state, b.state, atol=0, rtol=0)
        assert torch.equal(a.images["main"], b.images["main"])
    assert not torch.equal(runs[0][0].state[0], runs[0][0].state[1])  # two different scenes


def test_envs_per_process_by_default_keeps_every_core_busy(monkeypatch) -> None:
    from rlinf_vla.envs import env_config
    from rlinf_vla.envs.maniskill import config as ms_config

    monkeypatch.setattr(ms_config.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert env_config("maniskill", num_envs=10).envs_per_subprocess() == 5  # ceil(10 / 2)
    assert env_config("maniskill", num_envs=9).envs_per_subprocess() == 5
    assert env_config("maniskill", num_envs=1).envs_per_subprocess() == 1
    monkeypatch.setattr(ms_config.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert env_config("maniskill", num_envs=10).envs_per_subprocess() == 1
    assert env_config("maniskill", num_envs=40).envs_per_subprocess() == 3
    assert env_config("maniskill", num_envs=40, envs_per_process=8).envs_per_subprocess() == 8
    with pytest.raises(Exception, match="envs_per_process"):
        env_config("maniskill", envs_per_process=0)


def test_pipeline_stages_share_the_whole_batchs_subprocesses(maniskill, monkeypatch) -> None:
    """4 envs on 2 cores run in 2 subprocesses of 2; split into 2 stages, each stage gets one
    subprocess of 2 envs (the stages simulate at the same time), not 2 subprocesses of 1."""
    from rlinf_vla.envs import make_stage_envs
    from rlinf_vla.envs.maniskill import config as ms_config

    monkeypatch.setattr(ms_config.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    stages = make_stage_envs(
        "maniskill", 2, num_envs=4, task="PushCube-v1", image_size=32, sim_backend="cpu"
    )
    try:
        assert [env.num_envs for env in stages] == [2, 2]
        assert [env.workers.num_processes for env in stages] == [1, 1]
    finally:
        for env in stages:
            env.close()


def test_env_workers_of_one_node_share_the_whole_batchs_subprocesses(maniskill, monkeypatch):
    """Two env workers on one node with 2 cores and 4 envs in all: each simulates its 2 envs
    in one subprocess (2 in all, as one worker with the whole batch would), not in 2 of 1."""
    from rlinf_vla.envs import env_config
    from rlinf_vla.envs.maniskill import config as ms_config
    from rlinf_vla.pipelines.rollout import EnvWorker
    from rlinf_vla.runtime.cluster import ClusterConfig
    from rlinf_vla.runtime.local import LocalCluster, LocalGroup

    monkeypatch.setattr(ms_config.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    cfg = env_config("maniskill", num_envs=4, task="PushCube-v1", image_size=32, sim_backend="cpu")
    cluster = LocalCluster(ClusterConfig(devices_per_node=2))
    group = LocalGroup(cluster, EnvWorker, "env", [0, 1], args=("maniskill", cfg, 1))
    try:
        workers = [group.worker(rank) for rank in (0, 1)]
        assert [w.node_world_size for w in workers] == [2, 2]
        assert [[env.num_envs for env in w.envs] for w in workers] == [[2], [2]]
        assert [[env.workers.num_processes for env in w.envs] for w in workers] == [[1], [1]]
    finally:
        group.close().wait()
        group.shutdown()
