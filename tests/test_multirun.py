"""``--multirun``: Hydra's sweep syntax, every combination validated first, one folder per run,
a table at the end; Hydra's own settings refused with the key to use."""

import json

import pytest

from rlinf_vla import cli
from rlinf_vla.multirun import combinations, last_success


def test_combinations_expand_as_hydras_basic_sweeper_orders_them():
    assert combinations(["algo=ppo,grpo", "runner.seed=range(0,2)", "env=toy"]) == [
        ["algo=ppo", "runner.seed=0", "env=toy"],
        ["algo=ppo", "runner.seed=1", "env=toy"],
        ["algo=grpo", "runner.seed=0", "env=toy"],
        ["algo=grpo", "runner.seed=1", "env=toy"],
    ]
    assert combinations(["env=toy"]) == [["env=toy"]]


def test_every_bad_combination_is_named_before_any_run_starts(tmp_path, capsys, nothing_starts):
    sweep = tmp_path / "sweep"
    code = cli.main(
        ["train", "-m", "env=toy", "algo=ppo,grpo", "algo.lr=1e-4,-1", f"hydra.sweep.dir={sweep}"]
    )
    assert code == 2
    err = " ".join(capsys.readouterr().err.split())
    # runs 1 and 3 set a negative rate: each is named with its overrides
    assert "2 problems" in err
    assert "run 1 (env=toy algo=ppo algo.lr=-1)" in err
    assert "run 3 (env=toy algo=grpo algo.lr=-1)" in err
    assert "run 0 " not in err and "run 2 " not in err
    assert not (sweep / "0" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["hydra.run.dir=/tmp/x"],
            "hydra.run.dir: rlinf-vla does not use Hydra's own settings; the run's folder is runner.output_dir",
        ),
        (["hydra.sweep.dir=/tmp/x"], "with --multirun, hydra.sweep.dir sets the sweep's folder"),
        (["hydra.job.chdir=true"], "hydra.job.chdir: rlinf-vla does not use Hydra's own settings"),
        (
            ["-m", "runner.output_dir=/tmp/x"],
            "runner.output_dir: the sweep gives each run its own folder",
        ),
        (["-m", "algo=ppo,"], "invalid config"),
    ],
)
def test_hydra_settings_are_refused_with_the_key_to_use(capsys, nothing_starts, args, message):
    assert cli.main(["train", "env=toy", *args]) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_a_sweep_runs_each_combination_in_its_own_folder_and_ends_with_a_table(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    args = ["env=toy", "env.reward_mode=dense", "placement=local", "runner.rollout_chunks=16"]
    args += ["runner.max_iterations=1", "runner.eval_interval=1", "runner.eval_videos=false"]
    code = cli.main(["train", "--multirun", *args, "runner.seed=0,1", f"hydra.sweep.dir={sweep}"])
    assert code == 0
    err = capsys.readouterr().err
    results = json.loads((sweep / "multirun.json").read_text())
    assert [r["overrides"][-1] for r in results] == ["runner.seed=0", "runner.seed=1"]
    assert [r["swept"] for r in results] == [["runner.seed=0"], ["runner.seed=1"]]
    for n, r in enumerate(results):
        assert r["exit_code"] == 0 and r["folder"] == str(sweep / str(n))
        assert (sweep / str(n) / "checkpoints" / "iter_1").is_dir()
        assert r["success_rate"] == last_success(sweep / str(n)) is not None
    # the two seeds drew different policies: their runs differ
    first = [json.loads(line) for line in (sweep / "0" / "metrics.jsonl").read_text().splitlines()]
    second = [json.loads(line) for line in (sweep / "1" / "metrics.jsonl").read_text().splitlines()]
    assert first[0]["train/policy_loss"] != second[0]["train/policy_loss"]
    table = err[err.index("multirun: 2 of 2 run(s)") :]
    assert "   0  ok" in table and "runner.seed=1" in table
