"""Each env's config says what it runs, for the header of a training run."""

from rlinf_vla.envs import env_config


def test_each_env_describes_what_it_runs():
    assert env_config("toy").describe() == ""
    assert env_config("maniskill", task="PushCube-v1").describe() == "PushCube-v1"
    assert env_config("libero", suite="libero_goal").describe() == "libero_goal"
    assert env_config("libero", suite="libero_10", task_ids=[2, 5]).describe() == (
        "libero_10 tasks [2, 5]"
    )
