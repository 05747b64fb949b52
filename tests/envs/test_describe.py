"""Each env's config says what it runs, for the header of a training run and for an evaluation."""

import pytest

from rlinf_vla.envs import env_config


def test_each_env_describes_what_it_runs():
    assert env_config("toy").describe() == ""
    assert env_config("maniskill", task="PushCube-v1").describe() == "PushCube-v1"
    assert env_config("libero", suite="libero_goal").describe() == "libero_goal"
    assert env_config("libero", suite="libero_10", task_ids=[2, 5]).describe() == (
        "libero_10 tasks [2, 5]"
    )


def test_each_env_states_what_it_provides_before_it_starts():
    spec = env_config("toy", state_mode="privileged", action_dim=5).spec()
    assert (spec.cameras, spec.action_dim, spec.state_dim) == (("main",), 5, 4)
    assert env_config("toy").spec().state_dim == 2
    spec = env_config("maniskill", control_mode="pd_ee_delta_pos").spec()
    assert (spec.action_dim, spec.state_dim) == (4, 16)  # xyz + gripper; 9 joints + TCP pose
    assert env_config("maniskill", robot="xarm6_robotiq").spec().action_dim is None
    spec = env_config("libero").spec()
    assert (spec.cameras, spec.action_dim, spec.state_dim) == (("main", "wrist"), 7, 8)


def test_maniskill_plans_its_eval_trials_by_task_and_seed():
    trials = env_config("maniskill").eval_trials("maniskill", ["PushCube-v1", "PickCube-v1"], 2, 5)
    assert [(t["task"], t["task_index"], t["reset_id"]) for t in trials] == [
        ("PushCube-v1", 0, 5),
        ("PushCube-v1", 0, 6),
        ("PickCube-v1", 1, 5),
        ("PickCube-v1", 1, 6),
    ]
    assert trials[2]["env_key"] == (("task", "PickCube-v1"),)
    toy = env_config("toy").eval_trials("toy", None, 3, 0)
    assert [(t["task"], t["reset_id"]) for t in toy] == [("toy", 0), ("toy", 1), ("toy", 2)]


def test_libero_checks_what_an_evaluation_runs():
    libero = env_config("libero", suite="libero_goal")
    assert libero.eval_configs("libero", None, 50) == [(None, libero)]
    with pytest.raises(ValueError, match=r"eval\.trials_per_task=51: .* 50 official init states"):
        libero.eval_configs("libero", None, 51)
    with pytest.raises(ValueError, match=r"eval\.tasks: LIBERO tasks are chosen with env\.suite"):
        libero.eval_configs("libero", ["PickCube-v1"], 1)
    assert not libero.eval_uses_seed


def test_single_task_envs_refuse_eval_tasks():
    toy = env_config("toy")
    assert toy.eval_configs("toy", None, 100) == [(None, toy)] and toy.eval_uses_seed
    with pytest.raises(ValueError, match=r"eval\.tasks: env 'toy' has a single task; leave it"):
        toy.eval_configs("toy", ["a"], 1)
    metaworld = env_config("metaworld", task_set="MT10")
    assert metaworld.eval_configs("metaworld", None, 50) == [(None, metaworld)]
    with pytest.raises(ValueError, match=r"eval\.tasks: MetaWorld tasks are chosen with env\."):
        metaworld.eval_configs("metaworld", ["reach-v3"], 1)
    with pytest.raises(ValueError, match=r"eval\.trials_per_task=51: .* 50 configurations"):
        metaworld.eval_configs("metaworld", None, 51)
    assert not metaworld.eval_uses_seed  # its trials are the tasks' configurations
    trials = metaworld.eval_trials("metaworld", None, 3, seed=0)
    assert trials == metaworld.eval_trials("metaworld", None, 3, seed=9)


def test_maniskill_checks_every_task_of_an_evaluation():
    pytest.importorskip("mani_skill")
    maniskill = env_config("maniskill", wrist=False)
    runs = maniskill.eval_configs("maniskill", ["PushCube-v1", "PickCube-v1"], 3)
    assert [(task, cfg.task) for task, cfg in runs] == [
        ("PushCube-v1", "PushCube-v1"),
        ("PickCube-v1", "PickCube-v1"),
    ]
    assert [task for task, _ in maniskill.eval_configs("maniskill", None, 3)] == ["PickCube-v1"]
    with pytest.raises(
        ValueError, match=r"eval\.tasks / env\.task: .*known tasks: .*PickCube-v1.*'NopeCube-v1'"
    ):
        maniskill.eval_configs("maniskill", ["PickCube-v1", "NopeCube-v1"], 1)
