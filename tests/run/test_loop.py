"""The loop shell shared by the trainers: checkpoints, metrics, NaN abort, resume hint."""

import pytest

from rlinf_vla.run.loop import RunLoop, TrainingAborted
from rlinf_vla.run.tracking import LoggingConfig, read_metrics


def _loop(tmp_path, total=5, save_interval=2, max_nan_updates=3):
    return RunLoop(
        tmp_path / "run",
        {"runner": {"max_iterations": total}},
        LoggingConfig(tensorboard=False),
        command="train",
        unit="iter",
        total=total,
        save_interval=save_interval,
        max_nan_updates=max_nan_updates,
    )


def _save(loop):
    def save(n):
        path = loop.output_dir / "checkpoints" / f"iter_{n}"
        path.mkdir(parents=True)
        (path / "COMPLETE").touch()
        return path

    return save


def _metrics(i, logger, say):
    return {"iteration": i + 1, "train/loss": float(i)}


def test_runs_from_start_logs_every_iteration_and_saves_on_the_interval_and_at_the_end(tmp_path):
    loop = _loop(tmp_path, total=5, save_interval=2)
    seen = []

    def iteration(i, logger, say):
        seen.append(i)
        return _metrics(i, logger, say)

    out = loop.run(0, iteration, _save(loop), lambda m: "")
    assert out == tmp_path / "run"
    assert seen == [0, 1, 2, 3, 4]
    assert [r["iteration"] for r in read_metrics(out)] == [1, 2, 3, 4, 5]
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == ["iter_2", "iter_4", "iter_5"]  # every 2nd, and the last
    assert loop.last_checkpoint == out / "checkpoints" / "iter_5"
    assert "max_iterations: 5" in (out / "config.yaml").read_text()


def test_a_resumed_run_starts_at_its_checkpoint_and_before_runs_once(tmp_path):
    loop = _loop(tmp_path, total=4, save_interval=10)
    seen, calls = [], []

    def before(logger, say):
        calls.append("before")
        return "initial evaluation: 0.1"

    def iteration(i, logger, say):
        seen.append(i)
        return _metrics(i, logger, say)

    loop.run(2, iteration, _save(loop), lambda m: "", before)
    assert seen == [2, 3]
    assert calls == ["before"]
    assert [p.name for p in (loop.output_dir / "checkpoints").iterdir()] == ["iter_4"]


def test_a_streak_of_skipped_updates_aborts_and_names_the_checkpoint_to_resume_from(
    tmp_path, capsys
):
    loop = _loop(tmp_path, total=10, save_interval=1, max_nan_updates=3)

    def iteration(i, logger, say):
        # iterations 1 and 2 are fine; from iteration 3 on every update is skipped
        streak = max(0, i - 1)
        return {
            "iteration": i + 1,
            "train/skipped_updates": float(streak > 0),
            "train/nan_streak": float(streak),
        }

    with pytest.raises(TrainingAborted, match="3 optimizer updates in a row"):
        loop.run(0, iteration, _save(loop), lambda m: "")
    err = capsys.readouterr().err
    # iteration 5 has the third skipped update in a row; iteration 4 was saved before it
    assert "training stopped in iteration 5" in err
    assert "update(s) skipped" in err
    assert f"last checkpoint: {loop.output_dir / 'checkpoints' / 'iter_4'}" in err
    assert f"runner.resume={loop.output_dir}" in err
    assert [r["iteration"] for r in read_metrics(loop.output_dir)] == [1, 2, 3, 4, 5]


def test_a_crash_before_any_checkpoint_says_so_and_reraises(tmp_path, capsys):
    loop = _loop(tmp_path, total=3, save_interval=5)

    def iteration(i, logger, say):
        raise RuntimeError("env worker 'env-0' crashed")

    with pytest.raises(RuntimeError, match="env-0"):
        loop.run(0, iteration, _save(loop), lambda m: "")
    err = capsys.readouterr().err
    assert "training stopped in iteration 1: RuntimeError" in err
    assert "no checkpoint was saved yet" in err


def test_header_helpers_write_counts_ranges_and_devices_for_people():
    from rlinf_vla.run.loop import count_text, device_ranges, device_summary
    from rlinf_vla.runtime import Device

    assert [count_text(n) for n in (950, 20_130, 435_201, 135_000_000, 7_541_237_184)] == [
        "950",
        "0.02 M",
        "0.44 M",
        "135 M",
        "7.54 B",
    ]
    assert device_ranges([0, 1, 2, 5]) == "0-2,5"
    assert device_ranges([3]) == "3" and device_ranges([0, 2, 3]) == "0,2-3"

    def cpu(i, threads):
        return Device(i, 0, "n0", "10.0.0.1", i, "cpu", threads=threads)

    def gpu(i, node):
        return Device(i, node, f"n{node}", "10.0.0.1", i % 4, "cuda")

    assert device_summary([cpu(0, 1), cpu(1, 1)]) == "2 cpu slots (1 thread each)"
    assert device_summary([cpu(0, 2)]) == "1 cpu slot (2 threads)"
    assert device_summary([gpu(i, i // 4) for i in range(8)]) == "8 GPUs on 2 nodes"


def test_the_header_and_the_run_folder_come_before_the_first_iteration(tmp_path, capsys):
    loop = _loop(tmp_path, total=2)
    loop.header = ["rlinf-vla train: ppo on toy", "policy openvla: 950 parameters"]
    seen = []

    def iteration(i, logger, say):
        seen.append(capsys.readouterr().err)
        return _metrics(i, logger, say)

    loop.run(0, iteration, _save(loop), lambda m: "")
    first = seen[0]
    assert first.index("rlinf-vla train: ppo on toy") < first.index("policy openvla")
    # (the console may wrap a long path onto its own line)
    assert f"run folder: {tmp_path / 'run'}" in " ".join(first.split())
    loop.total = 3
    loop.run(2, iteration, _save(loop), lambda m: "")  # resumed after iteration 2
    assert "resuming after iteration 2 of 3" in seen[-1]


def test_a_log_file_gets_one_plain_line_per_iteration_and_per_status(tmp_path, capsys):
    loop = _loop(tmp_path, total=3, save_interval=10)

    def iteration(i, logger, say):
        if i == 1:
            say("greedy evaluation ...")
        return _metrics(i, logger, say)

    loop.run(0, iteration, _save(loop), lambda m: f"loss {m['train/loss']:.1f}")
    err = capsys.readouterr().err  # not a terminal: no redrawn bar
    lines = [line for line in err.splitlines() if line.startswith("iter ")]
    assert [line.split("  ")[0] for line in lines] == [
        "iter 1/3",
        "iter 2/3: greedy evaluation ...",
        "iter 2/3",
        "iter 3/3",
    ]
    assert lines[0].endswith("left  loss 0.0") and lines[-1].endswith("loss 2.0")
    assert "elapsed, ~" in lines[0]


def test_an_iteration_without_an_update_says_why_in_full_once(tmp_path, capsys):
    loop = _loop(tmp_path, total=4, save_interval=10)
    zero = {"train/update_steps": 0.0, "train/samples": 64.0, "train/skipped_zero_advantage": 2.0}

    def iteration(i, logger, say):
        extra = {"train/update_steps": 3.0} if i == 2 else zero
        return {**_metrics(i, logger, say), **extra}

    loop.run(0, iteration, _save(loop), lambda m: "")
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("did not update the policy") == 3  # iterations 1, 2 and 4
    assert "iteration 1 did not update the policy: every advantage was 0: the episodes" in err
    assert "iteration 2 did not update the policy: every advantage was 0 iter" in err
    assert "iteration 3 did not" not in err


@pytest.mark.parametrize(
    ("metrics", "reason"),
    [
        ({"train/update_steps": 2.0}, None),
        ({"train/loss": 0.1}, None),  # a trainer that does not count its steps
        ({"train/update_steps": 0.0, "train/samples": 0.0}, "no sample entered the loss"),
        ({"train/update_steps": 0.0, "train/skipped_zero_advantage": 1.0}, "every advantage was 0"),
        ({"train/update_steps": 0.0, "train/kl_stopped": 1.0}, "algo.target_kl"),
    ],
)
def test_no_update_reason_reads_the_trainer_metrics(metrics, reason):
    from rlinf_vla.run.loop import no_update_reason

    got = no_update_reason(metrics)
    assert got == reason if reason is None else reason in got
