"""End-to-end evaluations with tiny policies: resumability (toy), a LIBERO and a ManiSkill task
set, and crashed simulators recorded as errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlinf_vla import provenance
from rlinf_vla.eval import run
from rlinf_vla.eval.report import TrialLog
from tests.eval.conftest import eval_job

# A toy scene where a tiny random policy sometimes succeeds, so outcomes and steps vary.
TOY = ("env=toy", "policy=openvla", "env.success_radius=0.3", "env.step_size=0.2")


def _lines(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "trials.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_interrupted_run_resumes_to_the_same_results(ray_cluster, tmp_path, monkeypatch) -> None:
    args = (*TOY, "eval.trials_per_task=8", "env.num_envs=1")
    ref = run(eval_job(*args, f"eval.output_dir={tmp_path / 'ref'}"))
    assert ref["suites"]["toy"]["trials"] == 8
    assert 0 < ref["suites"]["toy"]["successes"] < 8, "outcomes should vary"

    # Interrupt the second run after its third trial was written, then tear a fourth line.
    out = tmp_path / "resumed"
    append = TrialLog.append
    calls = []

    def interrupted(self, record):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(record)
        append(self, record)

    monkeypatch.setattr(TrialLog, "append", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(eval_job(*args, f"eval.output_dir={out}"))
    monkeypatch.setattr(TrialLog, "append", append)
    partial = json.loads((out / "results.json").read_text())
    assert len(partial["trials"]) == 3 and partial["planned"] == 8
    assert "Incomplete: 3 of 8" in (out / "summary.md").read_text()
    with open(out / "trials.jsonl", "a") as f:
        f.write('{"suite": "toy", "task": "t')

    resumed = run(eval_job(*args, f"eval.output_dir={out}"))
    assert (out / "results.json").read_text() == (tmp_path / "ref" / "results.json").read_text()
    assert resumed == ref
    keys = [(r["task"], r["init_state"]) for r in _lines(out)]
    assert len(keys) == 8 and len(set(keys)) == 8, "no trial ran twice"
    assert [r["start"] for r in provenance.read(out)] == [0, 3]  # trials done at each start
    # A finished folder runs nothing; other settings are refused.
    again = run(eval_job(*args, f"eval.output_dir={out}"))
    assert again == ref and len(_lines(out)) == 8
    with pytest.raises(ValueError, match=r"env\.success_radius"):
        other = [a.replace("radius=0.3", "radius=0.2") for a in args]
        run(eval_job(*other, f"eval.output_dir={out}"))


@pytest.mark.sim
@pytest.mark.slow
def test_libero_two_tasks_end_to_end(ray_cluster, tmp_path, capsys) -> None:
    """OpenVLA-OFT (tiny checkpoint) on 2 libero_goal tasks x 3 init states, 2 envs in
    parallel, failure videos; every (task, init state) exactly once."""
    pytest.importorskip("libero.libero")
    from rlinf_vla.envs.libero.env import suite_tasks
    from rlinf_vla.policies import make_policy

    ckpt = tmp_path / "ckpt"
    make_policy("openvla_oft", preset="tiny", seed=0).save_pretrained(ckpt)
    out = tmp_path / "eval"
    results = run(
        eval_job(
            "env=libero",
            "env.suite=libero_goal",
            "env.task_ids=[2,5]",
            "env.num_envs=2",
            "eval.protocol=package",  # small, cheap renders and short episodes
            "env.image_size=64",
            "env.fast_render=true",
            "env.settle_steps=2",
            "+env.max_episode_steps=10",
            "policy=openvla_oft",
            f"policy.checkpoint={ckpt}",
            "eval.trials_per_task=3",
            "eval.videos=failures",
            f"eval.output_dir={out}",
        )
    )
    tasks = suite_tasks("libero_goal")
    trials = results["trials"]
    assert [(t["task"], t["init_state"]) for t in trials] == [
        (tasks[i].name, s) for i in (2, 5) for s in range(3)
    ]
    for t in trials:
        assert t["instruction"] == tasks[t["task_index"]].instruction
        assert t["error"] is None and 1 <= t["steps"] <= 10
        assert t["success"] or t["steps"] == 10
        if not t["success"]:
            assert (out / t["video"]).stat().st_size > 1000
    assert set(results["suites"]) == {"libero_goal"} and len(results["tasks"]) == 2
    assert results["suites"]["libero_goal"]["valid"] == 6
    assert results["protocol"]["name"] == "package" and results["protocol"]["image_size"] == 64
    rows = (out / "results.csv").read_text().splitlines()
    assert len(rows) == 7 and rows[0].startswith("suite,task,task_index,init_state")
    assert "policy.checkpoint is not set" not in capsys.readouterr().err


@pytest.mark.sim
def test_crashed_env_is_retried_once_then_an_error(ray_cluster, tmp_path) -> None:
    """An env that never answers in time (worker_timeout_s) is killed and restarted; after one
    retry the trial is recorded as an error: a failure in the headline rate, left out of the
    rate over valid trials."""
    pytest.importorskip("libero.libero")
    out = tmp_path / "eval"
    torch.manual_seed(1234)
    results = run(
        eval_job(
            "env=libero",
            "env.suite=libero_goal",
            "env.task_ids=[0]",
            "env.num_envs=1",
            "+env.worker_timeout_s=0.01",
            "eval.trials_per_task=2",
            f"eval.output_dir={out}",
        )
    )
    suite = results["suites"]["libero_goal"]
    assert suite["errors"] == 2 and suite["valid"] == 0 and suite["trials"] == 2
    assert suite["success_rate"] == 0.0 and suite["success_rate_valid"] is None
    assert results["protocol"]["name"] == "official"
    for t in results["trials"]:
        assert t["success"] is None and t["steps"] is None
        assert "no answer within 0.01 s" in t["error"] and "after 2 attempt(s)" in t["error"]
    assert "## Errors" in (out / "summary.md").read_text()
    # eval seeds its own draws and gives the caller's global RNG back where it left it
    draw = torch.rand(3)
    assert torch.equal(draw, torch.rand(3, generator=torch.Generator().manual_seed(1234)))


@pytest.mark.sim
def test_results_record_the_protocol_and_both_rates(tmp_path) -> None:
    """libero_goal task 4 x 4 init states, one of them crashed: results.json and the printed
    table give 1 of 4 (the crash a failure) as the headline and 1 of 3 without it."""
    pytest.importorskip("libero.libero")
    from rlinf_vla.eval.report import render_summary
    from rlinf_vla.eval.runner import finalize

    job = eval_job(
        "env=libero",
        "env.suite=libero_goal",
        "env.task_ids=[4]",
        "eval.trials_per_task=4",
        f"eval.output_dir={tmp_path}",
    )
    log = TrialLog(tmp_path)
    outcomes = [(True, None), (False, None), (None, "the simulator crashed"), (False, None)]
    for trial, (success, error) in zip(job.trials, outcomes, strict=True):
        log.append(
            {
                "suite": trial.suite,
                "task": trial.task,
                "task_index": trial.task_index,
                "init_state": trial.init_state,
                "reset_id": trial.reset_id,
                "success": success,
                "steps": None if error else 300,
                "error": error,
                "instruction": "x",
                "video": None,
            }
        )
    finalize(job, log)
    results = json.loads((tmp_path / "results.json").read_text())
    proto = results["protocol"]
    assert proto["name"] == "official" and proto["scene_seed"] == 0
    assert proto["settle_steps"] == 10 and proto["image_size"] == 256
    assert proto["max_steps"]["libero_goal"] == 300
    suite = results["suites"]["libero_goal"]
    assert (suite["trials"], suite["successes"], suite["errors"]) == (4, 1, 1)
    assert suite["success_rate"] == 0.25 and suite["success_rate_valid"] == pytest.approx(1 / 3)
    # Wilson 95%: 1 of 4 -> [4.6, 69.9]%.
    assert suite["ci95"] == pytest.approx([0.045587, 0.699358], abs=1e-6)
    table = render_summary(results)
    assert "| libero_goal | 25.0 | [4.6, 69.9] | 1 / 4 | 33.3 | 1 |" in table
    assert "Protocol: official, scene seed 0" in table
    assert (tmp_path / "summary.md").read_text() == table


@pytest.mark.sim
@pytest.mark.slow
def test_maniskill_two_tasks_end_to_end(ray_cluster, tmp_path, capsys) -> None:
    pytest.importorskip("mani_skill")
    results = run(
        eval_job(
            "env=maniskill",
            "env.num_envs=2",
            "env.image_size=64",
            "env.max_episode_steps=4",
            "env.sim_backend=cpu",
            "policy=openvla",
            "eval.tasks=[PickCube-v1,PushCube-v1]",
            "eval.trials_per_task=2",
            "eval.seed=100",
            f"eval.output_dir={tmp_path}",
        )
    )
    got = [(t["task"], t["init_state"], t["reset_id"]) for t in results["trials"]]
    assert got == [
        ("PickCube-v1", 100, 100),
        ("PickCube-v1", 101, 101),
        ("PushCube-v1", 100, 100),
        ("PushCube-v1", 101, 101),
    ]
    instructions = {t["task"]: t["instruction"] for t in results["trials"]}
    assert "red cube" in instructions["PickCube-v1"] and "push" in instructions["PushCube-v1"]
    assert all(t["error"] is None and 1 <= t["steps"] <= 4 for t in results["trials"])
    assert [t["task"] for t in results["tasks"]] == ["PickCube-v1", "PushCube-v1"]
    # No checkpoint: the console says that the weights are random.
    assert "policy.checkpoint is not set" in capsys.readouterr().err


@pytest.mark.slow
def test_several_envs_per_worker(ray_cluster, tmp_path) -> None:
    """3 envs as 2 workers (2 + 1 slots, the 2 stepped in threads): every trial exactly once."""
    results = run(
        eval_job(
            *TOY,
            "env.num_envs=3",
            "eval.envs_per_worker=2",
            "eval.trials_per_task=7",
            "eval.seed=40",
            f"eval.output_dir={tmp_path}",
        )
    )
    assert [t["init_state"] for t in results["trials"]] == list(range(40, 47))
    assert all(t["error"] is None and 1 <= t["steps"] <= 16 for t in results["trials"])
    assert len(_lines(tmp_path)) == 7
