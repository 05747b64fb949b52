"""`rlinf-vla train` end to end on the toy env with the tiny OpenVLA."""

import json
import re
import time

import pytest
import torch

from rlinf_vla import cli, provenance

REQUIRED = {
    "iteration",
    "env_steps",
    "env/success_rate",
    "env/first_episode_success_rate",
    "env/episode_return",
    "train/policy_loss",
    "train/value_loss",
    "train/entropy",
    "train/clip_fraction",
    "time/rollout_s",
    "time/env_reset_s",
    "time/env_step_s",
    "time/train_s",
    "throughput/env_steps_per_s",
}
SMALL = [
    "env=toy",
    "policy.chunk_size=2",
    "env.num_envs=4",
    "env.max_episode_steps=8",
    "runner.rollout_chunks=4",
    "algo.update_epochs=1",
]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_breakdown_adds_up(row):
    """The rollout's time, as its workers clocked it: the env worker's critical path is its
    reset, chunk steps and channel calls (and milliseconds of bookkeeping); the rollout is that
    path plus the trajectories' hand-off after it and the calls' dispatch."""
    env = (row[f"time/rollout/env_{k}_s"] for k in ("reset", "sim", "wait"))
    parts = sum(env)
    assert 0 < parts <= row["time/rollout/env_wall_s"] <= parts + 0.05
    path = row["time/rollout/env_wall_s"] + row["time/rollout/finish_s"]
    # the dispatch: a quarter second, more on a loaded machine (seen: 0.25 s over a 1.8 s path
    # beside another test's training)
    assert path <= row["time/rollout_s"] <= 1.1 * path + 0.25
    # both sides clocked their part: the policy's compute and the env's waits
    assert row["time/rollout/policy_s"] > 0 and row["time/rollout/env_wait_s"] > 0


def _assert_same_steps(rows_a, rows_b):
    """Two runs took the same rollouts and optimizer steps, up to float rounding."""
    for a, b in zip(rows_a, rows_b, strict=True):
        for key in (
            "env/episode_return",
            "train/policy_loss",
            "train/value_loss",
            "train/grad_norm",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize(
    "placement",
    [
        ["placement=collocated", "cluster.devices_per_node=1"],
        ["placement=hybrid", "cluster.devices_per_node=2"],
        ["placement=disaggregated", "cluster.devices_per_node=3"],
        ["placement=local", "cluster.devices_per_node=1"],
    ],
    ids=["collocated", "hybrid", "disaggregated", "local"],
)
@pytest.mark.ray
def test_two_iterations_in_each_mode(tmp_path, placement):
    assert (
        cli.main(
            [
                "train",
                *placement,
                *SMALL,
                "runner.max_iterations=2",
                "runner.eval_interval=2",
                "runner.eval_episodes=3",
                f"runner.output_dir={tmp_path}",
            ]
        )
        == 0
    )
    rows = _metrics(tmp_path)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert set(rows[0]) >= REQUIRED
    # greedy evaluation at iteration 2 only: 3 episodes in rounds of 3 envs -> one video
    assert "eval/success_rate" not in rows[0]
    assert rows[1]["eval/episodes"] == 3
    assert 0.0 <= rows[1]["eval/success_rate"] <= 1.0
    assert len(list((tmp_path / "videos" / "iter_2").glob("*.mp4"))) == 1
    # 4 envs x 4 chunks x 2 steps per chunk per iteration
    assert [r["env_steps"] for r in rows] == [32, 64]
    for r in rows:  # the simulators' part of the rollout
        assert 0 < r["time/env_reset_s"] + r["time/env_step_s"] < r["time/rollout_s"]
        _assert_breakdown_adds_up(r)
    ckpt = tmp_path / "checkpoints" / "iter_2"
    assert (ckpt / "COMPLETE").exists()
    assert (ckpt / "policy").is_dir()
    assert (tmp_path / "config.yaml").exists()


@pytest.mark.ray
def test_a_run_gets_the_env_and_policy_class_defaults(tmp_path):
    """Nothing set on the command line: the workers build the toy env's 8 envs and OpenVLA's
    one action per call, as ``--cfg job`` shows them."""
    args = ["env=toy", "cluster.devices_per_node=1", "runner.rollout_chunks=2"]
    args += ["algo.update_epochs=1", "runner.eval_interval=0", "runner.max_iterations=1"]
    assert cli.main(["train", *args, f"runner.output_dir={tmp_path}"]) == 0
    [row] = _metrics(tmp_path)
    assert row["env_steps"] == 8 * 2 * 1  # 8 envs x 2 chunks x 1 step


@pytest.mark.slow
@pytest.mark.ray
def test_grpo_two_iterations(tmp_path, capsys):
    args = [
        "algo=grpo",
        "algo.group_size=2",
        "env.group_size=2",
        "cluster.devices_per_node=1",
        *SMALL,
    ]
    assert (
        cli.main(["train", *args, "runner.max_iterations=2", f"runner.output_dir={tmp_path}"]) == 0
    )
    rows = _metrics(tmp_path)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert "train/value_loss" not in rows[0]  # GRPO has no critic
    for group in ("env", "rollout", "actor"):  # each worker holds at least its Python and torch
        assert 0.1 < rows[0][f"memory/{group}_rss_gib"] < 24, group
    # three processes of one rank each (collocated on Ray): the total is their sum
    groups = sum(rows[0][f"memory/{g}_rss_gib"] for g in ("env", "rollout", "actor"))
    assert rows[0]["memory/total_rss_gib"] == pytest.approx(groups)
    # The header says what ran: the tiny OpenVLA's parameters counted here independently.
    from rlinf_vla.policies import make_policy
    from rlinf_vla.run.loop import count_text

    params = sum(p.numel() for p in make_policy("openvla", preset="tiny").parameters())
    err = capsys.readouterr().err
    assert "rlinf-vla train: grpo on toy, 4 envs, 4 chunks of 2 steps per iteration" in err
    # each iteration's line ends with what the workers hold (read after its update)
    total = rows[1]["memory/total_rss_gib"]
    assert re.search(rf"iter 2/2 .* env steps/s  success \S+  {total:.1f} GiB", err), err
    assert f"policy openvla (preset tiny, random weights): {count_text(params)} parameters" in err
    assert "placement collocated: env 0, rollout 0, actor 0 on 1 cpu slot" in err
    # Envs reset every rollout: each of the 4 envs ends exactly one 8-step episode in 4 chunks of 2.
    assert all(r["env/episodes"] == 4 for r in rows)
    # ... each its env's first of the rollout: the two success rates are one
    assert all(r["env/first_episodes"] == 4 for r in rows)
    assert all(r["env/first_episode_success_rate"] == r["env/success_rate"] for r in rows)


@pytest.mark.slow
@pytest.mark.ray
def test_resumed_run_matches_uninterrupted_run(tmp_path):
    common = ["cluster.devices_per_node=1", *SMALL, "runner.save_interval=2", "runner.seed=3"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli.main(["train", *common, "runner.max_iterations=4", f"runner.output_dir={full}"]) == 0
    assert cli.main(["train", *common, "runner.max_iterations=2", f"runner.output_dir={part}"]) == 0
    # A crash after logging iteration 3 but before its checkpoint: that row must be replaced.
    with (part / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"iteration": 3, "env/success_rate": -1.0}) + "\n")
    # runner.resume=auto: continue runner.output_dir, which has a checkpoint
    again = ["runner.max_iterations=4", "runner.resume=auto", f"runner.output_dir={part}"]
    assert cli.main(["train", *common, *again]) == 0
    expected, resumed = _metrics(full), _metrics(part)
    assert [r["iteration"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(expected, resumed, strict=True):
        for key in a:
            if not key.startswith(("time/", "throughput/", "memory/")):  # measurements
                assert (a[key] is None and b[key] is None) or a[key] == pytest.approx(
                    b[key], rel=1e-6, abs=1e-9
                ), key
    # Both starts are on record, the resume from its checkpoint's iteration, on the same device.
    starts = provenance.read(part)
    assert [r["start"] for r in starts] == [0, 2]
    assert [r["devices"] for r in starts] == [["cpu:0@node0"]] * 2


@pytest.mark.slow
def test_a_local_run_resumes_as_if_uninterrupted_and_starts_no_ray(tmp_path, monkeypatch):
    """placement=local: two stages in this process; a run resumed from its checkpoint takes
    the same rollouts and updates as one that ran through, and neither used Ray."""
    from rlinf_vla.pipelines import runner

    def no_ray(*args, **kwargs):
        raise AssertionError("placement=local used a Ray cluster, worker group or channel")

    for name in ("Cluster", "WorkerGroup", "Channel"):
        monkeypatch.setattr(runner, name, no_ray)
    common = ["placement=local", *SMALL, "runner.save_interval=2", "runner.seed=3"]
    common += ["runner.eval_interval=0"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli.main(["train", *common, "runner.max_iterations=3", f"runner.output_dir={full}"]) == 0
    assert cli.main(["train", *common, "runner.max_iterations=2", f"runner.output_dir={part}"]) == 0
    again = ["runner.max_iterations=3", f"runner.resume={part}", f"runner.output_dir={part}"]
    assert cli.main(["train", *common, *again]) == 0
    expected, resumed = _metrics(full), _metrics(part)
    assert [r["iteration"] for r in resumed] == [1, 2, 3]
    _assert_same_steps(expected, resumed)
    assert expected[-1]["train/policy_loss"] != expected[0]["train/policy_loss"]
    for r in resumed:
        _assert_breakdown_adds_up(r)
        assert r["time/rollout/serialise_s"] == 0.0  # nothing crosses a process


def test_a_run_evaluated_at_its_start_ends_with_a_before_after_line_and_its_curves(
    tmp_path, capsys
):
    out = tmp_path / "run"
    args = ["placement=local", *SMALL, "runner.max_iterations=2", "runner.eval_interval=2"]
    args += ["runner.eval_at_start=true", "runner.eval_episodes=4", "runner.eval_videos=false"]
    assert cli.main(["train", *args, f"runner.output_dir={out}"]) == 0
    rows = _metrics(out)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    start, end = rows[0]["eval/success_rate"], rows[-1]["eval/success_rate"]
    assert rows[0]["env_steps"] == 0 and "eval/success_rate" not in rows[1]
    printed = capsys.readouterr().out
    assert (
        f"greedy success on 4 held-out scenes: {start:.2f} after iteration 0, {end:.2f} after "
        "iteration 2"
    ) in printed
    assert f"curves: {out / 'curves.png'}" in printed
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.ray
def test_evaluating_leaves_the_training_unchanged(tmp_path):
    # The rollout worker evaluates with the weights of the next iteration and its own env,
    # with its sampler's random state set aside: the training takes the same steps.
    common = ["cluster.devices_per_node=1", *SMALL, "runner.seed=4", "runner.max_iterations=3"]
    runs = {}
    for interval in (0, 1):
        out = tmp_path / f"eval{interval}"
        extra = [f"runner.eval_interval={interval}", "runner.eval_episodes=3"]
        assert cli.main(["train", *common, *extra, f"runner.output_dir={out}"]) == 0
        runs[interval] = _metrics(out)
    for a, b in zip(runs[0], runs[1], strict=True):
        for key in a:
            if key.startswith(("env/", "train/")):
                assert (a[key] is None and b[key] is None) or a[key] == pytest.approx(
                    b[key], rel=1e-6, abs=1e-9
                ), key
    assert all(r["eval/episodes"] == 3 for r in runs[1])
    assert len(list((tmp_path / "eval1" / "videos").glob("iter_*/*.mp4"))) == 3


@pytest.mark.slow
@pytest.mark.ray
def test_an_evaluation_on_fewer_envs_plays_the_same_episodes(tmp_path):
    # 3 episodes on 1 env: 3 rounds (one video each) of the scenes 3 envs play in one round.
    common = ["cluster.devices_per_node=1", *SMALL, "runner.max_iterations=1"]
    common += ["runner.eval_interval=1", "runner.eval_episodes=3"]
    rows = {}
    for envs in ("null", "1"):
        out = tmp_path / f"envs{envs}"
        args = ["train", *common, f"runner.eval_num_envs={envs}", f"runner.output_dir={out}"]
        assert cli.main(args) == 0
        [rows[envs]] = _metrics(out)
        assert len(list((out / "videos" / "iter_1").glob("*.mp4"))) == (1 if envs == "null" else 3)
    for key in ("eval/success_rate", "eval/episode_return", "eval/episode_length"):
        assert rows["1"][key] == pytest.approx(rows["null"][key], rel=1e-6), key


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["placement=hybrid", "cluster.devices_per_node=2", "env.num_envs=3"],
            "cannot be split evenly",
        ),
        (
            ["placement=disaggregated", "cluster.devices_per_node=2"],
            "beyond the 2 available device",
        ),
        (["policy.action_dim=6"], "policy.action_dim=6 does not match"),
        (
            ["placement=hybrid", "placement.stages=1", "cluster.devices_per_node=2"],
            "cannot be shared evenly by 2 actor workers",
        ),
        (["env=toy", "env.nope=1"], "nope"),
        (["algo.micro_batch_size=5"], "must divide algo.minibatch_size"),
        (["runner.resume=/does/not/exist"], "is not a run folder"),
        (
            ["algo=grpo", "algo.group_size=4", "env.group_size=2"],
            "algo.group_size=4 must equal env.group_size=2",
        ),
        # cameras set by hand (a fresh policy keeps only the env's when left unset)
        (
            ["env=toy", "policy=pi0", "policy.image_keys=[main,wrist]"],
            "asks for camera(s) ['wrist'] that env 'toy' does not",
        ),
        (
            ["env=maniskill", "policy=openvla_oft", "policy.image_keys=[main,wrist]"],
            "env.robot=panda_wristcam",
        ),
        (["runner.max_nan_updates=0"], "runner.max_nan_updates must be >= 1"),
        (["runner.logging.wandb_mode=sometimes"], "wandb_mode must be auto, online or offline"),
        (
            ["env=toy", "algo=grpo", "env.group_size=4", "runner.rollout_chunks=2"],
            "is shorter than the env's time limit of 16 steps",
        ),
    ],
)
def test_invalid_train_configs_fail_before_start(capsys, nothing_starts, overrides, message):
    assert cli.main(["train", *overrides]) == 2
    assert message in capsys.readouterr().err


def test_eval_videos_without_ffmpeg_fail_before_start(capsys, nothing_starts, no_ffmpeg):
    assert cli.main(["train", "env=toy", "runner.eval_interval=1"]) == 2
    err = capsys.readouterr().err
    assert "runner.eval_videos=true: MP4 videos need imageio's FFmpeg backend" in err
    assert "pip install 'imageio[ffmpeg]', or set runner.eval_videos=false" in err


@pytest.mark.slow
@pytest.mark.ray
def test_sigterm_stops_the_run_naming_its_checkpoint_and_auto_resume_continues_it(tmp_path, capsys):
    # A scheduler preempting the job sends SIGTERM: the run stops like on Ctrl-C (exit 143,
    # the last checkpoint and the resume command on the console), and the same command line
    # with runner.resume=auto continues it. The signalled run is a process of its own; the
    # resumed one runs in this process, on the suite's Ray instance (a second process would
    # start Ray and import everything again, for the same check).
    import signal
    import subprocess
    import sys

    run = tmp_path / "run"
    args = [
        "train",
        *SMALL,
        "cluster.devices_per_node=1",
        "runner.save_interval=1",
        "runner.eval_interval=0",
        "runner.logging.tensorboard=false",
        f"runner.output_dir={run}",
        "runner.resume=auto",
    ]
    command = [sys.executable, "-m", "rlinf_vla.cli", *args, "runner.max_iterations=1000"]
    job = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / "iter_2" / "COMPLETE").exists():
            assert job.poll() is None and time.monotonic() < deadline, "no second checkpoint"
            time.sleep(0.5)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 143, err
    assert "stopped by SIGTERM" in err
    assert f"resume with: rlinf-vla train ... runner.resume={run}" in err
    from rlinf_vla.run.tracking import last_checkpoint

    done = int(last_checkpoint(run).name.split("_")[1])
    final = done + 1
    capsys.readouterr()
    assert cli.main([*args, f"runner.max_iterations={final}"]) == 0
    assert f"resuming after iteration {done} of {final}" in capsys.readouterr().err
    assert [r["iteration"] for r in _metrics(run)] == list(range(1, final + 1))


def test_auto_resume_continues_a_folder_with_a_checkpoint_and_starts_any_other(tmp_path):
    from rlinf_vla.config import ConfigError
    from rlinf_vla.run.tracking import resolve_resume

    run = tmp_path / "run"
    assert resolve_resume("auto", str(run), "iter") is None  # nothing there yet: start
    (run / "checkpoints" / "iter_5").mkdir(parents=True)
    assert resolve_resume("auto", str(run), "iter") is None  # interrupted while saving
    (run / "checkpoints" / "iter_5" / "COMPLETE").touch()
    assert resolve_resume("auto", str(run), "iter") == str(run)
    assert resolve_resume(str(run), None, "iter") == str(run)
    with pytest.raises(ConfigError, match=r"set runner\.output_dir too"):
        resolve_resume("auto", None, "iter")


def test_a_fresh_start_refuses_a_folder_that_holds_a_run(tmp_path, capsys, nothing_starts):
    """Without runner.resume, a run folder with metrics or checkpoints is not overwritten."""
    from rlinf_vla.config import ConfigError
    from rlinf_vla.run.tracking import resolve_resume

    (tmp_path / "config.yaml").write_text("{}")  # what a start that failed at once leaves
    assert resolve_resume(None, str(tmp_path), "iter") is None
    metrics = '{"iteration": 1}\n{"iteration": 2}\n'
    (tmp_path / "metrics.jsonl").write_text(metrics)
    with pytest.raises(ConfigError, match=r"\(2 row\(s\) in metrics.jsonl\).*choose another"):
        resolve_resume(None, str(tmp_path), "iter")
    (tmp_path / "checkpoints" / "iter_2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "iter_2" / "COMPLETE").touch()
    assert cli.main(["train", *SMALL, f"runner.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run (2 row(s) in metrics.jsonl, checkpoints up to iter_2)" in err
    assert "continue it with runner.resume=auto" in err
    assert (tmp_path / "metrics.jsonl").read_text() == metrics  # untouched
    # math-grpo's checkpoints are step_N: the same check
    assert resolve_resume(None, str(tmp_path / "checkpoints"), "step") is None
    (tmp_path / "checkpoints" / "step_3").mkdir()
    (tmp_path / "checkpoints" / "step_3" / "COMPLETE").touch()
    (tmp_path / "metrics.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"\(checkpoints up to step_3\)"):
        resolve_resume(None, str(tmp_path), "step")


def test_resuming_a_run_without_a_complete_checkpoint_fails_before_start(
    tmp_path, capsys, nothing_starts
):
    (tmp_path / "checkpoints" / "iter_2").mkdir(parents=True)  # no COMPLETE: an unfinished save
    assert cli.main(["train", *SMALL, f"runner.resume={tmp_path}"]) == 2
    assert "has no complete checkpoint" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.ray
def test_a_failed_start_leaves_no_worker_or_channel(tmp_path, monkeypatch):
    """On a Ray instance that outlives the run (here the test session's; for users a cluster
    they connect to), a start that fails after the workers are up removes all of them."""
    import ray

    from rlinf_vla.pipelines import runner

    def named_actors() -> set[str]:
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}

    def no_weight_sync(*args, **kwargs):
        raise RuntimeError("the weight-sync group could not form")

    before = named_actors()
    monkeypatch.setattr(runner, "create_collective", no_weight_sync)
    args = ["cluster.devices_per_node=1", *SMALL, f"runner.output_dir={tmp_path}"]
    with pytest.raises(RuntimeError, match="the weight-sync group could not form") as info:
        cli.main(["train", *args])
    # The traceback (kept here, as an interactive session keeps the last one) holds the
    # half-built runner, so its worker handles are alive: the runner must kill them itself.
    deadline = time.monotonic() + 60  # ray.kill returns before the actor is gone
    while (left := named_actors() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left
    assert info.traceback


MODES = {
    "collocated": ["placement=collocated", "cluster.devices_per_node=1"],
    "hybrid": [
        "placement=hybrid",
        "placement.stages=1",
        "placement.components.actor=0",  # one env batch: one trajectory, one actor
        "cluster.devices_per_node=2",
    ],
    "disaggregated": ["placement=disaggregated", "cluster.devices_per_node=3"],
    "local": ["placement=local", "placement.stages=1", "cluster.devices_per_node=1"],
}


MANISKILL_ONE_ENV = ["env=maniskill", "env.num_envs=1"]
LIBERO_ONE_ENV = [
    *("env=libero", "env.num_envs=1", "env.task_ids=[0]"),
    *("env.image_size=128", "env.fast_render=true"),
]


# Every mode runs on the toy env (test_two_iterations_in_each_mode); on each simulator: the
# collocated workers (with an evaluation and its video), the single process (the simulators
# start as under Ray) and one mode whose env workers have devices of their own.
@pytest.mark.sim
@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "module", "mode"),
    [
        pytest.param(MANISKILL_ONE_ENV, "mani_skill", "collocated", id="maniskill-collocated"),
        pytest.param(MANISKILL_ONE_ENV, "mani_skill", "local", id="maniskill-local"),
        pytest.param(MANISKILL_ONE_ENV, "mani_skill", "hybrid", id="maniskill-hybrid"),
        pytest.param(LIBERO_ONE_ENV, "libero", "collocated", id="libero-collocated"),
        pytest.param(LIBERO_ONE_ENV, "libero", "local", id="libero-local"),
        pytest.param(LIBERO_ONE_ENV, "libero", "disaggregated", id="libero-disaggregated"),
    ],
)
@pytest.mark.ray
def test_two_iterations_on_a_simulator(tmp_path, env, module, mode):
    pytest.importorskip(module)
    args = [*env, *MODES[mode], "runner.rollout_chunks=2", "algo.update_epochs=1"]
    args += ["policy.chunk_size=2"]
    if mode == "collocated":  # and a greedy evaluation by the rollout worker, with its video
        limit = "env.max_episode_steps=6" if module == "mani_skill" else "+env.max_episode_steps=6"
        args += ["runner.eval_interval=2", "runner.eval_episodes=1", limit]
    assert (
        cli.main(["train", *args, "runner.max_iterations=2", f"runner.output_dir={tmp_path}"]) == 0
    )
    rows = _metrics(tmp_path)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert [r["env_steps"] for r in rows] == [4, 8]  # 1 env x 2 chunks x 2 steps
    assert rows[-1]["train/samples"] == 2.0
    if mode == "collocated":
        assert rows[-1]["eval/episodes"] == 1 and 1 <= rows[-1]["eval/episode_length"] <= 6
        assert len(list((tmp_path / "videos" / "iter_2").glob("*.mp4"))) == 1


@pytest.mark.slow
@pytest.mark.ray
def test_pi0_with_flow_sde_trains(tmp_path):
    small = [a for a in SMALL if not a.startswith("policy.chunk_size")]  # tiny π0's own 4
    args = ["policy=pi0", "policy.image_keys=[main]", "cluster.devices_per_node=1", *small]
    assert (
        cli.main(["train", *args, "runner.max_iterations=1", f"runner.output_dir={tmp_path}"]) == 0
    )
    [row] = _metrics(tmp_path)
    # 4 envs x 4 chunks x 4 steps per chunk
    assert row["env_steps"] == 64
    assert row["train/samples"] == 16.0


@pytest.mark.slow
@pytest.mark.ray
def test_bf16_autocast_trains_with_float32_weights(tmp_path):
    args = ["cluster.devices_per_node=1", *SMALL, "algo.autocast=bf16", "algo.minibatch_size=16"]
    assert (
        cli.main(["train", *args, "runner.max_iterations=1", f"runner.output_dir={tmp_path}"]) == 0
    )
    [row] = _metrics(tmp_path)
    assert row["train/skipped_updates"] == 0
    # one epoch, one minibatch: the update starts from the rollout's weights, so the ratio
    # is 1 up to bf16 rounding (16 samples, rollout batches of 4)
    assert abs(row["train/approx_kl"]) < 1e-2
    from safetensors.torch import load_file

    weights = load_file(
        next((tmp_path / "checkpoints" / "iter_1" / "policy").glob("*.safetensors"))
    )
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.float32}


@pytest.mark.gpu
@pytest.mark.ray
@pytest.mark.parametrize("offload", [True, False], ids=["offload", "resident"])
def test_collocated_on_one_gpu_with_bf16_autocast(tmp_path, offload):
    # Env, rollout and actor on GPU 0: weights go over gloo (NCCL refuses two ranks on one
    # GPU), forward passes in bf16, weights and the optimizer in float32; the rollout worker
    # evaluates on the GPU; the idle policy copies wait in host memory unless
    # placement.offload=false (the memory is read after the update).
    args = [
        "cluster.devices_per_node=1",
        f"placement.offload={str(offload).lower()}",
        *SMALL,
        "algo.autocast=auto",
        "algo.minibatch_size=16",
        "runner.eval_interval=1",
        "runner.eval_episodes=4",
        "runner.eval_videos=false",  # videos are tested on CPU; GPU images may lack FFmpeg
    ]
    assert (
        cli.main(["train", *args, "runner.max_iterations=1", f"runner.output_dir={tmp_path}"]) == 0
    )
    [row] = _metrics(tmp_path)
    assert row["train/skipped_updates"] == 0
    assert abs(row["train/approx_kl"]) < 1e-2  # ratio 1 up to bf16 rounding, as on CPU
    assert row["eval/episodes"] == 4
    for group in ("rollout", "actor"):
        assert row[f"memory/{group}_gpu_peak_gib"] > 0, group  # it computed on the GPU ...
        if offload:
            assert row[f"memory/{group}_gpu_gib"] < 0.01, group  # ... and waits in host memory
        else:
            assert row[f"memory/{group}_gpu_gib"] > 0, group  # ... and stays there
    assert provenance.read(tmp_path)[0]["devices"] == ["cuda:0@node0"]
    from safetensors.torch import load_file

    weights = load_file(
        next((tmp_path / "checkpoints" / "iter_1" / "policy").glob("*.safetensors"))
    )
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.float32}


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu, id="cuda-nccl")]
)
@pytest.mark.slow
@pytest.mark.ray
def test_fsdp_matches_replicated_data_parallel_and_resumes(tmp_path, device):
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("FSDP over NCCL needs two GPUs")
    # Two actor ranks: FSDP2 (sharded weights, reduce-scattered gradients) must take the same
    # steps as replicas with all-reduced gradients, up to float rounding.
    common = ["cluster.devices_per_node=2", *SMALL, "runner.save_interval=1", "runner.seed=5"]
    common.append("algo.autocast=off")  # float32 on GPUs too: the comparison is to rounding
    runs = {}
    for name, extra in {"dp": [], "fsdp": ["algo.fsdp=true"]}.items():
        out = tmp_path / name
        args = [*common, *extra, "runner.max_iterations=2", f"runner.output_dir={out}"]
        assert cli.main(["train", *args]) == 0
        runs[name] = _metrics(out)
    _assert_same_steps(runs["dp"], runs["fsdp"])
    # the FSDP checkpoint holds full weights in the policy's format and resumes
    fsdp = tmp_path / "fsdp"
    assert (fsdp / "checkpoints" / "iter_2" / "policy" / "config.json").exists()
    args = [*common, "algo.fsdp=true", "runner.max_iterations=3", f"runner.resume={fsdp}"]
    assert cli.main(["train", *args]) == 0
    assert [r["iteration"] for r in _metrics(fsdp)] == [1, 2, 3]


def test_training_holds_float32_weights_unless_told_otherwise():
    # policy.dtype=auto would be bfloat16 on CUDA: AdamW on bf16 weights drops small updates
    from rlinf_vla.pipelines import validate

    assert validate(cli.compose("train", ["env=toy"])).policy_config.dtype == "float32"
    job = validate(cli.compose("train", ["env=toy", "policy.dtype=bfloat16"]))
    assert job.policy_config.dtype == "bfloat16"


def test_a_checkpoints_own_settings_win_over_the_class_defaults(tmp_path):
    from rlinf_vla.pipelines import validate
    from rlinf_vla.policies import make_policy
    from rlinf_vla.policies.resolve import policy_config_for

    make_policy("openvla", preset="tiny", chunk_size=4).save_pretrained(tmp_path / "ckpt")
    base = ["env=toy", f"policy.checkpoint={tmp_path / 'ckpt'}", "cluster.devices_per_node=1"]
    job = validate(cli.compose("train", base))
    # OpenVLA's default is one action per call; the checkpoint was trained with 4
    assert policy_config_for(job.policy_name, job.policy).chunk_size == 4
    assert job.policy_config.chunk_size == 4
    job = validate(cli.compose("train", [*base, "policy.chunk_size=1"]))  # set by hand: wins,
    assert job.policy_config.chunk_size == 1  # also when it equals the default


@pytest.mark.slow
@pytest.mark.ray
def test_non_finite_updates_abort_the_run_naming_the_checkpoint(tmp_path, capsys):
    common = ["cluster.devices_per_node=1", *SMALL, "runner.save_interval=1"]
    out = f"runner.output_dir={tmp_path}"
    assert cli.main(["train", *common, "runner.max_iterations=1", out]) == 0
    # An absurd learning rate turns the weights to inf after the first step; every later
    # update is skipped, and the run stops after 2 in a row instead of training on garbage.
    blow_up = ["algo.lr=1e30", "algo.value_lr=1e30", "runner.max_nan_updates=2"]
    blow_up += ["algo.minibatch_size=4", "algo.micro_batch_size=4"]  # 4 updates per iteration
    resume = f"runner.resume={tmp_path}"
    assert cli.main(["train", *common, *blow_up, "runner.max_iterations=3", resume]) == 1
    err = capsys.readouterr().err
    assert "TrainingAborted" in err and "runner.max_nan_updates=2" in err
    assert f"last checkpoint: {tmp_path / 'checkpoints' / 'iter_1'}" in err
    assert f"runner.resume={tmp_path}" in err
    rows = _metrics(tmp_path)
    assert rows[-1]["iteration"] == 2 and rows[-1]["train/skipped_updates"] >= 2


@pytest.mark.slow
@pytest.mark.ray
def test_read_out_training_on_cached_features_takes_the_same_steps(tmp_path):
    # LoRA on lm_head alone: the actor computes the frozen hidden states once per iteration and
    # runs only the read-out in its epochs. It must take the same optimizer steps as the whole
    # pass in every epoch.
    common = [
        "cluster.devices_per_node=1",
        *SMALL,
        "algo.update_epochs=3",
        "++policy.lora_rank=4",
        "++policy.lora_target_modules=.*lm_head",
        "runner.max_iterations=2",
        "runner.seed=4",
    ]
    runs = {}
    for cached in ("true", "false"):
        out = tmp_path / cached
        args = [*common, f"algo.cache_frozen_features={cached}", f"runner.output_dir={out}"]
        assert cli.main(["train", *args]) == 0
        runs[cached] = _metrics(out)
    assert [r["train/frozen_features"] for r in runs["true"]] == [1.0, 1.0]
    assert [r["train/frozen_features"] for r in runs["false"]] == [0.0, 0.0]
    _assert_same_steps(runs["true"], runs["false"])


@pytest.mark.ray
def test_weight_sync_sends_the_frozen_weights_once(tmp_path):
    # LoRA: the first sync sends every weight, later ones only the adapter, the heads and the
    # buffers. The rollout must still act with the actor's weights: with a large learning rate
    # a stale adapter would show as a first-epoch ratio away from 1 (approx_kl > 0).
    args = [
        "cluster.devices_per_node=1",
        *SMALL,
        "++policy.lora_rank=4",
        "algo.lr=0.05",
        "runner.max_iterations=3",
    ]
    from rlinf_vla.pipelines import validate
    from rlinf_vla.policies import make_policy

    assert cli.main(["train", *args, f"runner.output_dir={tmp_path}"]) == 0
    rows = _metrics(tmp_path)
    job = validate(cli.compose("train", args))
    policy = make_policy(job.policy_name, job.policy_config)
    size = {k: v.numel() * v.element_size() for k, v in policy.state_dict().items()}
    changing = {n for n, p in policy.named_parameters() if p.requires_grad}
    changing = (changing | {n for n, _ in policy.named_buffers()}) & set(size)
    assert 0 < len(changing) < len(size)
    assert rows[0]["sync/sent_mib"] == pytest.approx(sum(size.values()) / 2**20)
    for row in rows[1:]:
        assert row["sync/sent_mib"] == pytest.approx(sum(size[k] for k in changing) / 2**20)
        assert abs(row["train/approx_kl"]) < 1e-6, row["iteration"]


@pytest.mark.ray
def test_a_lora_run_resumes_with_its_adapter(tmp_path):
    # The policy folder of a LoRA run holds the weights with the adapter merged in; the resume
    # takes the adapter and the heads from the actor's state onto the built base and must take
    # the same steps as the uninterrupted run.
    common = [
        "cluster.devices_per_node=1",
        *SMALL,
        "policy.lora_rank=4",
        "algo.lr=0.01",
        "runner.save_interval=1",
        "runner.seed=5",
    ]
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli.main(["train", *common, "runner.max_iterations=2", f"runner.output_dir={full}"]) == 0
    assert cli.main(["train", *common, "runner.max_iterations=1", f"runner.output_dir={part}"]) == 0
    again = ["runner.max_iterations=2", "runner.resume=auto", f"runner.output_dir={part}"]
    assert cli.main(["train", *common, *again]) == 0
    expected, resumed = _metrics(full), _metrics(part)
    assert [r["iteration"] for r in resumed] == [1, 2]
    _assert_same_steps(expected, resumed)
    assert resumed[1]["train/approx_kl"] == pytest.approx(expected[1]["train/approx_kl"], abs=1e-9)
