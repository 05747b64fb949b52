"""Checkpoint manifests, the fallback past damaged checkpoints, and config changes on resume."""

import json
import re
import shutil

import pytest
import yaml

from rlinf_vla import cli
from rlinf_vla.config import ConfigError, RunAborted
from rlinf_vla.run.checkpoints import (
    MANIFEST,
    check_resume_config,
    damage,
    finish_checkpoint,
    resume_checkpoint,
    write_manifest,
)
from rlinf_vla.run.loop import RunLoop
from rlinf_vla.run.tracking import LoggingConfig, read_metrics

SMALL = [
    "env=toy",
    "policy.chunk_size=2",
    "env.num_envs=4",
    "env.max_episode_steps=8",
    "runner.rollout_chunks=4",
    "algo.update_epochs=1",
    "cluster.devices_per_node=1",
    "runner.save_interval=1",
    "runner.eval_interval=0",
    "runner.logging.tensorboard=false",
]


def _flip_byte(path, at=-100):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _fake_checkpoint(run, n, manifest=True):
    path = run / "checkpoints" / f"iter_{n}"
    (path / "policy").mkdir(parents=True)
    (path / "policy" / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (path / "runner.pt").write_bytes(b"state" * 100)
    if manifest:
        finish_checkpoint(path, n)
    else:
        (path / "COMPLETE").write_text(str(n))
    return path


# ---------------------------------------------------------------------- manifests
def test_the_manifest_names_every_file_and_each_kind_of_damage(tmp_path):
    path = _fake_checkpoint(tmp_path, 1)
    files = json.loads((path / MANIFEST).read_text())["files"]
    assert sorted(files) == ["policy/model.safetensors", "runner.pt"]  # COMPLETE comes after
    assert files["runner.pt"]["size"] == 500
    assert not list(path.glob(f"{MANIFEST}.*"))  # the temporary file was renamed
    assert damage(path) is None
    _flip_byte(path / "policy" / "model.safetensors")  # same size, other bytes
    assert damage(path) == "policy/model.safetensors: sha256 mismatch"
    write_manifest(path)
    _truncate(path / "runner.pt")
    assert damage(path) == "runner.pt: 250 bytes, 500 expected"
    (path / "runner.pt").unlink()
    assert damage(path) == "runner.pt: missing"
    (path / MANIFEST).unlink()
    assert "no MANIFEST.json" in damage(path)


def test_a_resume_skips_damaged_checkpoints_and_says_which_file(tmp_path):
    for n in (10, 20, 30):
        _fake_checkpoint(tmp_path, n)
    _flip_byte(tmp_path / "checkpoints" / "iter_30" / "policy" / "model.safetensors")
    _truncate(tmp_path / "checkpoints" / "iter_20" / "runner.pt")
    chosen = resume_checkpoint(tmp_path, "iter")
    assert chosen.path == tmp_path / "checkpoints" / "iter_10" and chosen.number == 10
    assert chosen.notes == [
        "checkpoints/iter_30 is damaged (policy/model.safetensors: sha256 mismatch); "
        "resuming from checkpoints/iter_10",
        "checkpoints/iter_20 is damaged (runner.pt: 250 bytes, 500 expected); "
        "resuming from checkpoints/iter_10",
    ]
    # A save that stopped before its manifest (COMPLETE written, MANIFEST.json not yet).
    (tmp_path / "checkpoints" / "iter_10" / MANIFEST).unlink()
    _fake_checkpoint(tmp_path, 5)
    chosen = resume_checkpoint(tmp_path, "iter")
    assert chosen.path.name == "iter_5"
    assert "checkpoints/iter_10 is damaged (no MANIFEST.json" in chosen.notes[-1]


def test_a_save_stopped_before_its_complete_marker_is_skipped_by_every_reader(
    tmp_path, monkeypatch
):
    # SIGTERM can land between the manifest and the COMPLETE marker, or inside the manifest:
    # neither leaves a folder that one reader counts as complete and another rejects.
    import rlinf_vla.run.checkpoints as checkpoints
    from rlinf_vla.run.tracking import last_checkpoint

    _fake_checkpoint(tmp_path, 1)
    stopped = _fake_checkpoint(tmp_path, 2)
    (stopped / "COMPLETE").unlink()  # the manifest written, the marker not yet
    assert last_checkpoint(tmp_path) == tmp_path / "checkpoints" / "iter_1"
    chosen = resume_checkpoint(tmp_path, "iter")
    assert chosen.path.name == "iter_1"
    assert chosen.notes == [
        "checkpoints/iter_2 is incomplete (no COMPLETE marker: the save did not finish); "
        "resuming from checkpoints/iter_1"
    ]

    def interrupted(folder):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoints, "write_manifest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _fake_checkpoint(tmp_path, 3)
    assert not (tmp_path / "checkpoints" / "iter_3" / "COMPLETE").exists()
    assert last_checkpoint(tmp_path).name == resume_checkpoint(tmp_path, "iter").path.name


def test_no_complete_checkpoint_fails_naming_the_folder_and_each_damage(tmp_path):
    for n in (1, 2):
        _fake_checkpoint(tmp_path, n)
        _flip_byte(tmp_path / "checkpoints" / f"iter_{n}" / "runner.pt")
    with pytest.raises(RunAborted) as e:
        resume_checkpoint(tmp_path, "iter")
    message = str(e.value)
    assert str(tmp_path / "checkpoints") in message
    assert "checkpoints/iter_2 is damaged (runner.pt: sha256 mismatch)" in message
    assert "checkpoints/iter_1 is damaged (runner.pt: sha256 mismatch)" in message


def test_checkpoints_from_before_manifests_resume_with_one_warning(tmp_path):
    for n in (1, 2):
        _fake_checkpoint(tmp_path, n, manifest=False)
    (tmp_path / "checkpoints" / "iter_3").mkdir()  # interrupted while saving
    chosen = resume_checkpoint(tmp_path, "iter")
    assert chosen.path.name == "iter_2"
    warnings = [n for n in chosen.notes if n.startswith("warning:")]
    assert len(warnings) == 1 and "checkpoints/iter_2 has no MANIFEST.json" in warnings[0]
    # The run went on with manifests: a damaged new checkpoint falls back to an old one.
    _fake_checkpoint(tmp_path, 4)
    _flip_byte(tmp_path / "checkpoints" / "iter_4" / "runner.pt")
    chosen = resume_checkpoint(tmp_path, "iter")
    assert chosen.path.name == "iter_2"
    assert chosen.notes[0] == (
        "checkpoints/iter_4 is damaged (runner.pt: sha256 mismatch); resuming from "
        "checkpoints/iter_2"
    )


# ---------------------------------------------------------------------- config changes
def _saved_run(tmp_path, config):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp_path


def test_changes_that_alter_the_run_are_refused_naming_every_key(tmp_path):
    old = {
        "policy": {"chunk_size": 2},
        "env": {"num_objects": 3, "num_envs": 8},
        "algo": {"lr": 1e-4, "name": "ppo"},
        "runner": {"max_iterations": 2, "resume": None, "logging": {"wandb": False}},
    }
    run = _saved_run(tmp_path, old)
    new = json.loads(json.dumps(old))
    new["policy"]["chunk_size"] = 4
    new["env"]["num_envs"] = 4
    new["algo"]["lr"] = 3e-4  # allowed, but the others are not
    with pytest.raises(ConfigError) as e:
        check_resume_config(run, new)
    message = str(e.value)
    assert "policy.chunk_size: 2 -> 4" in message and "env.num_envs: 8 -> 4" in message
    assert "algo.lr" not in message
    # Allowed keys pass and are reported; the run folder keys are not news.
    new = json.loads(json.dumps(old))
    new["algo"]["lr"] = 3e-4
    new["runner"].update(max_iterations=5, resume=str(run), logging={"wandb": True})
    assert check_resume_config(run, new) == [
        "algo.lr: 0.0001 -> 0.0003",
        "runner.max_iterations: 2 -> 5",
        "runner.logging.wandb: False -> True",
    ]
    # The newest start's config is the one compared with.
    (run / "configs").mkdir()
    (run / "configs" / "start_1.yaml").write_text(yaml.safe_dump(new))
    assert check_resume_config(run, new) == []


def test_every_setting_is_compared_where_the_previous_start_wrote_them(tmp_path):
    """A default that differs between two starts (another version of the package) changes
    the run as much as a key set on the command line; a setting only one start has (added or
    removed by a version) has nothing to compare with and is reported, not refused."""
    raw = {"algo": {"name": "ppo"}, "runner": {"max_iterations": 2}}
    run = _saved_run(tmp_path, raw)
    settings = {"algo": {"name": "ppo", "gamma": 0.99, "lam": 0.95}, "runner": {"seed": 0}}
    # a run from before the settings were written: only its command-line keys compare
    assert check_resume_config(run, raw, settings) == []
    (run / "configs").mkdir()
    earlier = {"algo": {"name": "ppo", "gamma": 0.98, "lam": 0.95}, "runner": {"seed": 0}}
    (run / "configs" / "settings_0.yaml").write_text(yaml.safe_dump(earlier))
    with pytest.raises(ConfigError, match=r"algo\.gamma: 0\.98 -> 0\.99") as e:
        check_resume_config(run, raw, settings)
    assert "settings_0.yaml" in str(e.value)
    earlier["algo"]["gamma"] = 0.99
    earlier["algo"]["old_knob"] = 1
    del earlier["algo"]["lam"]
    (run / "configs" / "settings_0.yaml").write_text(yaml.safe_dump(earlier))
    assert check_resume_config(run, raw, settings) == [
        "algo.lam: only this start has this setting",
        "algo.old_knob: only the previous start (settings_0.yaml) has this setting",
    ]
    # allowed keys stay allowed, whichever file says they changed
    bigger = json.loads(json.dumps(settings))
    bigger["runner"]["max_iterations"] = 5
    earlier["runner"]["max_iterations"] = 2
    (run / "configs" / "settings_0.yaml").write_text(yaml.safe_dump(earlier))
    assert "runner.max_iterations: 2 -> 5" in check_resume_config(run, raw, bigger)


def test_an_auto_placement_is_resolved_again_on_resume(tmp_path):
    run = _saved_run(tmp_path, {"placement": {"mode": "hybrid", "stages": 2}})
    assert check_resume_config(run, {"placement": {"mode": "auto", "max_stages": 4}}) == []
    with pytest.raises(ConfigError, match=r"placement\.stages: 2 -> 1"):
        check_resume_config(run, {"placement": {"mode": "hybrid", "stages": 1}})


def test_a_resume_keeps_the_first_config_and_records_each_start(tmp_path):
    def loop(total):
        return RunLoop(
            tmp_path / "run",
            {"runner": {"max_iterations": total}},
            LoggingConfig(tensorboard=False),
            command="train",
            unit="iter",
            total=total,
            save_interval=10,
            max_nan_updates=3,
        )

    def iteration(i, logger, say):
        return {"iteration": i + 1}

    def save(n):
        return tmp_path / "run"

    loop(2).run(0, iteration, save, lambda m: "")
    loop(3).run(2, iteration, save, lambda m: "")
    run = tmp_path / "run"
    assert yaml.safe_load((run / "config.yaml").read_text())["runner"]["max_iterations"] == 2
    starts = sorted(p.name for p in (run / "configs").iterdir())
    assert starts == ["start_0.yaml", "start_1.yaml"]  # no settings given: none written
    start_1 = yaml.safe_load((run / "configs" / "start_1.yaml").read_text())
    assert start_1["runner"]["max_iterations"] == 3


# ---------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """Two toy iterations with a checkpoint after each (copied by each test)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert cli.main(["train", *SMALL, "runner.max_iterations=2", f"runner.output_dir={run}"]) == 0
    return run


def _copy(trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    return run


@pytest.mark.slow
@pytest.mark.ray
def test_a_flipped_byte_falls_back_to_the_previous_checkpoint(trained_run, tmp_path, capsys):
    run = _copy(trained_run, tmp_path)
    _flip_byte(run / "checkpoints" / "iter_2" / "policy" / "model.safetensors")
    args = ["train", *SMALL, "runner.max_iterations=3", f"runner.resume={run}"]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert (
        "checkpoints/iter_2 is damaged (policy/model.safetensors: sha256 mismatch); "
        "resuming from checkpoints/iter_1" in err
    )
    assert "resuming after iteration 1 of 3" in err
    # each save names its folder, size and time: here iter_2 and iter_3, written again
    iter_3 = run / "checkpoints" / "iter_3"
    mib = sum(f.stat().st_size for f in iter_3.rglob("*") if f.is_file()) / 2**20
    assert 1 <= mib < 1024  # the toy policy's checkpoint is counted in MiB
    line = rf"checkpoint {re.escape(str(iter_3))}: {mib:.2f} MiB written in \d+\.\d s\n"
    assert re.search(line, err)
    assert "settings changed on resume (allowed): runner.max_iterations: 2 -> 3" in err
    assert [r["iteration"] for r in read_metrics(run)] == [1, 2, 3]
    # iter_2 was saved again, whole; config.yaml is still the first start's
    assert damage(run / "checkpoints" / "iter_2") is None
    assert "max_iterations: 2" in (run / "config.yaml").read_text()
    assert "max_iterations: 3" in (run / "configs" / "start_1.yaml").read_text()


@pytest.mark.slow
def test_a_truncated_runner_state_falls_back_to_the_previous_checkpoint(trained_run, tmp_path):
    run = _copy(trained_run, tmp_path)
    state = run / "checkpoints" / "iter_2" / "runner.pt"
    size = state.stat().st_size
    _truncate(state)
    chosen = resume_checkpoint(run, "iter")
    assert chosen.path.name == "iter_1"
    assert chosen.notes == [
        f"checkpoints/iter_2 is damaged (runner.pt: {size // 2} bytes, {size} expected); "
        "resuming from checkpoints/iter_1"
    ]


@pytest.mark.slow
def test_all_checkpoints_damaged_exits_1_naming_the_folder(
    trained_run, tmp_path, capsys, nothing_starts
):
    run = _copy(trained_run, tmp_path)
    for n in (1, 2):
        _flip_byte(run / "checkpoints" / f"iter_{n}" / "actor_rank0.pt")
    assert cli.main(["train", *SMALL, "runner.max_iterations=3", "runner.resume=auto",
                     f"runner.output_dir={run}"]) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert f"{run / 'checkpoints'} has no complete checkpoint to resume from" in err
    assert "checkpoints/iter_1 is damaged (actor_rank0.pt: sha256 mismatch)" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_legacy_truncated_runner_state_is_named(trained_run, tmp_path):
    from rlinf_vla.pipelines.runner import _runner_state
    from rlinf_vla.runtime.placement import resolve_placement

    run = _copy(trained_run, tmp_path)
    for p in run.glob("checkpoints/*/MANIFEST.json"):
        p.unlink()
    _truncate(run / "checkpoints" / "iter_2" / "runner.pt")
    chosen = resume_checkpoint(run, "iter")  # no manifests: nothing to check it against
    assert chosen.path.name == "iter_2"
    job = cli.COMMANDS["train"].load()[0](cli.compose("train", SMALL))
    with pytest.raises(RunAborted, match=r"iter_2/runner.pt cannot be read"):
        _runner_state(chosen.path, resolve_placement(job.placement, 1))


@pytest.mark.slow
@pytest.mark.ray
def test_a_run_saved_without_manifests_resumes(trained_run, tmp_path, capsys):
    run = _copy(trained_run, tmp_path)
    for p in run.glob("checkpoints/*/MANIFEST.json"):
        p.unlink()
    args = ["train", *SMALL, "runner.max_iterations=3", f"runner.resume={run}"]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert err.count("has no MANIFEST.json (saved before checkpoints had manifests)") == 1
    assert "resuming after iteration 2 of 3" in err
    assert [r["iteration"] for r in read_metrics(run)] == [1, 2, 3]
    assert (run / "checkpoints" / "iter_3" / MANIFEST).exists()


@pytest.mark.slow
def test_a_changed_chunk_size_is_refused_before_anything_starts(
    trained_run, tmp_path, capsys, nothing_starts
):
    run = _copy(trained_run, tmp_path)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    args = ["train", *SMALL, "policy.chunk_size=4", "runner.max_iterations=3"]
    assert cli.main([*args, f"runner.resume={run}"]) == 2
    err = capsys.readouterr().err
    assert "policy.chunk_size: 2 -> 4" in err
    assert "runner.max_iterations" not in err  # an allowed change is not among the refused
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_key_set_on_only_one_side_is_a_change(tmp_path):
    # the first start took policy.chunk_size from the checkpoint; the resume sets it
    saved = {"policy": {"name": "openvla_oft"}, "env": {"name": "toy", "num_envs": 8}}
    run = _saved_run(tmp_path, saved)
    chunk = {**saved, "policy": {"name": "openvla_oft", "chunk_size": 4}}
    with pytest.raises(ConfigError, match=r"policy\.chunk_size: \(unset\) -> 4"):
        check_resume_config(run, chunk)
    with pytest.raises(ConfigError, match=r"env\.num_envs: 8 -> \(unset\)"):
        check_resume_config(run, {**saved, "env": {"name": "toy"}})


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("garbage config", "config.yaml is not a readable config"),
        ("config is a list", "config.yaml holds a list, not a config"),
        ("metrics damaged mid-file", "metrics.jsonl: row 2 is not a JSON object"),
    ],
)
def test_a_damaged_run_folder_is_refused_before_anything_starts(tmp_path, damage, message):
    from rlinf_vla.run.checkpoints import prepare_resume

    run = _saved_run(tmp_path, {"algo": {"lr": 1e-4}})
    _fake_checkpoint(tmp_path, 2)
    (run / "metrics.jsonl").write_text('{"iteration": 1}\n{"iteration": 2}\n')
    if damage == "garbage config":
        (run / "config.yaml").write_text("algo: {lr: [1e-4\n  : :\n")
    elif damage == "config is a list":
        (run / "config.yaml").write_text("- 1\n- 2\n")
    else:
        (run / "metrics.jsonl").write_text('{"iteration": 1}\n{"iterat\n{"iteration": 2}\n')
    with pytest.raises(ConfigError, match=re.escape(message)):
        prepare_resume(str(run), {"algo": {"lr": 1e-4}}, "iter")


@pytest.mark.slow
@pytest.mark.ray
def test_a_default_that_changed_since_the_run_started_is_refused(
    trained_run, tmp_path, capsys, nothing_starts
):
    """The run wrote every setting at its start; a resume whose defaults differ (as another
    version of the package would have them) is refused naming the setting, before Ray
    starts; the command line alone could not show it."""
    run = _copy(trained_run, tmp_path)
    settings = run / "configs" / "settings_0.yaml"
    saved = yaml.safe_load(settings.read_text())
    assert saved["algo"]["gamma"] == 0.99 and saved["env"]["name"] == "toy"
    assert "chunk_size" in saved["policy"]  # a default the command line never set
    saved["algo"]["gamma"] = 0.95  # the default when the run started
    settings.write_text(yaml.safe_dump(saved))
    args = ["train", *SMALL, "runner.max_iterations=3", f"runner.resume={run}"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "algo.gamma: 0.95 -> 0.99" in err and "settings_0.yaml" in err
