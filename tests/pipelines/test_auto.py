"""placement=auto: the cost model against hand computations, and a profiled run."""

import json

import pytest
import yaml

from rlinf_vla import cli
from rlinf_vla.config import ConfigError
from rlinf_vla.pipelines.auto import (
    Costs,
    _update_cost,
    candidate_plans,
    choose,
    stage_batches,
)
from rlinf_vla.policies import make_policy
from tests.policies.conftest import make_obs


def _by_key(plans):
    return {(p.mode, p.components["env"], p.components["rollout"], p.stages): p for p in plans}


def test_estimates_match_the_formulas_by_hand():
    # e = 0.3 s, i = 0.1 s per chunk for the whole batch, u = 2 s; o = 0.01 s; T = 10 chunks
    costs = Costs(env_chunk_s=0.3, infer_chunk_s=0.1, train_s=2.0, overhead_s=0.01)
    plans = _by_key(candidate_plans(costs, num_devices=3, num_groups=12, chunks=10, max_stages=4))
    # collocated: each device steps a third of the envs and infers on them, and the two
    # halves of a chunk step meet over the channel (o)
    col = plans[("collocated", "all", "all", 1)]
    assert col.rollout_s == pytest.approx(10 * (0.4 / 3 + 0.01))
    assert col.train_s == pytest.approx(2 / 3)
    # collocated in stages: each device's env worker (a = 0.1) steps one stage while its
    # rollout worker computes another (S calls a chunk step, b = 0.1 / 3 in all), S round trips
    c2 = plans[("collocated", "all", "all", 2)]
    assert c2.rollout_s == pytest.approx(10 * (0.1 + 2 * 0.01) + (0.1 / 3) / 2)
    c4 = plans[("collocated", "all", "all", 4)]
    assert c4.rollout_s == pytest.approx(10 * (0.1 + 4 * 0.01) + (0.1 / 3) / 4)
    assert c4.train_s == pytest.approx(2 / 3)
    # hybrid, env on 2 devices (a = 0.15), rollout on 1 (b = 0.1)
    h1 = plans[("hybrid", "0-1", "2", 1)]
    assert h1.rollout_s == pytest.approx(10 * (0.15 + 0.1 + 0.01))
    # 2 trajectories per iteration cannot be shared by 3 actors: the actor takes 2 devices
    assert h1.components["actor"] == "0-1" and h1.train_s == pytest.approx(2.0 / 2)
    h2 = plans[("hybrid", "0-1", "2", 2)]
    assert h2.rollout_s == pytest.approx(10 * (0.15 + 2 * 0.01) + 0.1 / 2)
    # 12 groups over 2 env devices x 4 stages do not split: no such plan
    assert ("hybrid", "0-1", "2", 4) not in plans
    # env on 1 device (a = 0.3), rollout on 2 (b = 0.05), 4 stages
    h4 = plans[("hybrid", "0", "1-2", 4)]
    assert h4.rollout_s == pytest.approx(10 * (0.3 + 4 * 0.01) + 0.05 / 4)
    dis = plans[("disaggregated", "0", "1", 1)]
    assert dis.components["actor"] == "2"
    assert dis.rollout_s == pytest.approx(10 * (0.3 + 0.1 + 0.01))
    assert dis.train_s == pytest.approx(2.0)
    # local: one process on device 0; S=1 is the plain loop, S >= 2 overlaps stages without
    # channel hops (b = 0.1 per chunk step however the batch is cut: no fixed cost here)
    assert plans[("local", "0", "0", 1)].rollout_s == pytest.approx(10 * (0.3 + 0.1))
    assert plans[("local", "0", "0", 2)].rollout_s == pytest.approx(10 * 0.3 + 0.1 / 2)
    assert plans[("local", "0", "0", 4)].rollout_s == pytest.approx(10 * 0.3 + 0.1 / 4)
    assert plans[("local", "0", "0", 2)].train_s == pytest.approx(2.0)


def test_a_fixed_cost_per_call_is_paid_by_every_stage():
    # i = 0.2 s for the whole batch, of which f = 0.1 s per call whatever its batch
    costs = Costs(0.2, 0.2, 1.0, overhead_s=0.0, infer_fixed_s=0.1)
    plans = _by_key(candidate_plans(costs, num_devices=2, num_groups=8, chunks=10, max_stages=4))
    # collocated: each device steps half the envs (0.1) and makes one call on them
    # (0.1 + 0.1 / 2)
    assert plans[("collocated", "all", "all", 1)].rollout_s == pytest.approx(10 * 0.25)
    # hybrid S=2: the rollout device makes 2 calls on half the batch each,
    # 2 * (0.1 + 0.1 / 2) = 0.3 per chunk step against the env's 0.2
    h2 = plans[("hybrid", "0", "1", 2)]
    assert h2.rollout_s == pytest.approx(10 * 0.3 + 0.2 / 2)
    # S=4: 4 * (0.1 + 0.1 / 4) = 0.5 per chunk step: more stages cost more
    h4 = plans[("hybrid", "0", "1", 4)]
    assert h4.rollout_s == pytest.approx(10 * 0.5 + 0.2 / 4)
    # local S=2 pays the fixed cost twice too, and trains on one device: 10 * 0.3 + 0.1 + 1
    assert plans[("local", "0", "0", 2)].iteration_s == pytest.approx(4.1)
    assert choose(list(plans.values())).mode == "collocated"


def test_a_measured_call_on_a_stage_batch_replaces_the_affine_cost():
    # i = 0.2 s for the whole batch, no fixed cost by the affine model; measured: a call on
    # half the batch 0.15 s, on a quarter 0.1 s
    costs = Costs(0.2, 0.2, 1.0, overhead_s=0.0, infer_call_s=((2, 0.15), (4, 0.1)))
    plans = _by_key(candidate_plans(costs, num_devices=2, num_groups=8, chunks=10, max_stages=4))
    # collocated: each device steps half the envs (0.1) and makes one call on half (0.15)
    assert plans[("collocated", "all", "all", 1)].rollout_s == pytest.approx(10 * 0.25)
    # collocated S=2: 4 stage batches, 2 calls on a quarter each per device: 0.2 against 0.1
    assert plans[("collocated", "all", "all", 2)].rollout_s == pytest.approx(10 * 0.2 + 0.1 / 2)
    # hybrid S=2: 2 calls on half the batch, 0.3 against the env's 0.2
    assert plans[("hybrid", "0", "1", 2)].rollout_s == pytest.approx(10 * 0.3 + 0.2 / 2)
    # local S=4: 4 calls on a quarter, 0.4 against 0.2
    assert plans[("local", "0", "0", 4)].rollout_s == pytest.approx(10 * 0.4 + 0.2 / 4)
    # hybrid S=4 cuts the batch into 4 too; collocated S=4 into 8, not measured: affine, f = 0
    assert plans[("hybrid", "0", "1", 4)].rollout_s == pytest.approx(10 * 0.4 + 0.2 / 4)
    assert plans[("collocated", "all", "all", 4)].rollout_s == pytest.approx(
        10 * max(0.1, 4 * 0.2 / 8) + 0.1 / 4
    )


def test_a_measured_staged_step_and_calls_at_once_replace_the_model():
    # e = i = 0.2 s; a call on half the batch 0.15 s, on a quarter 0.1 s. Measured on the
    # node: 2 stages in one process 0.36 s a chunk step (1.2x their max(e, b) = 0.3), and two
    # calls on half the batch made at once 0.225 s each (1.5x one alone)
    costs = Costs(
        0.2,
        0.2,
        1.0,
        overhead_s=0.0,
        infer_call_s=((2, 0.15), (4, 0.1)),
        staged_step_s=((2, 0.36),),
        infer_parallel_s=((2, 0.225),),
    )
    plans = _by_key(candidate_plans(costs, num_devices=2, num_groups=8, chunks=10, max_stages=4))
    # local S=2: b = 2 x 0.15 = 0.3, step max(0.2, 0.3) x 1.2 = 0.36, tail min / 2 = 0.1
    assert plans[("local", "0", "0", 2)].rollout_s == pytest.approx(10 * 0.36 + 0.1)
    # hybrid S=2 (one rollout worker): the same ratio on the same batches
    assert plans[("hybrid", "0", "1", 2)].rollout_s == pytest.approx(10 * 0.36 + 0.1)
    # collocated S=1: two rollout workers call at once, each 0.15 x 1.5; the env 0.2 / 2
    assert plans[("collocated", "all", "all", 1)].rollout_s == pytest.approx(10 * (0.1 + 0.225))
    # collocated S=2: 4 batches, 2 calls of 0.1 a worker, x 1.5; 4 stages unmeasured: max
    assert plans[("collocated", "all", "all", 2)].rollout_s == pytest.approx(10 * 0.3 + 0.1 / 2)
    # local S=4: not measured, the model's max(e, b)
    assert plans[("local", "0", "0", 4)].rollout_s == pytest.approx(10 * 0.4 + 0.2 / 4)
    # a measured step shorter than the model's max, or calls at once faster than one alone,
    # never shorten the estimate
    fast = Costs(
        0.2,
        0.2,
        1.0,
        overhead_s=0.0,
        infer_call_s=((2, 0.15),),
        staged_step_s=((2, 0.2),),
        infer_parallel_s=((2, 0.1),),
    )
    plans = _by_key(candidate_plans(fast, num_devices=2, num_groups=8, chunks=10, max_stages=2))
    assert plans[("local", "0", "0", 2)].rollout_s == pytest.approx(10 * 0.3 + 0.1)
    assert plans[("collocated", "all", "all", 1)].rollout_s == pytest.approx(10 * (0.1 + 0.15))


def test_the_stage_batches_profiled_are_those_the_plans_cut():
    # 2 devices, up to 4 stages: E * S in {1, 2, 4} x {1, 2}
    assert stage_batches(2, 8, 4) == (2, 4, 8)
    # 6 groups: only halves are whole groups
    assert stage_batches(2, 6, 4) == (2,)
    # 3 devices: E * S for E in 1..3, S in 1, 2, 4, dividing 12
    assert stage_batches(3, 12, 4) == (2, 3, 4, 6, 12)
    assert stage_batches(1, 4, 1) == ()


def test_choice_prefers_overlap_when_env_and_inference_are_balanced():
    # With a fixed per-message overhead and no data parallel gain for the actor (one device
    # each), the best plan overlaps env and inference in stages.
    costs = Costs(env_chunk_s=0.2, infer_chunk_s=0.2, train_s=0.1, overhead_s=0.001)
    plans = candidate_plans(costs, num_devices=2, num_groups=4, chunks=20)
    best = choose(plans)
    # collocated S=2: each device steps a stage of a quarter of the envs (0.05 s per stage,
    # 0.1 s a chunk step) while its rollout worker infers on the other (0.1 s): 20 * (0.1 +
    # 2 * 0.001) + 0.1 / 2 = 2.09 s; collocated S=1 20 * (0.2 + 0.001) = 4.02 s; hybrid S=4
    # 20 * (0.2 + 0.004) + 0.2 / 4 = 4.13 s
    assert (best.mode, best.stages) == ("collocated", 2)
    assert best.rollout_s == pytest.approx(2.09)
    costs = Costs(env_chunk_s=0.2, infer_chunk_s=0.05, train_s=0.1, overhead_s=0.0)
    # one device: collocated and local fit; in stages both overlap the slow env with
    # inference (20 * 0.2 + 0.05 / 2 + 0.1 = 4.125 s against 20 * 0.25 + 0.1 = 5.1 s; S=4 is
    # 1 % faster still), and of the plans within 2 % the one process wins
    one = candidate_plans(costs, 1, 4, 20)
    assert [(p.mode, p.stages) for p in one] == [
        ("collocated", 1),
        ("collocated", 2),
        ("collocated", 4),
        ("local", 1),
        ("local", 2),
        ("local", 4),
    ]
    by = {(p.mode, p.stages): p for p in one}
    assert by[("collocated", 2)].rollout_s == pytest.approx(20 * 0.2 + 0.05 / 2)
    assert by[("local", 2)].rollout_s == pytest.approx(20 * 0.2 + 0.05 / 2)
    assert (choose(one).mode, choose(one).stages) == ("local", 2)


def test_resets_bootstrap_values_and_subprocess_simulators_by_hand():
    # e = 0.3 s per chunk step, i = 0.1 s, r = 0.5 s reset, v = 0.04 s of bootstrap values,
    # o = 0.01 s, T = 10 chunk steps, 2 devices
    base = {"overhead_s": 0.01, "reset_s": 0.5, "value_s": 0.04}
    inside = _by_key(candidate_plans(Costs(0.3, 0.1, 1.0, **base), 2, 4, 10, max_stages=2))
    # an env that computes in its worker splits its steps and its reset over the env devices
    col = inside[("collocated", "all", "all", 1)]
    assert col.rollout_s == pytest.approx(0.5 / 2 + 10 * (0.15 + 0.05 + 0.01) + 0.04 / 2)
    assert inside[("local", "0", "0", 1)].rollout_s == pytest.approx(0.5 + 10 * 0.4 + 0.04)
    # simulators in subprocesses step in parallel already: more env workers change nothing
    sub = Costs(0.3, 0.1, 1.0, subprocess_env=True, **base)
    plans = _by_key(candidate_plans(sub, 2, 4, 10, max_stages=2))
    col = plans[("collocated", "all", "all", 1)]
    assert col.rollout_s == pytest.approx(0.5 + 10 * (0.3 + 0.05 + 0.01) + 0.04 / 2)
    h2 = plans[("hybrid", "0", "1", 2)]
    assert h2.rollout_s == pytest.approx(0.5 + 10 * (0.3 + 2 * 0.01) + 0.1 / 2 + 0.04)


def test_simulators_and_cpu_inference_share_the_cores():
    # 4 simulator processes use 0.2 CPU seconds per chunk step (e = 0.1 s on 2 cores) and the
    # policy 0.08 s on one thread: overlapped in one process they could take max(0.1, 0.08),
    # but the 2 cores hold (0.2 + 0.08) / 2 = 0.14 s of work per chunk step
    costs = Costs(
        0.1, 0.08, 1.0, overhead_s=0.0, subprocess_env=True, env_cpu_s=0.2, cores=2, threads=1
    )
    plans = _by_key(candidate_plans(costs, 1, 4, 10, max_stages=2))
    assert plans[("local", "0", "0", 2)].rollout_s == pytest.approx(10 * 0.14 + 0.08 / 2)
    # the plain loop is no shorter than its work: 0.1 + 0.08 > 0.14
    assert plans[("local", "0", "0", 1)].rollout_s == pytest.approx(10 * 0.18)
    # without a measured CPU share there is no bound
    free = Costs(0.1, 0.08, 1.0, overhead_s=0.0, subprocess_env=True)
    free_plans = _by_key(candidate_plans(free, 1, 4, 10, max_stages=2))
    assert free_plans[("local", "0", "0", 2)].rollout_s == pytest.approx(10 * 0.1 + 0.08 / 2)


def test_only_plans_that_split_whole_groups_are_considered():
    # one GRPO group cannot be split over two collocated env workers or two stages
    plans = candidate_plans(Costs(1, 1, 1), num_devices=2, num_groups=1, chunks=1)
    assert [(p.mode, p.stages) for p in plans] == [("local", 1), ("hybrid", 1)]
    with pytest.raises(ConfigError, match="no placement splits the env batch"):
        choose([])


@pytest.mark.slow
@pytest.mark.ray
def test_auto_profiles_prints_its_choice_and_trains(tmp_path, capsys, monkeypatch):
    """The profile runs in a worker on device 0: the driver (this process) builds no policy,
    so it holds no model and, on a GPU machine, no CUDA context while the run trains."""
    import rlinf_vla.policies

    def no_policy_here(*args, **kwargs):
        raise AssertionError("the driver built a policy")

    monkeypatch.setattr(rlinf_vla.policies, "make_policy", no_policy_here)
    args = [
        "train",
        "env=toy",
        "env.num_envs=4",
        "env.max_episode_steps=8",
        "+env.step_time_s=0.02",
        "runner.rollout_chunks=4",
        "algo.update_epochs=1",
        "placement=auto",
        "cluster.devices_per_node=2",
        "runner.max_iterations=1",
        f"runner.output_dir={tmp_path}",
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "placement=auto: profiling" in out and "on device cpu:0@node0" in out
    # a CPU node: the staged chunk steps and two rollout workers' calls at once measured
    assert "a staged chunk step in one process: 2 stages" in out
    assert "calls at once: 2 x 2 envs" in out
    assert "<- chosen" in out
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["placement"]
    assert saved["mode"] in ("collocated", "hybrid", "disaggregated", "local")
    assert saved["mode"] in out.split("<- chosen")[0].splitlines()[-1]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1]


def test_the_profiled_update_takes_the_path_the_actor_takes():
    """With the feature cache, the update is profiled as the actor runs it: the frozen features
    once, then the read-out alone; a whole-model policy pays the whole ``evaluate``."""
    obs = make_obs(2)
    readout = make_policy(
        "openvla", preset="tiny", chunk_size=2, seed=0, lora_rank=4, lora_target_modules=".*lm_head"
    )
    replay = readout.act(obs).replay

    def whole_pass(*args):
        raise AssertionError("the cached path must not run the whole evaluate")

    readout.evaluate = whole_pass
    once, per_pass = _update_cost(readout, obs, replay, cache=True)
    assert once > 0 and per_pass > 0
    # Features the rollout sent (OpenVLA computes them while acting): no frozen pass at all.
    shipped = readout.frozen_features(obs, replay)

    def frozen_pass(*args):
        raise AssertionError("the frozen pass ran although acting computed the features")

    readout.frozen_features = frozen_pass
    once, per_pass = _update_cost(readout, obs, replay, cache=True, shipped=shipped)
    assert once == 0.0 and per_pass > 0
    full = make_policy("openvla", preset="tiny", chunk_size=2, seed=0)
    calls = []
    full.evaluate_features = lambda *args: calls.append(args)
    once, per_pass = _update_cost(full, obs, full.act(obs).replay, cache=True)
    assert once == 0.0 and per_pass > 0 and not calls
    with pytest.raises(AssertionError, match="whole evaluate"):
        _update_cost(readout, obs, replay, cache=False)  # the cache off: the whole pass


@pytest.mark.parametrize(("devices", "paths"), [(1, {True}), (2, {True, False})])
def test_fsdp_profiles_the_cache_only_where_the_actor_cannot_shard(monkeypatch, devices, paths):
    """``algo.fsdp`` shards only over several actor workers: on one device the actor keeps the
    feature cache, and the profiled update must too; on several, a plan with one actor device
    keeps it and the others shard, so both updates are profiled and each plan gets its own."""
    from rlinf_vla.pipelines import auto
    from rlinf_vla.pipelines.config import validate

    seen = []

    def update_cost(policy, obs, replay, cache, shipped=None, *clock_and_precision):
        seen.append(cache)
        return 0.0, 0.01 if cache else 0.05  # the whole pass costs 5x the read-out

    monkeypatch.setattr(auto, "_update_cost", update_cost)
    job = validate(
        cli.compose(
            "train",
            [
                "env=toy",
                "env.num_envs=4",
                "runner.rollout_chunks=2",
                "placement=auto",
                "algo.fsdp=true",
                "algo.cache_frozen_features=true",
                "algo.update_epochs=2",
            ],
        )
    )
    costs = auto.profile(job, 1, sharded=devices > 1)
    assert seen and set(seen) == paths
    # u = (once + per_pass * epochs) * rollout_chunks = 0.01 * 2 * 2 (cached), 0.05 * 2 * 2
    assert costs.train_s == pytest.approx(0.04)
    if devices == 1:
        assert costs.train_sharded_s is None
    else:
        assert costs.train_sharded_s == pytest.approx(0.2)


def test_each_plan_is_charged_the_update_its_actor_runs():
    # u = 1 s on one actor device (feature cache), 3 s on one device as FSDP runs it
    costs = Costs(0.3, 0.1, 1.0, overhead_s=0.01, train_sharded_s=3.0)
    plans = _by_key(candidate_plans(costs, num_devices=3, num_groups=12, chunks=10, max_stages=4))
    assert plans[("collocated", "all", "all", 1)].train_s == pytest.approx(3.0 / 3)
    h1 = plans[("hybrid", "0-1", "2", 1)]  # 2 trajectories: the actor on 2 devices, sharded
    assert h1.components["actor"] == "0-1" and h1.train_s == pytest.approx(3.0 / 2)
    h = plans[("hybrid", "0", "1-2", 1)]  # 1 trajectory: one actor device, cache on
    assert h.components["actor"] == "0" and h.train_s == pytest.approx(1.0)
    assert plans[("disaggregated", "0", "1", 1)].train_s == pytest.approx(1.0)
    assert Costs(0.3, 0.1, 1.0).update_s(2) == pytest.approx(0.5)  # no FSDP: one update cost


@pytest.mark.gpu
@pytest.mark.ray
def test_auto_profiles_on_the_gpu_its_workers_use(tmp_path, capsys):
    """On a GPU machine the profile measures on GPU 0 (synchronised timing, ``algo.autocast``),
    where the rollout and actor will run; one GPU leaves collocated as the only plan."""
    args = [
        "train",
        "env=toy",
        "env.num_envs=8",
        "env.max_episode_steps=8",
        "runner.rollout_chunks=2",
        "algo.update_epochs=1",
        "placement=auto",
        "cluster.devices_per_node=1",
        "runner.max_iterations=1",
        "runner.eval_interval=0",
        f"runner.output_dir={tmp_path}",
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "on device cuda:0@node0" in out
    measured = out.split("measured on one device:")[1].splitlines()[0]
    assert "inference" in measured and "update" in measured
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["placement"]["mode"] == (
        "collocated"
    )


def _toy_job(*extra):
    from rlinf_vla.pipelines.config import validate

    return validate(
        cli.compose(
            "train",
            ["env=toy", "env.num_envs=4", "runner.rollout_chunks=2", "placement=auto", *extra],
        )
    )


def test_the_profile_measures_resets_bootstrap_values_and_the_simulators_cpu(monkeypatch):
    """Besides ``e``, ``i`` and ``u``: the reset, the bootstrap values, and the simulators' CPU
    seconds per chunk step read around the timed chunk steps only."""
    import rlinf_vla.envs
    from rlinf_vla.pipelines import auto

    make_env = rlinf_vla.envs.make_env

    class Pool:  # the simulators' CPU clock: 0.3 s more at every reading
        seconds = 1.0

        def cpu_seconds(self):
            self.seconds += 0.3
            return self.seconds

    pool = Pool()

    def env_with_pool(*args, **kwargs):
        env = make_env(*args, **kwargs)
        monkeypatch.setattr(type(env), "workers", property(lambda self: pool), raising=False)
        return env

    monkeypatch.setattr(rlinf_vla.envs, "make_env", env_with_pool)
    costs = auto.profile(_toy_job(), 2, threads=1, cores=2)
    assert costs.reset_s > 0 and costs.value_s > 0
    assert costs.subprocess_env and costs.cores == 2 and costs.threads == 1
    # read before and after the 2 timed chunk steps: 0.3 s of CPU over 2 chunk steps
    assert costs.env_cpu_s == pytest.approx(0.15)
    # without the node's cores the CPU share is not measured
    assert auto.profile(_toy_job(), 1, threads=1).env_cpu_s is None


def test_the_profile_times_a_call_on_each_stage_batch(monkeypatch):
    """A call on ``B / P`` envs is timed for each ``P`` asked for that divides ``B``; ``f`` is
    read off the whole batch and the smallest stage batch. The policy's call here sleeps
    20 ms + 5 ms per env (its outputs are those of one real call)."""
    import time

    from rlinf_vla.pipelines import auto

    real = auto._rollout_call

    def sleeping_call(policy, cache, precision):
        act = real(policy, cache, precision)
        first = {}

        def call(obs):
            if not first:
                first["out"] = act(obs)
            time.sleep(0.02 + 0.005 * obs.batch_size)
            return first["out"]

        return call

    monkeypatch.setattr(auto, "_rollout_call", sleeping_call)
    costs = auto.profile(_toy_job(), 2, threads=1, batches=(2, 3, 4))
    assert costs.infer_chunk_s == pytest.approx(0.04, rel=0.15)
    assert [p for p, _ in costs.infer_call_s] == [2, 4]  # 3 does not divide 4 envs
    calls = dict(costs.infer_call_s)
    assert calls[2] == pytest.approx(0.03, rel=0.15)
    assert calls[4] == pytest.approx(0.025, rel=0.15)
    # f + (i - f) / 4 = 0.025 with i = 0.04: f = 0.02
    assert costs.infer_fixed_s == pytest.approx(0.02, abs=0.004)
    assert costs.rollout_busy_s(4, 1) == pytest.approx(4 * calls[4])


def test_the_profile_times_the_staged_schedule(monkeypatch):
    """On a CPU node the profile also times ``P`` stages stepped as ``placement=local`` steps
    them. The policy's call sleeps 20 ms + 5 ms per env and the toy env barely computes, so
    the one thread that infers is the bottleneck: a staged chunk step is ``P`` calls on
    ``B / P`` envs (2 x 30 ms, 4 x 25 ms)."""
    import time

    from rlinf_vla.pipelines import auto

    real = auto._rollout_call

    def sleeping_call(policy, cache, precision):
        act = real(policy, cache, precision)
        first = {}  # one real call per batch size

        def call(obs):
            if obs.batch_size not in first:
                first[obs.batch_size] = act(obs)
            time.sleep(0.02 + 0.005 * obs.batch_size)
            return first[obs.batch_size]

        return call

    monkeypatch.setattr(auto, "_rollout_call", sleeping_call)
    costs = auto.profile(_toy_job(), 2, threads=1, cores=2, batches=(2, 4), staged=(2, 3, 4))
    staged = dict(costs.staged_step_s)
    assert sorted(staged) == [2, 4]  # 3 stages do not split 4 envs
    assert staged[2] == pytest.approx(0.06, rel=0.25)
    assert staged[4] == pytest.approx(0.1, rel=0.25)
    # not asked for: nothing measured, and the plans keep the model
    assert auto.profile(_toy_job(), 1, threads=1).staged_step_s == ()


@pytest.mark.ray
def test_calls_at_once_are_made_together_by_workers_of_their_own():
    """``R`` rollout workers' calls made at once are timed in ``R`` worker processes (as a
    run's rollout workers are: no interpreter lock shared), each with the policy on its
    ``B / R`` envs, all starting at one wall-clock time so that their calls overlap."""
    import time

    from rlinf_vla.envs import make_env
    from rlinf_vla.pipelines import auto
    from rlinf_vla.pipelines.rollout import EnvMessage
    from rlinf_vla.runtime import Cluster
    from rlinf_vla.runtime.worker import WorkerGroup

    job = _toy_job()
    env = make_env(job.env_name, job.env_config)
    try:
        message = EnvMessage(obs=env.reset())
    finally:
        env.close()
    with Cluster(num_cpus=2) as cluster:
        group = WorkerGroup(cluster, auto.Profiler, name="calls", devices=[0, 1])
        try:
            assert group.prepare_calls(job, message).wait() == [2, 2]  # 4 envs over 2
            start = time.time() + 1.0
            (m0, s0, e0), (m1, s1, e1) = group.calls_at(start, 3).wait()
        finally:
            group.shutdown()
        assert min(s0, s1) >= start - 0.01  # both waited for the start
        assert max(s0, s1) < min(e0, e1)  # and their calls ran at the same time
        assert 0 < m0 < e0 - s0 and 0 < m1 < e1 - s1
        got = auto._calls_at_once(job, cluster, message, [0, 1], [2], reps=3)
        assert list(got) == [2] and got[2] > 0


@pytest.mark.ray
def test_a_channel_round_trip_is_timed_as_a_run_makes_it():
    """``o`` is one exchange carrying the profiled observation to the profiling worker, which
    hosts the channel as a run's rollout worker does and answers with the profiled actions;
    every request is answered."""
    from rlinf_vla.pipelines import auto
    from rlinf_vla.runtime import Cluster
    from rlinf_vla.runtime.worker import WorkerGroup

    with Cluster(num_cpus=2) as cluster:
        group = WorkerGroup(cluster, auto.Profiler, name="profile", devices=[0], channels=True)
        try:
            costs = group.costs(_toy_job(), 1, False).wait()[0]
            assert costs.overhead_s == auto.CHANNEL_ROUND_TRIP_S  # the driver times it
            assert group.sample().wait()[0].obs.batch_size == 4  # the toy job's 4 envs
            # (it raises unless the profiler answered every request)
            assert 0 < auto._round_trip_s(group, reps=2) < 2.0
        finally:
            group.shutdown()


def test_the_cores_the_simulators_share_are_the_cpu_slots_threads(monkeypatch):
    from rlinf_vla.pipelines.auto import node_cores
    from rlinf_vla.runtime import ClusterConfig
    from rlinf_vla.runtime.local import LocalCluster

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for slots in (1, 2, 4):
        assert node_cores(LocalCluster(ClusterConfig(devices_per_node=slots, num_cpus=4))) == 4
