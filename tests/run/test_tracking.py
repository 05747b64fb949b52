"""metrics.jsonl, TensorBoard and wandb logging of a run, and `rlinf-vla plot`."""

import json

import pytest

from rlinf_vla import cli
from rlinf_vla.run.plot import _series, drawn_panels, plot_run
from rlinf_vla.run.tracking import LoggingConfig, MetricsLogger, read_metrics


def _rows(n, start=1):
    return [
        {
            "iteration": i,
            "env_steps": 32 * i,
            "env/success_rate": None if i == 1 else i / 10,
            "train/policy_loss": -0.01 * i,
            "train/grad_norm": float("nan") if i == 2 else 1.0,
            "throughput/env_steps_per_s": 100.0 + i,
        }
        for i in range(start, start + n)
    ]


def test_tensorboard_gets_every_finite_scalar(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=True), "run")
    for row in _rows(3):
        logger.log(row)
    logger.close()
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    loss = acc.Scalars("train/policy_loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([-0.01, -0.02, -0.03])
    # None (no episode ended) and NaN are not written as points.
    assert [e.step for e in acc.Scalars("env/success_rate")] == [2, 3]
    assert [e.step for e in acc.Scalars("train/grad_norm")] == [1, 3]


def test_resumed_logger_drops_rows_after_the_checkpoint(tmp_path):
    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), "run")
    for row in _rows(5):
        logger.log(row)
    logger.close()
    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=False), "run", resume_iteration=3)
    logger.log(_rows(1, start=4)[0])
    logger.close()
    assert [r["iteration"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_wandb_runs_offline_without_a_key(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    cfg = LoggingConfig(tensorboard=False, wandb=True, wandb_mode="auto")
    logger = MetricsLogger(tmp_path, cfg, "wandb-test", full_config={"algo": {"lr": 1e-4}})
    for row in _rows(2):
        logger.log(row)
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    assert list(runs[0].glob("*.wandb")), "the offline run has no data file"


def test_series_skips_missing_and_non_finite_values():
    xs, ys = _series(_rows(3), "train/grad_norm")
    assert xs == [32.0, 96.0] and ys == [1.0, 1.0]
    xs, ys = _series(_rows(3), "env/success_rate")
    assert xs == [64.0, 96.0] and ys == pytest.approx([0.2, 0.3])


def test_plot_writes_a_png_with_the_logged_panels(tmp_path):
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for row in _rows(6):
            f.write(json.dumps(row) + "\n")
    assert cli.main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    h, w = matplotlib.image.imread(png).shape[:2]
    # 4 logged panels (success, policy loss, grad norm, throughput) -> 2 rows of 3.2 in at 110 dpi
    assert w == 11 * 110
    assert h == round(2 * 3.2 * 110)
    assert plot_run(tmp_path, tmp_path / "other.png") == tmp_path / "other.png"
    assert (tmp_path / "other.png").stat().st_size > 1000
    # The workers' memory adds a fifth panel: 3 rows.
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for row in _rows(6):
            f.write(
                json.dumps({**row, "memory/actor_rss_gib": 1.5, "memory/env_rss_gib": 2}) + "\n"
            )
    h = matplotlib.image.imread(plot_run(tmp_path)).shape[0]
    assert h == round(3 * 3.2 * 110)


def test_an_sft_run_plots_its_supervised_loss(tmp_path):
    rows = [
        {"iteration": n, "train/loss": 1.0 / n, "train/grad_norm": 0.5, "train/lr": 3e-4}
        for n in range(1, 5)
    ]
    titles = [title for title, _ in drawn_panels(rows)]
    assert titles == ["supervised loss", "gradient norm"]
    [(key, xs, ys)] = drawn_panels(rows)[0][1]
    assert key == "train/loss" and xs == [1.0, 2.0, 3.0, 4.0] and ys[-1] == 0.25
    dagger = [{**r, "dagger/action_error": 0.1} for r in rows]
    assert "DAgger: policy vs expert action error" in [t for t, _ in drawn_panels(dagger)]


def test_plot_of_a_folder_without_metrics_fails_clearly(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path / "nope")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def _torn_run(tmp_path, rows=4):
    """A run folder whose metrics.jsonl ends in a row cut off while being written."""
    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for row in _rows(rows):
            f.write(json.dumps(row) + "\n")
        f.write(json.dumps(_rows(1, start=rows + 1)[0])[:37])  # the disk filled up here
    return tmp_path


def test_a_torn_last_row_is_dropped_with_a_warning_on_resume(tmp_path, caplog):
    from rlinf_vla.run.loop import RunLoop

    run = _torn_run(tmp_path / "run")
    loop = RunLoop(
        run,
        {},
        LoggingConfig(tensorboard=False),
        command="train",
        unit="iter",
        total=6,
        save_interval=10,
        max_nan_updates=3,
    )

    def save(n):
        (run / "checkpoints" / f"iter_{n}").mkdir(parents=True)
        return run / "checkpoints" / f"iter_{n}"

    def iteration(i, logger, say):
        return _rows(1, start=i + 1)[0]

    with caplog.at_level("WARNING"):
        loop.run(4, iteration, save, lambda m: "")  # resumed after iteration 4
    assert "cut off while being written" in caplog.text
    assert [r["iteration"] for r in read_metrics(run)] == [1, 2, 3, 4, 5, 6]
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # the torn row is gone from the file


def test_reading_metrics_skips_a_torn_last_row_but_not_a_damaged_one(tmp_path):
    run = _torn_run(tmp_path)
    assert [r["iteration"] for r in read_metrics(run)] == [1, 2, 3, 4]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:20]
    (run / "metrics.jsonl").write_text("\n".join(lines[:4]) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl: row 2 is not a JSON object"):
        read_metrics(run)
    with pytest.raises(ValueError, match="row 2"):
        MetricsLogger(run, LoggingConfig(tensorboard=False), "run", resume_iteration=4)


@pytest.mark.parametrize(
    "error",
    [
        OSError(28, "No space left on device"),
        # an actor worker's torch.save on a full disk, as the driver receives it
        RuntimeError(
            "worker actor[0] failed in save():\nTraceback ...\nRuntimeError: [enforce fail at "
            "inline_container.cc:778] . PytorchStreamWriter failed writing file data/3: "
            "unexpected pos 1307264 vs 1307152"
        ),
    ],
)
def test_a_full_disk_while_saving_names_the_run_folder(tmp_path, error):
    from rlinf_vla.config import RunAborted
    from rlinf_vla.run.loop import RunLoop

    loop = RunLoop(
        tmp_path / "run",
        {},
        LoggingConfig(tensorboard=False),
        command="train",
        unit="iter",
        total=2,
        save_interval=1,
        max_nan_updates=3,
    )

    def save(n):
        raise error

    with pytest.raises(RunAborted) as e:
        loop.run(0, lambda i, logger, say: _rows(1, start=i + 1)[0], save, lambda m: "")
    assert f"no space left on the device of {tmp_path / 'run'}" in str(e.value)
    assert "the checkpoint of iteration 1" in str(e.value)
    assert e.value.__cause__ is error


def test_other_errors_while_saving_are_not_called_a_full_disk(tmp_path):
    from rlinf_vla.run.loop import RunLoop

    loop = RunLoop(
        tmp_path / "run",
        {},
        LoggingConfig(tensorboard=False),
        command="train",
        unit="iter",
        total=1,
        save_interval=1,
        max_nan_updates=3,
    )

    def save(n):
        raise PermissionError(13, "Permission denied")

    with pytest.raises(PermissionError):
        loop.run(0, lambda i, logger, say: _rows(1, start=i + 1)[0], save, lambda m: "")
