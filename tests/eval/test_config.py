"""Pre-flight checks (nothing starts) and the trial plan: each init state exactly once."""

from __future__ import annotations

import pytest

from rlinf_vla.config import ConfigError
from tests.eval.conftest import eval_job


def test_unknown_suite_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"libero_100.*libero_spatial, libero_object"):
        eval_job("env.suite=libero_100")


def test_missing_checkpoint(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"policy\.checkpoint=.*does not exist"):
        eval_job(f"policy.checkpoint={tmp_path / 'nope'}")


def test_cameras_must_fit_the_env() -> None:
    with pytest.raises(ConfigError, match=r"camera\(s\) \['wrist'\].*its cameras: \['main'\]"):
        eval_job("env=maniskill", "policy=pi0")


def test_checkpoint_action_dim_must_fit_the_env(tmp_path) -> None:
    """The action size is read from the checkpoint itself, before any env or model starts."""
    from rlinf_vla.policies import make_policy

    make_policy("openvla", preset="tiny", action_dim=6, seed=0).save_pretrained(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"action_dim=6 \(from the checkpoint\) does not match the action size of env 'libero': 7$",
    ):
        eval_job("policy=openvla", f"policy.checkpoint={tmp_path}")


def test_videos_need_ffmpeg(no_ffmpeg) -> None:
    with pytest.raises(
        ConfigError, match=r"eval\.videos=all: .*imageio\[ffmpeg\].*eval\.videos=none"
    ):
        eval_job("eval.videos=all")
    assert eval_job("eval.videos=none").eval.videos == "none"


def test_proprio_and_trials_checks() -> None:
    with pytest.raises(ConfigError, match=r"proprio_dim=5.*state size of env 'libero': 8"):
        eval_job("policy=openvla_oft", "+policy.proprio_dim=5")
    with pytest.raises(ConfigError, match="50 official init states"):
        eval_job("eval.trials_per_task=51")
    with pytest.raises(ConfigError, match=r"eval\.videos"):
        eval_job("eval.videos=some")
    with pytest.raises(ConfigError, match=r"env\.task_ids \[12\]"):
        eval_job("env.task_ids=[0,12]")


@pytest.mark.sim
def test_plan_covers_each_init_state_once() -> None:
    """2 tasks x 3 trials: init states 0, 1, 2 of each task, and the LIBERO env maps every
    planned reset id back to exactly that (task, init state)."""
    pytest.importorskip("libero.libero")
    from rlinf_vla.envs.libero.env import reset_id_to_task_state, suite_tasks

    job = eval_job("env.suite=libero_goal", "env.task_ids=[3,7]", "eval.trials_per_task=3")
    tasks = suite_tasks("libero_goal")
    got = [(t.task, t.init_state) for t in job.trials]
    want = [(tasks[i].name, s) for i in (3, 7) for s in range(3)]
    assert got == want
    for t in job.trials:
        pos, state = reset_id_to_task_state(t.reset_id, 2)
        assert (tasks[(3, 7)[pos]].name, state) == (t.task, t.init_state)
        assert t.suite == "libero_goal" and t.task_index in (3, 7)
    full = eval_job("env.suite=libero_130")
    assert len(full.trials) == 130 * 50
    assert len({t.key for t in full.trials}) == 130 * 50
    assert len({t.reset_id for t in full.trials}) == 130 * 50


def test_training_renders_fast_and_evaluation_renders_the_full_scene() -> None:
    """ManiSkill rollouts on the CPU draw decimated meshes; the evaluation never does. LIBERO
    renders the official scene in both unless a run asks for fast renders."""
    from rlinf_vla.cli import compose
    from rlinf_vla.pipelines.config import validate

    train = validate(compose("train", ["env=maniskill"]))
    assert train.env_config.fast_render is True
    assert eval_job("env=maniskill", "policy=openvla").env_config.fast_render is False
    train = validate(compose("train", ["env=libero", "policy=openvla_oft"]))
    assert (train.env_config.fast_render, train.env_config.image_size) == (False, 256)
    assert eval_job("env=libero", "policy=openvla").env_config.fast_render is False


def test_only_the_cameras_the_policy_or_the_videos_read_are_rendered() -> None:
    """OpenVLA reads the agentview camera alone: train and eval leave the wrist camera out;
    OpenVLA-OFT's LIBERO setting reads both; a video of the wrist camera keeps it."""
    from rlinf_vla.cli import compose
    from rlinf_vla.pipelines.config import validate

    def cameras(command: str, *overrides: str) -> tuple[str, ...]:
        if command == "eval":
            return eval_job("env=libero", *overrides).env_config.cameras
        return validate(compose("train", ["env=libero", *overrides])).env_config.cameras

    for command in ("train", "eval"):
        assert cameras(command, "policy=openvla") == ("main",)
        assert cameras(command, "policy=openvla", "env.video_camera=wrist") == ("main", "wrist")
        both = ("policy=openvla_oft", "policy.image_keys=[main,wrist]")
        assert cameras(command, *both) == ("main", "wrist")


def test_the_seed_is_in_an_evaluations_identity_where_it_decides_something() -> None:
    """A results folder resumes only with the same ``eval.seed`` where the seed draws the trials
    (toy, ManiSkill) or the actions (a sampled evaluation); fixed scenes evaluated greedily
    (LIBERO, MetaWorld) resume with any seed."""
    assert eval_job("env=toy", "policy=openvla", "eval.seed=3").identity["seed"] == 3
    for env in (["env=libero"], ["env=metaworld", "policy.action_dim=4"]):
        assert eval_job(*env, "policy=openvla", "eval.seed=3").identity["seed"] is None
        sampled = eval_job(*env, "policy=openvla", "eval.seed=3", "eval.greedy=false")
        assert sampled.identity["seed"] == 3


def test_libero_defaults_to_the_official_protocol() -> None:
    """The official loops' settings: 256 px, full-quality renders, 10 settle steps, the
    per-suite time limits, scene seed 0 (OpenVLA-OFT) or 7 (openpi); recorded in the job."""
    job = eval_job("env=libero", "policy=openvla")
    assert job.protocol["name"] == "official"
    assert (
        job.protocol["scene_seed"] == 0 and "run_libero_eval.py" in job.protocol["reference_loop"]
    )
    env = job.env_config
    assert (env.image_size, env.fast_render, env.settle_steps) == (
        256,
        False,
        10,
    )
    assert job.protocol["max_steps"] == {
        "libero_spatial": 220,
        "libero_object": 280,
        "libero_goal": 300,
        "libero_10": 520,
        "libero_90": 400,
    }
    assert job.identity["protocol"]["name"] == "official"
    openpi = eval_job("env=libero", "policy=openvla", "env.scene_seed=7")
    assert openpi.protocol["scene_seed"] == 7 and "openpi" in openpi.protocol["reference_loop"]
    assert eval_job("env=toy", "policy=openvla").protocol == {"name": "package"}


def test_departures_from_the_official_protocol_name_the_keys() -> None:
    with pytest.raises(
        ConfigError,
        match=r"eval\.protocol=official.*env\.image_size=128 \(official: 256\); "
        r"env\.fast_render=True \(official: False\).*eval\.protocol=package",
    ):
        eval_job("env=libero", "env.image_size=128", "env.fast_render=true")
    with pytest.raises(ConfigError, match=r"env\.settle_steps=2 \(official: 10\)"):
        eval_job("env=libero", "env.settle_steps=2")
    with pytest.raises(ConfigError, match=r"env\.max_episode_steps=10 \(official: None\)"):
        eval_job("env=libero", "+env.max_episode_steps=10")
    with pytest.raises(ConfigError, match=r"env\.max_steps=\{'libero_goal': 5\}"):
        eval_job("env=libero", "+env.max_steps={libero_goal: 5}")
    with pytest.raises(ConfigError, match=r"env\.scene_seed=3 \(official: 0: .*7: openpi"):
        eval_job("env=libero", "env.scene_seed=3")
    with pytest.raises(ConfigError, match=r"env\.scene_seed=None"):
        eval_job("env=libero", "env.scene_seed=null")
    with pytest.raises(ConfigError, match=r"eval\.protocol='offical': known protocols: official"):
        eval_job("env=libero", "eval.protocol=offical")
    with pytest.raises(ConfigError, match=r"eval\.protocol=official: env 'toy' has no official"):
        eval_job("env=toy", "policy=openvla", "eval.protocol=official")
    # The package protocol takes the env settings as given, and says so in the results.
    job = eval_job(
        "env=libero", "env.image_size=128", "env.scene_seed=null", "eval.protocol=package"
    )
    assert job.protocol["name"] == "package" and job.protocol["reference_loop"] is None
    assert job.protocol["scene_seed"] is None and job.protocol["image_size"] == 128


@pytest.mark.sim
def test_stackcube_with_its_hand_camera_passes_the_preflight() -> None:
    """StackCube, PegInsertionSide and PlugCharger carry a hand camera on their default robot,
    so a main + wrist policy fits them with env.wrist=true; PickCube's default robot has none."""
    pytest.importorskip("mani_skill")
    wrist_policy = (
        "env=maniskill",
        "env.wrist=true",
        "policy=openvla_oft",
        "+policy.proprio_dim=16",
    )
    tasks = "eval.tasks=[StackCube-v1,PegInsertionSide-v1,PlugCharger-v1]"
    job = eval_job(*wrist_policy, tasks, "eval.trials_per_task=2")
    assert [t.task for t in job.trials] == [
        "StackCube-v1",
        "StackCube-v1",
        "PegInsertionSide-v1",
        "PegInsertionSide-v1",
        "PlugCharger-v1",
        "PlugCharger-v1",
    ]
    assert eval_job(*wrist_policy, "env.task=StackCube-v1").trials[0].task == "StackCube-v1"
    with pytest.raises(ConfigError, match=r"task PickCube-v1: .*camera\(s\) \['wrist'\]"):
        eval_job(*wrist_policy, "eval.tasks=[StackCube-v1,PickCube-v1]")
