"""Every registered algorithm trains in `rlinf-vla train` (PPO and GRPO: tests/pipelines/
test_train.py): two iterations on the toy env, with the loss terms the algorithm has."""

import json

import pytest

from rlinf_vla import cli
from tests.pipelines.test_train import SMALL


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("algo", ["dapo", "rloo", "reinforce_pp"])
def test_each_algorithm_trains_two_iterations(tmp_path, capsys, algo):
    groups = ["algo.group_size=2", "env.group_size=2"] if algo != "reinforce_pp" else []
    args = [f"algo={algo}", *groups, "cluster.devices_per_node=1", *SMALL]
    assert (
        cli.main(["train", *args, "runner.max_iterations=2", f"runner.output_dir={tmp_path}"]) == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    for row in rows:
        assert "train/value_loss" not in row  # no critic
        assert row["train/grad_norm"] >= 0 and row["train/skipped_updates"] == 0
        # DAPO drops the groups whose episodes all scored the same (here: all failed)
        assert row["train/samples"] > 0 if algo != "dapo" else row["train/samples"] >= 0
    assert f"rlinf-vla train: {algo} on toy, 4 envs" in capsys.readouterr().err


def test_a_key_the_algorithm_does_not_use_is_refused_before_anything_starts(capsys, nothing_starts):
    assert cli.main(["train", "env=toy", "algo=grpo", "algo.value_coef=0.3"]) == 2
    err = capsys.readouterr().err
    assert "algo.value_coef has no effect for grpo: needs a critic (use_critic)" in err
    assert cli.main(["train", "env=toy", "algo=grpo", "algo.bootstrap_truncated=false"]) == 2
    err = capsys.readouterr().err
    assert "algo.bootstrap_truncated has no effect for grpo: only a critic's advantages" in err
    assert cli.main(["train", "env=toy", "algo=grpo", "algo.reward_scale=0.1"]) == 2
    err = capsys.readouterr().err
    assert "algo.reward_scale has no effect for grpo: only a critic's targets are scaled" in err
    assert cli.main(["train", "env=toy", "algo=ppo", "algo.normalize_std=false"]) == 2
    assert (
        "algo.normalize_std has no effect with algo.advantage=gae (ppo)" in capsys.readouterr().err
    )
    # with the critic turned on, its keys count again (a custom algorithm from a preset)
    assert (
        cli.main(
            [
                "train",
                "env=toy",
                "algo=rloo",
                "algo.use_critic=true",
                "algo.value_coef=0.3",
                "--cfg",
                "job",
            ]
        )
        == 0
    )
