"""LIBERO: suites, reset-id mapping, one task per suite, crash recovery, all 130 tasks (slow)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from rlinf_vla.envs import make_env
from rlinf_vla.envs.libero.config import SUITES
from rlinf_vla.envs.libero.env import quat_to_axis_angle, reset_id_to_task_state

FAST = {"image_size": 64, "fast_render": True, "settle_steps": 2}


def test_reset_id_mapping_covers_every_pair() -> None:
    pairs = {reset_id_to_task_state(r, 3) for r in range(150)}
    assert len(pairs) == 150 and reset_id_to_task_state(150, 3) == (0, 0)
    assert reset_id_to_task_state(57, 10) == (1, 7)


def test_quat_to_axis_angle() -> None:
    half = np.sin(np.pi / 4)
    assert np.allclose(quat_to_axis_angle(np.array([0, 0, half, half])), [0, 0, np.pi / 2])
    assert np.allclose(quat_to_axis_angle(np.array([0, 0, 0, 1.0])), 0)


def test_unknown_suite_lists_known() -> None:
    with pytest.raises(ValueError, match="libero_spatial"):
        make_env("libero", suite="libero_100")


@pytest.mark.sim
def test_robosuites_macro_file_advice_is_kept_out_of_the_logs() -> None:
    pytest.importorskip("libero.libero")

    def stderr_of(code: str) -> str:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stderr

    assert "No private macro file found" in stderr_of("import robosuite")  # what it says alone
    ours = stderr_of("from rlinf_vla.envs.libero.env import _import_benchmark; _import_benchmark()")
    assert "macro file" not in ours and "setup_macros" not in ours


@pytest.mark.sim
def test_suites_have_130_tasks_with_50_init_states() -> None:
    pytest.importorskip("libero.libero")
    from rlinf_vla.envs.libero.env import load_init_states, suite_tasks

    sizes = {s: len(suite_tasks(s)) for s in SUITES}
    assert sizes == {
        "libero_spatial": 10,
        "libero_object": 10,
        "libero_goal": 10,
        "libero_10": 10,
        "libero_90": 90,
    }
    tasks = suite_tasks("libero_130")
    assert len(tasks) == 130 and len({t.bddl_file for t in tasks}) == 130
    assert all(len(load_init_states(t)) == 50 for t in tasks)
    with pytest.raises(ValueError, match=r"task_ids \[10\]"):
        make_env("libero", suite="libero_goal", task_ids=[10])


@pytest.mark.sim
def test_one_task_per_suite() -> None:
    """One worker walks through the first task of each suite (a task switch rebuilds it)."""
    pytest.importorskip("libero.libero")
    from rlinf_vla.envs.libero.env import suite_tasks

    all_tasks = suite_tasks("libero_130")
    first = [i for i, t in enumerate(all_tasks) if t.index == 0]
    assert [all_tasks[i].suite for i in first] == list(SUITES)
    env = make_env("libero", suite="libero_130", task_ids=first, num_envs=1, **FAST)
    try:
        for j, i in enumerate(first):
            state_id = 7 + j
            obs = env.reset(torch.tensor([50 * j + state_id]))
            assert obs.instruction == [all_tasks[i].instruction]
            assert obs.images["main"].shape == (1, 64, 64, 3)
            assert obs.images["wrist"].shape == (1, 64, 64, 3)
            assert obs.state.shape == (1, 8)
            res = env.chunk_step(torch.zeros(1, 3, 7))
            assert res.info["elapsed_steps"].item() == 3 and not res.info["invalid"].any()
            assert env.max_episode_steps == 520
        assert env.task_of(torch.tensor([50 * 4]))[0].suite == "libero_90"
    finally:
        env.close()


@pytest.mark.sim
def test_time_limit_follows_the_suite() -> None:
    pytest.importorskip("libero.libero")
    from rlinf_vla.envs.libero.config import LiberoEnvConfig
    from rlinf_vla.envs.libero.env import suite_tasks, task_limits

    tasks = suite_tasks("libero_130")
    cfg = LiberoEnvConfig(suite="libero_130", max_steps={"libero_goal": 123})
    limits = task_limits(cfg, tasks)
    assert limits[[0, 15, 25, 35, 45]].tolist() == [220, 280, 123, 520, 400]
    cfg = LiberoEnvConfig(suite="libero_130", max_episode_steps=77)
    assert (task_limits(cfg, tasks) == 77).all()
    with pytest.raises(ValueError, match="max_steps"):
        LiberoEnvConfig(max_steps={"libero_1000": 5})


@pytest.mark.sim
def test_killed_worker_is_restarted_and_episode_invalid() -> None:
    pytest.importorskip("libero.libero")
    env = make_env("libero", suite="libero_object", task_ids=[0], num_envs=2, **FAST)
    try:
        env.reset(torch.tensor([0, 1]))
        proc = env.workers.process(1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)
        res = env.chunk_step(torch.zeros(2, 2, 7))
        assert res.info["invalid"].tolist() == [False, True]
        assert res.truncated[1, 0] and not res.success[1]
        assert env.workers.restarts == [0, 1]
        assert res.info["elapsed_steps"].tolist() == [2, 0]
        res = env.chunk_step(torch.zeros(2, 2, 7))
        assert not res.info["invalid"].any()
        assert res.info["elapsed_steps"].tolist() == [4, 2]
    finally:
        env.close()


@pytest.mark.sim
@pytest.mark.slow
def test_all_130_tasks_build_reset_and_step() -> None:
    pytest.importorskip("libero.libero")
    env = make_env("libero", suite="libero_130", num_envs=2, **FAST)
    try:
        seen = set()
        for j in range(0, 130, 2):
            ids = torch.tensor([50 * j + j % 50, 50 * (j + 1) + (j + 1) % 50])
            obs = env.reset(ids)
            seen.update(obs.instruction)
            res = env.chunk_step(torch.zeros(2, 1, 7))
            assert not res.info["invalid"].any()
            assert obs.images["main"].float().std() > 5
        assert len(seen) >= 100  # a few LIBERO-90 tasks share an instruction across scenes
    finally:
        env.close()
