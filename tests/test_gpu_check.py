"""benchmarks/gpu_check.py, without a GPU: what it records when it cannot or must not run a
step, how it stops a command at its time limit, and that its parsers read the lines the
measured commands print (made here by the code that prints them)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

from rlinf_vla.run.loop import _saved_line

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    sys.path.insert(0, str(BENCHMARKS))  # pipeline.py imports its neighbours
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


@pytest.fixture(scope="module")
def gpu_check():
    return _load("gpu_check")


@pytest.fixture
def no_commands(gpu_check, monkeypatch):
    """No GPU, and any subprocess a step would start fails the test."""
    monkeypatch.setattr(gpu_check, "probe_cuda", lambda: (False, "none in this test"))

    def refuse(argv, *args, **kwargs):
        raise AssertionError(f"a step started a command: {argv}")

    monkeypatch.setattr(gpu_check, "run_command", refuse)


def _run(gpu_check, tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "out"
    code = gpu_check.main(["--out", str(out), "--scratch", str(tmp_path / "scratch"), *args])
    return code, json.loads((out / "gpu_check.json").read_text())


def test_without_a_gpu_every_step_prints_one_skip_line_and_the_run_exits_0(
    gpu_check, no_commands, tmp_path, capsys
):
    code, result = _run(gpu_check, tmp_path, "--deadline-s", "600")
    assert code == 0
    names = [s.name for s in gpu_check.STEPS]
    assert [s["name"] for s in result["steps"]] == names
    assert result["mode"] == "no-gpu"
    assert {s["status"] for s in result["steps"]} == {"skipped"}
    lines = capsys.readouterr().out.splitlines()
    for name in names:
        mine = [ln for ln in lines if ln.startswith(f"{name}: ")]
        assert mine == [f"{name}: skipped: no CUDA GPU (none in this test)"]
    # nothing but the JSON in --out: no step wrote a log
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check.json"]


def test_a_deadline_of_zero_starts_no_step_and_says_so(gpu_check, no_commands, tmp_path, capsys):
    code, result = _run(gpu_check, tmp_path, "--dry-run-cpu", "--deadline-s", "0")
    assert code == 0
    assert result["mode"] == "dry-run-cpu"
    for step in result["steps"]:
        assert step["status"] == "not started"
        assert step["reason"].startswith("not started: 0 s for it before the deadline")
        assert step["commands"] == [] and step["log"] is None
    assert capsys.readouterr().out.count("not started:") == len(gpu_check.STEPS)


def test_steps_outside_the_selection_are_recorded_as_not_selected(gpu_check, no_commands, tmp_path):
    _, result = _run(gpu_check, tmp_path, "--steps", "decode,pytest", "--deadline-s", "60")
    status = {s["name"]: s["status"] for s in result["steps"]}
    assert status["decode"] == status["pytest"] == "skipped"
    assert {v for k, v in status.items() if k not in ("decode", "pytest")} == {"not selected"}
    with pytest.raises(SystemExit):
        _run(gpu_check, tmp_path, "--steps", "decode,nonsense")


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    status = Path(f"/proc/{pid}/status")
    return status.is_file() and "\nState:\tZ" in status.read_text()


def test_a_command_past_its_time_limit_is_stopped_with_its_children(gpu_check, tmp_path):
    log = tmp_path / "step.log"
    # a child that starts a grandchild, prints its pid and waits for longer than the limit
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('grandchild', p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    cmd = gpu_check.run_command([sys.executable, "-c", script], log, 1.0, dict(os.environ), 1.0)
    assert cmd["timed_out"] and cmd["rc"] < 0
    assert time.monotonic() - t0 < 10
    text = log.read_text()
    assert "(time limit)" in text
    pid = int(text.split("grandchild ")[1].split()[0])
    deadline = time.monotonic() + 5
    while not _dead(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dead(pid)

    ok = gpu_check.run_command([sys.executable, "-c", "print('hello')"], log, 30, {}, 1.0)
    assert ok["rc"] == 0 and not ok["timed_out"]
    assert "hello\n[gpu_check] exit 0" in log.read_text()


def test_the_parsers_read_what_the_measured_commands_print(gpu_check, tmp_path, capsys):
    # benchmarks/pipeline.py's line for a mode, printed by its own Measured
    pipeline = _load("pipeline")
    m = pipeline.Measured("libero spatial: ", 1)
    cpu = dict.fromkeys(pipeline.CPU_CLASSES, 0.0)
    m.add_loop((10.0, 0.1, 0.1, 0.5, cpu))
    m.add_mode("collocated S=2", 12.0, {}, cpu, 0)
    m.add_loop((14.0, 0.1, 0.1, 0.5, cpu))
    (row,) = gpu_check.ratio_lines(capsys.readouterr().out)
    assert row["workload"] == "libero spatial" and row["mode"] == "collocated S=2"
    assert (row["rate"], row["before"], row["after"], row["ratio"]) == (12.0, 10.0, 14.0, 1.0)
    assert "bound" not in row
    # with the loops' overlap bound (a toy run): 16 envs x 2 steps x 4 chunks in
    # 0.5 s + 4 x max(env, inference) s -> 128 / 0.9 = 142.2 and 128 / 1.3 = 98.5 env steps/s
    toy = pipeline.Workload("toy", "toy", {}, 16, 4)
    m = pipeline.Measured("toy: ", 1, functools.partial(pipeline.overlap_bound, toy, 2))
    m.add_loop((80.0, 0.1, 0.05, 0.5, cpu))
    m.add_mode("collocated S=2", 108.0, {}, cpu, 0)
    m.add_loop((60.0, 0.2, 0.05, 0.5, cpu))
    (row,) = gpu_check.ratio_lines(capsys.readouterr().out)
    assert row["ratio"] == pytest.approx(1.54)
    assert row["bound"] == pytest.approx((128 / 0.9 + 128 / 1.3) / 2, abs=0.05)
    assert row["of_bound"] == pytest.approx(108.0 / row["bound"], abs=0.005)
    assert m.of_bound["collocated S=2"] == [pytest.approx(108.0 / ((128 / 0.9 + 128 / 1.3) / 2))]
    # the toy's sleep that balances a loop: env 0.1 s per chunk of 32 env steps with a sleep of
    # 2 ms each is 0.036 s of the env's own compute; inference 0.15 s -> (0.15 - 0.036) / 32
    toy.env_config["step_time_per_env_s"] = 0.002
    assert pipeline.balanced_sleep(toy, 2, (80.0, 0.1, 0.15, 0.5, cpu)) == 0.003562
    assert pipeline.balanced_sleep(toy, 2, (80.0, 0.1, 0.01, 0.5, cpu)) == 0.0  # env alone slower

    # a run's checkpoint line, as the run loop writes it
    folder = tmp_path / "iter_1"
    folder.mkdir()
    (folder / "weights").write_bytes(b"x" * 3 * 2**20)
    (ckpt,) = gpu_check.checkpoint_lines("a\n" + _saved_line(folder, 69.94) + "\nb")
    assert ckpt == {"path": str(folder), "size": 3.0, "unit": "MiB", "seconds": 69.9}

    log = (
        "placement collocated, 2 stages: env all, rollout all, actor all on 1 GPU\n"
        "iter 1/2  0:00:16 elapsed, ~0:00:16 left  98.5 env steps/s  success -\n"
        "iter 2/2  0:00:20 elapsed, ~0:00:00 left  120 env steps/s  success -\n"
        "placement local, 2 stages: env 0, rollout 0, actor 0 on 1 GPU\n"
        "iter 1/2  0:00:09 elapsed, ~0:00:09 left  101 env steps/s  success -\n"
    )
    runs = gpu_check.train_runs(log)
    assert [r["env_steps_per_s"] for r in runs] == [[98.5, 120.0], [101.0]]
    assert runs[1]["placement"].startswith("local, 2 stages")

    text = "....\n= 1 failed, 11 passed, 5 skipped, 2 warnings, 1 error in 69.20s =\n"
    assert gpu_check.pytest_summary(text) == {
        "failed": 1,
        "passed": 11,
        "skipped": 5,
        "warnings": 2,
        "errors": 1,
    }
    assert gpu_check.pytest_summary("17 tests collected in 3.1s") == {"collected": 17}

    metrics = tmp_path / "metrics.jsonl"
    row = {"iteration": 1, "time/train_s": 4.1, "memory/actor_gpu_peak_gib": 47.3, "x": 1}
    metrics.write_text(json.dumps(row) + '\n{"iteration": 2, "time/tr')  # cut mid-line
    assert gpu_check.metrics_rows(metrics) == [
        {"iteration": 1, "time/train_s": 4.1, "memory/actor_gpu_peak_gib": 47.3}
    ]
