"""Each env's config says what it runs, for the header of a training run."""

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
