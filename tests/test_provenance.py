"""run_info.jsonl: what a run ran on, and what changed when it was resumed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy
import torch

from rlinf_vla import provenance
from rlinf_vla.run.loop import RunLoop
from rlinf_vla.run.tracking import LoggingConfig


def test_the_record_names_the_versions_python_and_cpus_of_this_process():
    info = provenance.collect(argv=["rlinf-vla", "train"], start=3, devices=["cpu:0@node0"])
    assert info["argv"] == ["rlinf-vla", "train"]
    assert info["start"] == 3
    assert info["devices"] == ["cpu:0@node0"]
    assert info["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert info["packages"]["torch"] == torch.__version__.split("+")[0]  # without the build tag
    assert info["packages"]["numpy"] == numpy.__version__
    assert info["torch_cuda"] == torch.version.cuda
    # /proc/cpuinfo lists one "processor" per logical CPU; this process may use some of them
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    processors = sum(line.startswith("processor") for line in cpuinfo)
    assert info["cpu"]["logical_cpus"] == processors
    assert 1 <= info["cpu"]["usable_cpus"] <= processors
    assert info["source"]["version"] == "0.1.0"
    json.dumps(info)  # one line of run_info.jsonl


def test_packages_that_are_not_installed_are_left_out():
    versions = provenance.package_versions(("numpy", "no-such-distribution-xyz"))
    assert versions == {"numpy": numpy.__version__}


def _git(repo, *args):
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    out = subprocess.run(
        ["git", "-C", str(repo), *args], env=env, check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


def test_the_source_commit_is_that_of_the_checkout_the_package_is_tracked_in(tmp_path):
    repo = tmp_path / "repo"
    package = repo / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "pkg/__init__.py")
    _git(repo, "commit", "-q", "-m", "first")
    head = _git(repo, "log", "-1", "--format=%H")
    assert len(head) == 40

    assert provenance.source_info(package) == {"version": "0.1.0", "commit": head, "dirty": False}
    (package / "__init__.py").write_text("x = 2\n")
    assert provenance.source_info(package)["dirty"] is True

    # An untracked copy inside the checkout (a wheel installed into a venv there) is not it.
    installed = repo / ".venv" / "site-packages" / "pkg"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("x = 1\n")
    assert provenance.source_info(installed)["commit"] is None
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    assert provenance.source_info(outside) == {"version": "0.1.0", "commit": None, "dirty": None}


def _info(**packages):
    return {
        "source": {"version": "0.1.0", "commit": "a" * 40, "dirty": False},
        "python": "3.11.7",
        "cpu": {"model": "Xeon"},
        "gpus": [],
        "torch_cuda": "13.0",
        "packages": {"torch": "2.14.1", "numpy": "2.4.6", **packages},
    }


def test_differences_list_each_changed_version_commit_and_machine_part():
    first = _info(ray="2.60.0")
    now = _info(vllm="0.11.0")
    now["packages"]["torch"] = "2.13.0"
    now["source"] = {"version": "0.1.0", "commit": "b" * 40, "dirty": True}
    now["gpus"] = ["NVIDIA H100, 81559 MiB, driver 580.1"]
    assert provenance.differences(first, now) == [
        f"rlinf-vla commit: {'a' * 40} -> {'b' * 40}",
        "uncommitted changes: False -> True",
        "GPUs: none -> NVIDIA H100, 81559 MiB, driver 580.1",
        "ray: 2.60.0 -> not installed",
        "torch: 2.14.1 -> 2.13.0",
        "vllm: not installed -> 0.11.0",
    ]
    assert provenance.differences(first, _info(ray="2.60.0")) == []


def test_each_start_appends_a_record_and_is_compared_with_the_first(tmp_path):
    assert provenance.record(tmp_path, {**_info(), "start": 0}) == []
    second = {**_info(), "start": 4}
    assert provenance.record(tmp_path, second) == []
    third = {**_info(), "start": 8, "python": "3.12.1"}
    assert provenance.record(tmp_path, third) == ["Python: 3.11.7 -> 3.12.1"]
    assert [r["start"] for r in provenance.read(tmp_path)] == [0, 4, 8]


def test_a_resumed_loop_records_its_start_and_warns_about_changed_software(
    tmp_path, capsys, monkeypatch
):
    def loop(total):
        return RunLoop(
            tmp_path / "run",
            {},
            LoggingConfig(tensorboard=False),
            command="train",
            unit="iter",
            total=total,
            save_interval=2,
            max_nan_updates=3,
            devices=["cpu:0@node0", "cpu:1@node0"],
        )

    def iteration(i, logger, say):
        return {"iteration": i + 1}

    def save(n):
        return tmp_path / "run" / "checkpoints" / f"iter_{n}"

    loop(2).run(0, iteration, save, lambda m: "")
    assert "changed" not in capsys.readouterr().err
    real = provenance.package_versions()
    monkeypatch.setattr(provenance, "package_versions", lambda: {**real, "torch": "0.0.1"})
    loop(4).run(2, iteration, save, lambda m: "")
    err = capsys.readouterr().err
    assert "changed since the run started" in err
    assert f"torch: {real['torch']} -> 0.0.1" in err
    records = provenance.read(tmp_path / "run")
    assert [r["start"] for r in records] == [0, 2]
    assert records[0]["devices"] == ["cpu:0@node0", "cpu:1@node0"]
    assert records[1]["packages"]["torch"] == "0.0.1"
