"""Every script in benchmarks/ imports and answers ``--help``: a study that fails at import (a
helper moved to another module) is found here, not hours into a run on another machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# Runs each script as ``python benchmarks/<name>.py --help`` would (its folder on the path, run
# as ``__main__``), all in one fresh interpreter: torch and the package are imported once.
_PROBE = r"""
import contextlib, io, json, runpy, sys, traceback
results = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    sys.path.insert(0, str(__import__("pathlib").Path(path).parent))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code or 0
    except BaseException:
        code = traceback.format_exc()
    finally:
        sys.path.pop(0)
    results[path] = {"code": code, "help": out.getvalue()}
print(json.dumps(results))
"""


def test_every_benchmark_script_imports_and_prints_its_usage() -> None:
    scripts = sorted(str(p) for p in BENCHMARKS.glob("*.py"))
    assert len(scripts) >= 10
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *scripts],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    results = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {Path(p).name: r["code"] for p, r in results.items() if r["code"] != 0}
    assert not failed, failed
    quiet = [Path(p).name for p, r in results.items() if "usage" not in r["help"].lower()]
    assert not quiet, f"no usage line from --help: {quiet}"


#: In a fresh interpreter (no Ray instance of the suite's below it): a child started as the
#: env processes are, burning 0.8 s of CPU (``exec`` is picklable by reference, so the child
#: needs no module of the suite), while this process burns 0.4 s; the counts as JSON.
_CPU_PROBE = r"""
import importlib.util, json, multiprocessing as mp, sys, time
from pathlib import Path

import pytest

BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end:\n    pass\n"

if __name__ == "__main__":
    path = Path(sys.argv[1])
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("_bench_pipeline", path)
    pipeline = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pipeline
    spec.loader.exec_module(pipeline)
    window = pipeline.CpuWindow()
    window.sample()
    child = mp.get_context("spawn").Process(target=exec, args=(BURN.format(s=0.8),))
    child.start()
    exec(BURN.format(s=0.4))
    while child.is_alive():
        window.sample()
        time.sleep(0.02)
    child.join()
    window.sample()
    print(json.dumps(window.totals()))
"""


def test_the_pipeline_benchmark_counts_cpu_per_class_of_process() -> None:
    """``benchmarks/pipeline.py``'s CPU count: a child started as the env processes are
    (multiprocessing's ``spawn``) is a simulator, and its CPU counts after it exits; the
    process itself is the run; no Ray daemon runs there."""
    done = subprocess.run(
        [sys.executable, "-c", _CPU_PROBE, str(BENCHMARKS / "pipeline.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(counts) == {"simulators", "run", "ray"}
    assert 0.75 <= counts["simulators"] <= 1.6, counts  # 0.8 s, its start-up and the last 20 ms
    assert 0.38 <= counts["run"] <= 1.0, counts
    assert counts["ray"] == 0, counts


def test_a_study_refuses_a_stage_folder_made_with_other_settings(tmp_path, monkeypatch) -> None:
    """benchmarks/beyond_imitation.py (and multitask.py, which uses its runs) reuse a finished
    stage by its folder's name, which does not hold the envs or the iterations: a folder made
    with other values is refused, naming them, instead of being reported as this command's."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from beyond_imitation import check_reuse

    run = tmp_path / "MT10-demos5-sft3000-seed0-ppo0"
    check_reuse(run, {"env.num_envs": 40})  # nothing there yet: a new stage
    run.mkdir()
    (run / "config.yaml").write_text(
        "env:\n  num_envs: 10\nrunner:\n  max_iterations: 60\n  rollout_chunks: 38\n"
    )
    check_reuse(run, {"env.num_envs": 10, "runner.max_iterations": 60})  # the same: reused
    try:
        check_reuse(run, {"env.num_envs": 40, "runner.max_iterations": 60, "algo.lr": 1})
    except SystemExit as e:
        said = str(e)
    else:
        raise AssertionError("a folder of 10 envs was taken for a run of 40")
    assert "env.num_envs=10 there, 40 here" in said
    assert "algo.lr=None there, 1 here" in said
    assert "max_iterations" not in said and "--work of its own" in said


def test_a_stage_folder_made_without_this_commands_set_values_is_refused(
    monkeypatch, tmp_path: Path
) -> None:
    """A `--set ppo.env.reward_mode=normalized_dense` study in the folder of a sparse one would
    otherwise report the sparse runs as its own: the stage's --set values are compared too,
    as values (`true` is True, `1e-4` is 0.0001)."""
    import argparse

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from beyond_imitation import check_reuse, set_settings

    run = tmp_path / "PushCube-v1-proprio-demos20-sft3000-seed0-ppo0"
    run.mkdir()
    (run / "config.yaml").write_text(
        "env:\n  reward_mode: sparse\n  ignore_terminations: true\nalgo:\n  lr: 0.0001\n"
    )
    sets = ["ppo.env.ignore_terminations=true", "ppo.algo.lr=1e-4", "sft.sft.lr=1"]
    check_reuse(run, set_settings(argparse.Namespace(set=sets), "ppo"))  # the same values
    dense = argparse.Namespace(set=[*sets, "ppo.env.reward_mode=normalized_dense"])
    assert set_settings(dense, "ppo")["env.reward_mode"] == "normalized_dense"
    with pytest.raises(SystemExit, match=r"env\.reward_mode=sparse there, normalized_dense here"):
        check_reuse(run, set_settings(dense, "ppo"))


def test_a_variant_gets_rl_folders_of_its_own_beside_the_warm_start(monkeypatch, tmp_path) -> None:
    """`--variant NAME` puts the RL runs in folders ending in -NAME next to the warm start (so
    two recipes share one work folder's warm starts) and finds its own finished run there,
    not the plain recipe's."""
    import argparse

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from beyond_imitation import rl_run

    warm = {"run_dir": str(tmp_path / "PushCube-v1-proprio-demos20-sft3000-seed1"), "seed": 1}
    for name in ("ppo0", "ppo0-boot"):  # the plain recipe's run and the variant's, finished
        run = tmp_path / f"PushCube-v1-proprio-demos20-sft3000-seed1-{name}"
        (run / "checkpoints" / "iter_40" / "policy").mkdir(parents=True)
        gamma = 0.8 if "boot" in name else 0.99
        (run / "config.yaml").write_text(
            "env:\n  num_envs: 40\nrunner:\n  max_iterations: 40\n  rollout_chunks: 13\n"
            f"algo:\n  update_epochs: 2\n  minibatch_size: 260\n  gamma: {gamma}\n"
        )
        metrics = {"iteration": 40, "eval/success_rate": gamma}
        held = [
            {"iteration": 39, "memory/total_rss_gib": 7.4},
            {**metrics, "memory/total_rss_gib": 7.1},
        ]
        rows = held if "boot" in name else [metrics]  # the plain run logged no total
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = argparse.Namespace(
        head_only=False, ppo_iterations=40, minibatches=2, epochs=2, group=5, eval_every=20,
        eval_episodes=64, eval_envs=4, set=["ppo.algo.gamma=0.8"], variant="boot",
    )  # fmt: skip
    record = rl_run(args, "ppo", warm, 0, [], 40, 13)  # finished: found, not run
    assert record["run_dir"].endswith("-seed1-ppo0-boot") and record["variant"] == "boot"
    assert record["last"].endswith("ppo0-boot/checkpoints/iter_40/policy")
    assert record["curve"] == [(40, 0.8)]  # the variant's own evaluations
    assert record["held_gib"] == 7.4  # the most its workers held, over its iterations
    args.variant = ""  # the same --set without the name would be the plain run's folder
    with pytest.raises(SystemExit, match=r"algo\.gamma=0\.99 there, 0\.8 here"):
        rl_run(args, "ppo", warm, 0, [], 40, 13)


def test_a_second_command_waits_for_a_stage_another_one_is_writing(
    monkeypatch, tmp_path, capsys
) -> None:
    """Two commands of one study started at once (one per SFT seed) reach the same collect or
    scoring stage: the second waits for the first's stage_lock and then finds its result,
    instead of writing into the same folder at the same time."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from maniskill_learning import stage_lock

    demos = tmp_path / "PushCube-v1-demos20"
    holder = f"""
import fcntl, sys, time
from pathlib import Path
with open({str(demos) + ".lock"!r}, "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(1.5)
    Path({str(demos)!r}).mkdir()  # the stage's result, written while it holds the lock
"""
    other = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    assert other.stdout is not None and other.stdout.readline() == "held\n"
    with stage_lock(demos):
        assert demos.is_dir()  # entered only once the other command's stage was written
    assert other.wait(timeout=30) == 0
    assert f"waiting for another command to finish {demos}" in capsys.readouterr().out
    with stage_lock(demos):  # free again: no wait, nothing printed
        pass
    assert capsys.readouterr().out == ""


def test_the_multitask_table_gives_each_algorithm_its_runs_and_paired_gains(monkeypatch) -> None:
    """benchmarks/multitask.py's rows: BC over the warm starts, and per algorithm the mean of its
    own runs and each run's gain over the warm start of its SFT seed (hand-computed here)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from multitask import row

    warm = [
        {"seed": 0, "held_out": {"reach": 0.2}, "check": {"reach": 0.0}},
        {"seed": 1, "held_out": {"reach": 0.6}, "check": {"reach": 0.4}},
    ]
    runs = [
        {"algo": "ppo", "sft_seed": 0, "held_out": {"reach": 0.4}, "check": {"reach": 0.2}},
        {"algo": "ppo", "sft_seed": 1, "held_out": {"reach": 0.6}, "check": {"reach": 0.8}},
        {"algo": "grpo", "sft_seed": 1, "held_out": {"reach": 0.2}, "check": {"reach": 0.4}},
    ]
    r = row("reach", warm, runs)
    assert abs(r["bc_held_out"]["mean"] - 0.4) < 1e-9
    assert abs(r["ppo_held_out"]["mean"] - 0.5) < 1e-9
    # PPO: +20 over seed 0's warm start, +0 over seed 1's; check: +20, +40
    assert abs(r["gain_ppo_held_out"]["mean"] - 10.0) < 1e-9
    assert abs(r["gain_ppo_check"]["mean"] - 30.0) < 1e-9
    # GRPO's one run is paired with SFT seed 1 (0.6 -> 0.2), not with the mean warm start
    assert abs(r["gain_grpo_held_out"]["mean"] + 40.0) < 1e-9
    assert abs(r["gain_grpo_check"]["mean"] - 0.0) < 1e-9
    assert row("reach", warm, []).keys() == {"task", "bc_held_out", "bc_check"}


def test_behaviour_cloning_against_the_number_of_demonstrations(monkeypatch, capsys) -> None:
    """`--demos 5 20 --algos` (no RL) ends with BC's best validation point and its scores per
    number of demonstrations, mean +- sd over the SFT seeds."""
    import argparse

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from beyond_imitation import show_by_demos, table

    def warm(seed: int, curve: list[float], held_out: float) -> dict:
        points = [(500 * (k + 1), r) for k, r in enumerate(curve)]
        return {"seed": seed, "validation_curve": points, "held_out": held_out, "check": 0.5}

    studies = []
    for n, warms in ((5, [warm(0, [0.1, 0.2], 0.2), warm(1, [0.3, 0.1], 0.4)]),
                     (20, [warm(0, [0.4, 0.5], 0.5), warm(1, [0.5, 0.7], 0.6)])):  # fmt: skip
        studies.append({"demos": n, "warm_starts": warms, "table": table(warms, [], False)})
    args = argparse.Namespace(task="PushCube-v1", sft_seeds=[0, 1], sft_steps=3000)
    show_by_demos(studies, args)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].split()[:4] == ["5", "0.250", "+-", "0.071"]  # best points 0.2 and 0.3
    assert lines[-2].split()[4:8] == ["0.300", "+-", "0.141", "[0.20,"]
    assert lines[-1].split()[:4] == ["20", "0.600", "+-", "0.141"]  # 0.5 and 0.7


def test_the_pipeline_benchmark_reads_what_a_modes_workers_held(tmp_path: Path) -> None:
    """A mode's row carries the most its workers held together (``memory/total_rss_gib`` of
    the run): at least a Python process with torch and the tiny policy, less than the machine
    has, and no less than any single group's reading of the same run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_pipeline_mem", BENCHMARKS / "pipeline.py")
    pipeline = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pipeline
    spec.loader.exec_module(pipeline)
    toy = pipeline.Workload("toy", "toy", {}, 4, 2)
    policy = pipeline.policy_overrides("openvla", "tiny", 2, [])
    rate, parts, _, held = pipeline.mode_rate(
        toy, ["placement=local"], policy, 1, 2, tmp_path / "run"
    )
    assert rate > 0 and parts["wall"] > 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    groups = [v for r in rows for k, v in r.items() if k.endswith("_rss_gib") and "total" not in k]
    assert 0.2 < held < 24
    assert held >= max(groups) - 1e-9
