"""Bad input is refused before anything starts: exit code 2, a message naming the offending key,
no traceback, no Ray instance and no worker (the ``nothing_starts`` fixture fails the test if
one starts). Each case runs the real command line entry point in this process."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import socket
from pathlib import Path

import pytest

from rlinf_vla import cli
from rlinf_vla.config import ConfigError
from rlinf_vla.runtime.cluster import check_address

_NO_MANISKILL = pytest.mark.skipif(
    importlib.util.find_spec("mani_skill") is None, reason="needs ManiSkill3"
)

#: a 6-D arm's dataset written by LeRobot's own writer
_SO100 = Path(__file__).parent / "data" / "fixtures" / "lerobot_so100"

# (command line, the keys the message must name)
#: sft on the LeRobot-written fixture, without evaluation (no env is built)
_SFT_NO_EVAL = ["sft", f"data.paths=[{_SO100}]", "runner.eval_interval=0"]

BAD_CONFIGS = [
    # ranges of the algo keys (all silently accepted before)
    (["train", "algo.clip_low=-0.5"], ["algo.clip_low"]),
    (["train", "algo.clip_high=-0.5"], ["algo.clip_high"]),
    (["train", "algo.max_grad_norm=-1"], ["algo.max_grad_norm"]),
    (["train", "algo.value_clip=-1"], ["algo.value_clip"]),
    (["train", "algo.warmup_iterations=-5"], ["algo.warmup_iterations"]),
    (["train", "algo.dual_clip=0.5"], ["algo.dual_clip"]),
    (["train", "algo.weight_decay=-1"], ["algo.weight_decay"]),
    (["train", "algo.kl_coef=-1"], ["algo.kl_coef"]),
    # a KL that train would not use: reinforce_pp's preset folds it into rewards
    (["train", "algo=reinforce_pp", "algo.kl_coef=0.1"], ["algo.kl_coef", "kl_in_reward"]),
    # PPO's GAE batch has no scored episodes to weigh
    (["train", "algo=ppo", "algo.episode_weight=step"], ["algo.episode_weight", "episodes"]),
    (["train", "algo=grpo", "algo.episode_weight=sequence"], ["algo.episode_weight"]),
    (
        ["train", "algo.clip_low=-0.5", "algo.max_grad_norm=-1", "algo.weight_decay=-1"],
        ["algo.clip_low", "algo.max_grad_norm", "algo.weight_decay"],
    ),
    (
        ["sft", "data.paths=[/nonexistent]", "sft.max_grad_norm=-1", "sft.weight_decay=-2"],
        ["sft.max_grad_norm", "sft.weight_decay"],
    ),
    (["serve", "server.host=0.0.0.0.0"], ["server.host", "0.0.0.0.0"]),
    (["serve", "server.host=bad_host!"], ["server.host"]),
    # DAgger needs the env's scripted expert and has no policy-gradient keys
    (["train", "env=libero", "algo=dagger"], ["algo=dagger", "'libero' has no scripted expert"]),
    (
        ["train", "env=toy", "algo=dagger", "algo.entropy_coef=0.01", "algo.value_lr=1e-3"],
        ["algo.entropy_coef", "algo.value_lr"],
    ),
    (["train", "env=toy", "algo=ppo", "algo.buffer_size=100"], ["algo.buffer_size"]),
    (["train", "env=toy", "algo=dagger", "algo.buffer_size=0"], ["algo.buffer_size"]),
    (["math-grpo", "algo=dagger"], ["algo=dagger", "train"]),
    # non-finite numbers, in any float key of any section
    (["train", "algo.lr=inf"], ["algo.lr"]),
    (["train", "algo.lr=nan"], ["algo.lr"]),
    (["train", "algo.gamma=nan"], ["algo.gamma"]),
    (["train", "env=toy", "env.step_time_per_env_s=inf"], ["env.step_time_per_env_s"]),
    (["bench", "cluster.wait_timeout_s=inf"], ["cluster.wait_timeout_s"]),
    (["math-grpo", "algo.lr=inf"], ["algo.lr"]),
    # what only the simulator found before
    (["train", "env=libero", "env.task_ids=[999]"], ["env.task_ids", "999"]),
    (["train", "env=libero", "env.cameras=[top]"], ["env.cameras", "main", "wrist"]),
    (["eval", "env=libero", "env.task_ids=[999]"], ["env.task_ids", "999"]),
    # every command names an env key as the command line sets it
    (["collect", "env=toy", "env.num_envs=0"], ["env.num_envs"]),
    (["sft", "data.paths=[/nonexistent]", "env=toy", "env.num_envs=0"], ["env.num_envs"]),
    pytest.param(
        ["train", "env=maniskill", "env.task=NopeCube-v1"],
        ["env.task", "NopeCube-v1", "PickCube-v1"],  # the known tasks are listed
        marks=_NO_MANISKILL,
    ),
    # a value of the wrong shape
    (["eval", "env=libero", "env.max_steps=60"], ["env.max_steps", "suite"]),
    (["train", "env=libero", "env.max_steps=60"], ["env.max_steps", "suite"]),
    (["train", "policy.image_keys=main"], ["policy.image_keys"]),
    (["eval", "env=libero", "policy=openvla_oft", "policy.image_keys=main"], ["policy.image_keys"]),
    (["train", "env=libero", "env.task_ids=3"], ["env.task_ids"]),
    # values that started work before failing
    (["train", "env=toy", "runner.seed=-1"], ["runner.seed"]),
    (["sft", f"data.paths=[{_SO100}]", "runner.seed=-1"], ["runner.seed"]),
    (["math-grpo", "runner.seed=-1"], ["runner.seed"]),
    (["train", "env=toy", "runner.output_dir="], ["runner.output_dir is empty"]),
    (["train", "env=toy", "runner.resume= "], ["runner.resume is empty"]),
    (["train", "env=toy", "algo.entropy_coef=-0.1"], ["algo.entropy_coef"]),
    (
        ["sft", f"data.paths=[{_SO100}]", "runner.eval_interval=0", "sft.micro_batch_size=64"],
        ["sft.micro_batch_size", "sft.batch_size=32"],
    ),
    (["math-grpo", "algo.betas=[0.9,1.5]"], ["algo.betas", "[0, 1)"]),
    (["math-grpo", "algo.betas=[-0.1,0.99]"], ["algo.betas"]),
    (
        ["math-grpo", "data.tasks.basic_arithmetic.weight=-1"],
        ["data.tasks.basic_arithmetic.weight"],
    ),
    (
        ["math-grpo", "data.tasks.basic_arithmetic.weight=0", "data.tasks.leg_counting.weight=0"],
        ["data.tasks", "every weight is 0"],
    ),
    # devices this machine lacks are refused, never replaced
    (["train", "env=toy", "policy.device=cuda:99"], ["policy.device=cuda:99"]),
    (["train", "env=toy", "env.device=cuda:99"], ["env.device=cuda:99"]),
    (["train", "env=toy", "policy.device=tpu"], ["policy.device='tpu' is not a torch device"]),
    (["eval", "env=toy", "eval.device=cuda:99"], ["eval.device=cuda:99"]),
    (["eval", "env=toy", "policy.device=cuda:99"], ["policy.device=cuda:99"]),
    (
        ["sft", f"data.paths=[{_SO100}]", "runner.eval_interval=0", "policy.device=cuda:99"],
        ["policy.device=cuda:99"],
    ),
    (["train", "env=toy", "env.num_envs=64", "cluster.num_gpus=64"], ["cluster.num_gpus=64"]),
    (
        [*_SFT_NO_EVAL, "cluster.devices_per_node=2", "sft.devices=0-3"],
        ["sft.devices", "3"],
    ),
    (
        [*_SFT_NO_EVAL, "cluster.devices_per_node=3", "sft.devices=all", "sft.batch_size=32"],
        ["sft.batch_size=32", "3 actor workers"],
    ),
    # what the machine must provide
    (["train", "runner.output_dir=/proc/rlinf-vla-test"], ["runner.output_dir"]),
    (["deploy", "record.output_dir=/proc/rlinf-vla-test"], ["record.output_dir"]),
    (["train", "cluster=ray", "cluster.address=nohost"], ["cluster.address"]),
]


@pytest.mark.parametrize(("argv", "keys"), BAD_CONFIGS)
def test_bad_config_is_refused_naming_its_keys_before_anything_starts(
    argv, keys, capsys, nothing_starts
):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    # (the suite's shared Ray instance may print its workers' log lines here too)
    assert any(
        line.startswith(f"rlinf-vla {argv[0]}: invalid config: ") for line in err.splitlines()
    )
    assert "Traceback" not in err
    for key in keys:
        assert key in err


# --------------------------------------------------------------------------- the run folder
def _commands(tmp_path: Path, folder: Path) -> list[tuple[list[str], str]]:
    """A valid command line of every command that writes a folder, writing to ``folder``."""
    from tests.test_cli import _tiny_dataset

    demos = _tiny_dataset(tmp_path / "demos")
    return [
        (["train", f"runner.output_dir={folder}"], "runner.output_dir"),
        (["sft", f"data.paths=[{demos}]", f"runner.output_dir={folder}"], "runner.output_dir"),
        (["collect", f"collect.output_dir={folder}"], "collect.output_dir"),
        (["eval", f"eval.output_dir={folder}"], "eval.output_dir"),
        (["math-grpo", f"runner.output_dir={folder}"], "runner.output_dir"),
    ]


def _refused(argv, key, reason, capsys):
    assert cli.main(argv) == 2, argv
    err = capsys.readouterr().err
    assert f"invalid config: {key}: cannot write to" in err, err
    assert reason in err
    assert "Traceback" not in err


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes to read-only folders"
)
def test_a_read_only_run_folder_is_refused_by_every_command(tmp_path, capsys, nothing_starts):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        for argv, key in _commands(tmp_path, read_only / "run"):
            _refused(argv, key, "Permission denied", capsys)
    finally:
        read_only.chmod(0o700)


def test_a_run_folder_that_cannot_be_made_is_refused_by_every_command(
    tmp_path, capsys, nothing_starts
):
    # (also as root) a file stands where the folder should be made
    (tmp_path / "a-file").write_text("")
    for argv, key in _commands(tmp_path, tmp_path / "a-file" / "run"):
        _refused(argv, key, "Not a directory", capsys)


def test_a_full_disk_is_refused_and_the_probe_leaves_nothing_behind(
    tmp_path, capsys, nothing_starts, monkeypatch
):
    import rlinf_vla.run.tracking as tracking

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tracking.os, "fsync", full)
    folder = tmp_path / "new" / "run"
    _refused(["train", f"runner.output_dir={folder}"], "runner.output_dir", "No space left", capsys)
    assert list(tmp_path.iterdir()) == []  # the folders made for the probe are gone


def test_a_writable_run_folder_passes_the_probe_unchanged(tmp_path):
    from rlinf_vla.run.tracking import check_writable

    check_writable(tmp_path / "a" / "b", "runner.output_dir")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    check_writable(tmp_path / "kept", "runner.output_dir")
    assert list((tmp_path / "kept").iterdir()) == []


# --------------------------------------------------------------------------- the Ray address
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_ray_address_is_refused_at_once(capsys, nothing_starts):
    import time

    address = f"127.0.0.1:{_closed_port()}"
    start = time.monotonic()
    assert cli.main(["train", "cluster=ray", f"cluster.address={address}"]) == 2
    assert time.monotonic() - start < 30  # not Ray's minute and a half of retries
    err = capsys.readouterr().err
    assert f"cluster.address='{address}': nothing answers at {address}" in err
    assert "Traceback" not in err
    with pytest.raises(ConfigError, match=re.escape("cluster.address='ray://127.0.0.1:")):
        check_address(f"ray://{address}")


def test_a_cluster_made_in_code_checks_its_address_before_ray_starts(monkeypatch):
    import ray

    from rlinf_vla.runtime import Cluster
    from rlinf_vla.runtime.cluster import ClusterConfig

    def refuse(*args, **kwargs):
        raise AssertionError("ray.init was called for an unreachable address")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match=re.escape("cluster.address='127.0.0.1:")):
        Cluster(ClusterConfig(address=f"127.0.0.1:{_closed_port()}"))


def test_a_listening_ray_address_passes_and_auto_is_left_to_ray():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        check_address(f"127.0.0.1:{port}")
        check_address(f"ray://127.0.0.1:{port}")
    check_address(None)
    check_address("auto")
    for bad in ("127.0.0.1", "127.0.0.1:port", "host:0", ":6379"):
        with pytest.raises(ConfigError, match="expected host:port"):
            check_address(bad)


# --------------------------------------------------------------------------- math data files
def _write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


GOOD_ROW = {"prompt": "1+1", "answer": "2"}


@pytest.mark.parametrize(
    ("name", "make", "reason"),
    [
        ("empty.jsonl", lambda p: _write(p, ""), "no rows"),
        ("blank.jsonl", lambda p: _write(p, "\n\n"), "no rows"),
        ("torn.jsonl", lambda p: _write(p, json.dumps(GOOD_ROW) + '\n{"prompt": "2+2"'), "line 2"),
        ("fields.jsonl", lambda p: _write(p, '{"q": "1+1", "a": "2"}\n' * 3), "lacks the field"),
        ("null.jsonl", lambda p: _write(p, '{"prompt": "1+1", "answer": null}\n' * 3), "answer"),
        ("lists.jsonl", lambda p: _write(p, "[1, 2]\n[3, 4]\n"), "row 0 is not an object"),
        ("object.json", lambda p: _write(p, json.dumps(GOOD_ROW)), "expected a JSON list"),
        ("broken.json", lambda p: _write(p, "[{"), "not JSON"),
        ("numbers.json", lambda p: _write(p, "[1, 2, 3]"), "row 0 is not an object"),
        ("binary.jsonl", lambda p: _write(p, b"\xff\xfe\x00garbage"), "not UTF-8"),
        ("junk.parquet", lambda p: _write(p, "PAR1 not parquet"), "not a readable Parquet"),
        ("fields.parquet", lambda p: _parquet(p, [{"q": "1", "a": "2"}] * 3), "lacks the field"),
        ("one.jsonl", lambda p: _write(p, json.dumps(GOOD_ROW) + "\n"), "at least 2"),
    ],
)
def test_a_bad_math_data_file_is_refused_naming_its_key(
    name, make, reason, tmp_path, capsys, nothing_starts
):
    path = make(tmp_path / name)
    assert cli.main(["math-grpo", "data=file", f"data.path={path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlinf-vla math-grpo: invalid config: data.path: ")
    assert reason in err
    assert "Traceback" not in err


def test_a_bad_held_out_file_names_data_eval_path(tmp_path, capsys, nothing_starts):
    train = _write(tmp_path / "train.jsonl", json.dumps(GOOD_ROW) + "\n")  # 1 row: eval_path set
    held = _write(tmp_path / "held.jsonl", "")
    argv = ["math-grpo", "data=file", f"data.path={train}", f"data.eval_path={held}"]
    assert cli.main(argv) == 2
    assert "invalid config: data.eval_path: " in capsys.readouterr().err
