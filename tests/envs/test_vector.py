"""Subprocess vectorisation: parallel calls, errors, crashed children restarted and reported."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import signal
import threading
import time
import types

import numpy as np
import pytest
import torch
from _cores import CounterCore

from rlinf_vla.envs.base import EnvConfig, StepOutput, VectorEnv
from rlinf_vla.envs.vector import CRASHED, EnvWorkerError, SubprocBatch, SubprocEnvs
from rlinf_vla.types import Observation


class CounterEnv(VectorEnv):
    """``CounterCore`` in subprocesses behind the contract (not registered)."""

    name = "counter"

    def __init__(self, config: EnvConfig, core=CounterCore) -> None:
        self.batch = SubprocBatch(SubprocEnvs([core] * config.num_envs, name="counter"))
        super().__init__(config, default_max_episode_steps=20)

    @property
    def action_dim(self) -> int:
        return 1

    @property
    def num_reset_ids(self) -> int:
        return 5

    def _reset_envs(self, env_ids: torch.Tensor, reset_ids: torch.Tensor) -> Observation:
        return self.batch.reset(env_ids, reset_ids)

    def _step_envs(self, actions, active, need_obs) -> StepOutput:
        return self.batch.step(actions, active, need_obs)

    @property
    def workers(self) -> SubprocEnvs:
        return self.batch.envs

    def _close(self) -> None:
        self.batch.envs.close()


@pytest.fixture(scope="module")
def env():
    e = CounterEnv(EnvConfig(num_envs=3, max_episode_steps=20))
    yield e
    e.close()


def test_children_run_and_results_batch(env: CounterEnv) -> None:
    obs = env.reset(torch.tensor([1, 2, 3]))
    assert obs.state.flatten().tolist() == [1, 2, 3]
    res = env.chunk_step(torch.ones(3, 4, 1))
    assert res.obs.state.flatten().tolist() == [5, 6, 7]
    pids = env.batch.envs.call("pid", {0: (), 1: (), 2: ()})
    assert len(set(pids.values())) == 3 and os.getpid() not in pids.values()


def test_rendering_skipped_inside_chunk(env: CounterEnv) -> None:
    env.reset(torch.tensor([0, 0, 0]))
    before = env.batch.envs.call("render_count", {0: ()})[0]
    env.chunk_step(torch.zeros(3, 8, 1))
    after = env.batch.envs.call("render_count", {0: ()})[0]
    assert after - before == 1  # only the last step of the chunk was rendered


def test_success_inside_chunk_gives_final_obs(env: CounterEnv) -> None:
    env.reset(torch.tensor([8, 0, 0]))
    res = env.chunk_step(torch.ones(3, 4, 1))
    assert res.terminated[0].tolist() == [False, True, False, False]
    assert res.final_obs is not None and res.final_obs.state[0].item() == 10
    assert res.success.tolist() == [True, False, False]
    assert res.info["elapsed_steps"][0] == 0  # auto-reset
    assert res.obs.state[1].item() == 4


def test_core_exception_is_raised_with_traceback(env: CounterEnv) -> None:
    with pytest.raises(EnvWorkerError, match="boom inside the core"):
        env.batch.envs.call("boom", {1: ()})
    env.reset()  # the pool is still usable


def test_start_failure_names_env() -> None:
    factory = functools.partial(CounterCore, fail_start=True)
    with pytest.raises(EnvWorkerError, match=r"failed to start(.|\n)*refuses to start"):
        SubprocEnvs([factory], name="counter")


def test_killed_child_is_restarted_and_episode_invalid(env: CounterEnv) -> None:
    env.reset(torch.tensor([0, 0, 0]))
    env.chunk_step(torch.ones(3, 2, 1))
    pool = env.batch.envs
    restarts = list(pool.restarts)
    old = pool.process(1)
    os.kill(old.pid, signal.SIGKILL)
    old.join(timeout=10)
    res = env.chunk_step(torch.ones(3, 3, 1))
    assert res.info["invalid"].tolist() == [False, True, False]
    assert res.truncated[1].tolist() == [True, False, False]
    assert not res.terminated[1].any() and not res.success[1] and res.reward[1].sum() == 0
    assert [a - b for a, b in zip(pool.restarts, restarts, strict=True)] == [0, 1, 0]
    assert pool.process(1).pid != old.pid and pool.process(1).is_alive()
    # the restarted env was reset to a new episode; stepping continues for everyone
    assert res.info["elapsed_steps"].tolist() == [5, 0, 5]
    res = env.chunk_step(torch.ones(3, 2, 1))
    assert not res.info["invalid"].any()
    assert res.info["elapsed_steps"].tolist() == [7, 2, 7]


def test_call_reports_crash_without_raising() -> None:
    pool = SubprocEnvs([CounterCore, CounterCore], name="counter")
    try:
        pool.call("reset", {0: (1,), 1: (1,)})
        os.kill(pool.process(0).pid, signal.SIGKILL)
        out = pool.call("step", {0: ([1.0], True), 1: ([1.0], True)})
        assert out[0] is CRASHED and out[1] is not CRASHED
    finally:
        pool.close()
    assert pool.process(0) is None and pool.process(1) is None


def test_several_envs_per_child_give_the_same_episodes() -> None:
    one, shared = (SubprocEnvs([CounterCore] * 5, name="counter", per_process=k) for k in (1, 2))
    try:
        pids = shared.call("pid", dict.fromkeys(range(5), ()))
        # envs 0-1, 2-3 and 4 live in three children
        assert [pids[0] == pids[1], pids[2] == pids[3], len(set(pids.values()))] == [
            True,
            True,
            3,
        ]
        assert shared.num_processes == 3 and one.num_processes == 5
        for pool in (one, shared):
            pool.call("reset", {i: (i,) for i in range(5)})
        steps = {i: ([float(i + 1)], True) for i in (0, 2, 3)}  # env 1 and 4 idle
        a, b = one.call("step", steps), shared.call("step", steps)
        assert set(b) == {0, 2, 3}
        for i in steps:  # x = reset id + action: 1, 5, 7
            assert a[i][0]["state"].tolist() == b[i][0]["state"].tolist() == [2 * i + 1.0]
    finally:
        one.close()
        shared.close()


def test_a_crashed_child_costs_all_its_envs_their_episode() -> None:
    pool = SubprocEnvs([CounterCore] * 4, name="counter", per_process=2)
    try:
        pool.call("reset", {i: (1,) for i in range(4)})
        old = pool.process(2)
        assert pool.process(3).pid == old.pid
        os.kill(old.pid, signal.SIGKILL)
        old.join(timeout=10)
        out = pool.call("step", {i: ([1.0], True) for i in (0, 1, 2)})  # env 3 idle
        assert out[2] is CRASHED and out[0] is not CRASHED and out[1] is not CRASHED
        assert pool.restarts == [0, 0, 1, 1]
        assert pool.process(2).pid != old.pid and pool.process(3).pid == pool.process(2).pid
        # env 3's child was replaced while it idled: it has no episode until it is reset
        again = pool.call("step", {i: ([1.0], True) for i in range(4)})
        assert again[3] is CRASHED and again[2] is not CRASHED  # the caller reset nothing yet
        assert again[2][0]["state"].tolist() == [1.0]  # a fresh core: x = 0 + 1
        pool.call("reset", {3: (4,)})
        assert pool.call("step", {3: ([1.0], True)})[3][0]["state"].tolist() == [5.0]
    finally:
        pool.close()


def test_a_core_error_names_its_env_in_a_shared_child() -> None:
    pool = SubprocEnvs([CounterCore] * 4, name="counter", per_process=2)
    try:
        with pytest.raises(EnvWorkerError, match=r"counter env 3 raised in boom\(\)"):
            pool.call("boom", {3: ()})
        assert pool.call("pid", {2: ()})[2] == pool.process(2).pid  # the child lives on
    finally:
        pool.close()


def test_close_terminates_children() -> None:
    pool = SubprocEnvs([CounterCore] * 2, name="counter")
    procs = [pool.process(i) for i in range(2)]
    pool.close()
    assert all(not p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="closed"):
        pool.call("pid", {0: ()})


def test_auto_simulation_follows_the_device_of_the_worker_that_builds_the_env():
    import torch

    from rlinf_vla.envs import env_config, for_device

    auto = env_config("maniskill", task="PickCube-v1", sim_backend="auto", num_envs=4)
    assert for_device(auto, torch.device("cuda", 0)).sim_backend == "gpu"
    assert for_device(auto, torch.device("cpu")).sim_backend == "cpu"
    assert auto.sim_backend == "auto"  # the caller's config is left as it was
    chosen = env_config("maniskill", sim_backend="cpu")
    assert for_device(chosen, torch.device("cuda", 0)) == chosen  # a choice is kept
    toy = env_config("toy", num_envs=2)
    assert for_device(toy, torch.device("cpu")) == toy  # other envs


# ------------------------------------------------------------------ pipeline stages
def _run_env_worker(
    envs: list[VectorEnv], chunks: int, turns: bool, rollouts: int = 1
) -> tuple[dict, list, list]:
    """An env worker's rollout of ``chunks`` chunk steps over ``envs`` (its stages), answered
    by ``rollouts`` threads that play the rollout workers (action 1 for every env, 2 steps a
    chunk), each over a channel of its own serving the stages the routing table gives it.
    Returns the stats, the observations the rollout received, and each chunk step's interval
    ``(stage, start, end)``."""
    from rlinf_vla.pipelines.rollout import EnvWorker, act_key, obs_key
    from rlinf_vla.pipelines.routing import Routing
    from rlinf_vla.runtime.local import LocalChannel

    worker = EnvWorker.__new__(EnvWorker)  # its state, without a Ray actor around it
    worker._ctx = types.SimpleNamespace(rank=0)
    worker.envs = envs
    worker.obs = [None] * len(envs)
    worker.episode_return = [torch.zeros(env.num_envs) for env in envs]
    worker.in_first_episode = [torch.zeros(env.num_envs, dtype=torch.bool) for env in envs]
    worker.expert = False
    intervals: list[tuple[int, float, float]] = []
    for s, env in enumerate(envs):
        step = env.chunk_step

        def timed(actions, expert=False, s=s, step=step):
            t0 = time.monotonic()
            out = step(actions, expert=expert)
            intervals.append((s, t0, time.monotonic()))
            return out

        env.chunk_step = timed
    routing = Routing.round_robin(1, len(envs), rollouts, 1)
    channels = [LocalChannel(f"stages-{w}") for w in range(rollouts)]
    received: list[list[float]] = [[] for _ in envs]

    def rollout(w: int) -> None:
        channel = channels[w]
        for t in range(chunks + 1):
            for _, s in routing.served_by(w)[0]:
                # a stage routed elsewhere never shows up here: the get would time out
                msg = channel.get(obs_key(0, s), timeout=60)
                received[s].append(msg.obs.state.flatten().tolist())
                if t < chunks:  # the last observation only ends the rollout
                    channel.put(act_key(0, s), torch.ones(envs[s].num_envs, 2, 1))

    threads = [threading.Thread(target=rollout, args=(w,)) for w in range(rollouts)]
    for thread in threads:
        thread.start()
    if turns:
        per_stage = [{k: [] for k in EnvWorker.STATS} for _ in envs]
        routed = [channels[routing.rollout_of((0, s))] for s in range(len(envs))]
        worker._take_turns(routed, chunks, per_stage)
        stats = {k: [v for st in per_stage for v in st[k]] for k in per_stage[0]}
    else:
        stats = worker.interact(channels if rollouts > 1 else channels[0], chunks, routing)
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    for channel in channels:  # every message was taken by the rollout it was meant for
        assert channel.sizes() == {}
    return stats, received, intervals


class _ScriptedStarts(CounterEnv):
    """Env 0's first episode starts at 0: 10 steps to success, so an 8-step limit ends it as
    a failure. Every other episode starts at 4 and succeeds after 6 steps."""

    def next_reset_ids(self, env_ids: torch.Tensor | None = None) -> torch.Tensor:
        if env_ids is None:
            env_ids = torch.arange(self.num_envs)
        first_of_env_0 = (env_ids == 0) & (self._episodes[env_ids] == 0)
        return torch.where(first_of_env_0, 0, 4)


def test_the_first_episode_of_each_env_is_counted_apart() -> None:
    """Two envs, 8 chunks of 2 steps (16 steps), an 8-step limit. Env 1 succeeds at steps 6
    and 12; env 0 fails at its limit (step 8), then succeeds at step 14. The rollout ends 4
    episodes, 3 of them successes (in the order they ended: chunks 3, 4, 6, 7), but only
    one of the two envs' first episodes succeeded. The next rollout starts fresh episodes."""
    env = _ScriptedStarts(EnvConfig(num_envs=2, max_episode_steps=8))
    try:
        stats, received, _ = _run_env_worker([env], chunks=8, turns=False)
        assert received[0][0] == [0.0, 4.0]  # the starts above
        assert stats["success"] == [1.0, 0.0, 1.0, 1.0]
        assert stats["first_success"] == [1.0, 0.0]
        # a second rollout: both envs start episodes at 4 and succeed at steps 6 and 12
        again, received, _ = _run_env_worker([env], chunks=8, turns=False)
        assert received[0][0] == [4.0, 4.0]
        assert again["success"] == [1.0] * 4
        assert again["first_success"] == [1.0, 1.0]
    finally:
        env.close()


def test_cpu_seconds_count_what_the_children_compute_not_what_they_sleep() -> None:
    pool = SubprocEnvs([CounterCore, CounterCore], name="counter")
    try:
        before = pool.cpu_seconds()
        pool.call("burn", {0: (0.3,), 1: (0.2,)})
        burnt = pool.cpu_seconds()
        pool.call("step", {0: (np.ones(1), False), 1: (np.ones(1), False)})  # no sleep
        time.sleep(0.3)  # the children wait for a command meanwhile
        idle = pool.cpu_seconds()
    finally:
        pool.close()
    assert before is not None and burnt is not None and idle is not None
    # /proc counts in clock ticks (10 ms): 0.5 s of computing, within a few ticks
    assert 0.45 <= burnt - before < 0.7
    assert idle - burnt < 0.05


@pytest.mark.parametrize("turns", [False, True])
def test_stages_routed_to_two_rollout_workers_talk_to_their_own_channels(turns: bool) -> None:
    """Two stages served by two rollout workers, each over the channel its process hosts:
    every stage's messages go to its rollout's channel alone (a stray one would leave the
    rollout threads waiting or a message behind), taking turns too (a stage's put and the
    next stage's get go to different channels), and the rollout sees what one channel sees."""
    cfg = EnvConfig(num_envs=2, max_episode_steps=20)
    runs = {}
    for rollouts in (1, 2):
        envs = [CounterEnv(cfg), CounterEnv(dataclasses.replace(cfg, env_offset=2))]
        try:
            runs[rollouts] = _run_env_worker(envs, chunks=6, turns=turns, rollouts=rollouts)
        finally:
            for env in envs:
                env.close()
    (one, one_received, _), (two, two_received, _) = runs[1], runs[2]
    assert two_received == one_received and len(two_received[1]) == 7
    assert sorted(two["success"]) == sorted(one["success"]) and two["success"]


def test_stages_in_subprocesses_step_at_the_same_time() -> None:
    """Two stages of slow subprocess simulators: their chunk steps overlap in time (one thread
    per stage), and every stage sees exactly what it sees when the stages take turns."""
    slow = functools.partial(CounterCore, step_time_s=0.05)
    cfg = EnvConfig(num_envs=2, max_episode_steps=20)
    runs = {}
    for turns in (False, True):
        envs = [CounterEnv(cfg, slow), CounterEnv(dataclasses.replace(cfg, env_offset=2), slow)]
        try:
            runs[turns] = _run_env_worker(envs, chunks=6, turns=turns)
        finally:
            for env in envs:
                env.close()
    (stats, received, intervals), (turns_stats, turns_received, turns_intervals) = (
        runs[False],
        runs[True],
    )
    overlapping = [
        (a, b)
        for a in intervals
        if a[0] == 0
        for b in intervals
        if b[0] == 1 and a[1] < b[2] and b[1] < a[2]
    ]
    assert len(intervals) == 12 and overlapping
    # taking turns, no two chunk steps overlap
    ordered = sorted(turns_intervals, key=lambda t: t[1])
    assert all(a[2] <= b[1] for a, b in itertools.pairwise(ordered))
    assert received == turns_received  # same observations per stage, in order
    assert sorted(stats["success"]) == sorted(turns_stats["success"])
    assert sorted(stats["return"]) == sorted(turns_stats["return"])
    assert len(stats["success"]) > 0  # episodes ended (counter reached 10)
    # each stage's seconds in its chunk steps: those the wrapper around chunk_step timed
    for s in (0, 1):
        timed = sum(end - start for stage, start, end in intervals if stage == s)
        assert timed <= stats["step_s"][s] < timed + 0.05
    assert len(stats["reset_s"]) == 2 and all(t > 0 for t in stats["reset_s"])
    # where each stage's seconds went: reset, chunk steps and channel calls are its whole wall
    # time but for the bookkeeping between them (milliseconds here)
    for s in (0, 1):
        parts = stats["reset_s"][s] + stats["step_s"][s] + stats["wait_s"][s]
        assert stats["wait_s"][s] > 0
        assert parts <= stats["wall_s"][s] < parts + 0.05
    # taking turns, the stages share one clock, and one stage waits while the other steps
    assert turns_stats["wall_s"][0] == turns_stats["wall_s"][1]
    together = sum(turns_stats[k][s] for k in ("reset_s", "step_s", "wait_s") for s in (0, 1))
    assert together <= turns_stats["wall_s"][0] < together + 0.05
