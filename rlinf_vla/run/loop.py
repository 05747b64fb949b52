"""The loop shell the trainers share (``rlinf-vla train`` and ``rlinf-vla math-grpo``).

A trainer supplies what one iteration does, how to save a checkpoint and what its progress bar
shows; :class:`RunLoop` does the rest, the same way for every command:

- writes ``config.yaml`` into the run folder on the first start (a resume keeps it), this
  start's config to ``configs/start_<k>.yaml`` (``k``: the start's line in ``run_info.jsonl``,
  0 for the first) and, when given, every setting to ``configs/settings_<k>.yaml``, appends this start's software and machine to ``run_info.jsonl``
  (:mod:`rlinf_vla.provenance`; a resumed run prints what changed since the run started) and
  opens the :class:`MetricsLogger` (which, on a resumed run, truncates ``metrics.jsonl`` back
  to the checkpoint);
- shows a progress bar (iterations done, the trainer's status line, time remaining); when
  stderr is not a terminal (a log file, ``nohup``, SLURM, CI) it prints one plain line per
  iteration instead, and one for each status the trainer shows between them;
- logs each iteration's metrics, warns about skipped non-finite updates and aborts after
  ``max_nan_updates`` of them in a row; says when an iteration changed nothing, and why
  (:func:`no_update_reason`);
- saves a checkpoint every ``save_interval`` iterations and after the last one;
- when the run stops early (an error, a crashed or stalled worker, Ctrl-C, SIGTERM), prints the
  last checkpoint and the command that resumes from it, then re-raises. A worker that stops
  answering is caught by the runtime's call deadlines (:mod:`rlinf_vla.runtime.stall`, set by
  ``cluster.stall_factor`` and ``cluster.stall_min_s``), which raise
  :class:`~rlinf_vla.runtime.WorkerStalled` here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlinf_vla import provenance
from rlinf_vla.config import RunAborted
from rlinf_vla.run.tracking import (
    LoggingConfig,
    MetricsLogger,
    disk_full_message,
    last_checkpoint,
)

__all__ = [
    "RunLoop",
    "TrainingAborted",
    "count_text",
    "device_ranges",
    "device_summary",
    "no_update_reason",
    "parameter_counts",
]

#: ``say(text)``: show ``text`` as the progress bar's status (e.g. during an evaluation).
Say = Callable[[str], None]

_WORDS = {"iter": "iteration", "step": "step"}


def parameter_counts(module: Any) -> dict[str, int]:
    """``total`` and ``trained`` (``requires_grad``) parameters of a torch module."""
    params = list(module.parameters())
    return {
        "total": sum(p.numel() for p in params),
        "trained": sum(p.numel() for p in params if p.requires_grad),
    }


def count_text(n: int) -> str:
    """A parameter count for people: ``7.54 B``, ``135 M``, ``0.43 M``, ``950``."""
    if n >= 10**9:
        return f"{n / 1e9:.2f} B"
    if n >= 10**8:
        return f"{n / 1e6:.0f} M"
    if n >= 10**4:
        return f"{n / 1e6:.2f} M"
    return str(n)


def device_ranges(indices: list[int]) -> str:
    """Device indices as ranges, as placements write them: ``[0, 1, 2, 5]`` -> ``0-2,5``."""
    parts: list[str] = []
    for i in indices:
        if parts and parts[-1].split("-")[-1] == str(i - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{i}"
        else:
            parts.append(str(i))
    return ",".join(parts)


def device_summary(devices: list[Any]) -> str:
    """``2 cpu slots (1 thread each)``, ``8 GPUs on 2 nodes``, ... for a run's header."""
    kinds = sorted({d.kind for d in devices})
    nodes = len({d.node_id for d in devices})
    parts = []
    for kind in kinds:
        mine = [d for d in devices if d.kind == kind]
        if kind == "cpu":
            threads = sorted({d.threads for d in mine if d.threads})
            each = f" ({'/'.join(map(str, threads))} thread{'s' * (threads != [1])}"
            each += " each)" if len(mine) > 1 else ")"
            parts.append(f"{len(mine)} cpu slot{'s' * (len(mine) > 1)}{each if threads else ''}")
        else:
            parts.append(f"{len(mine)} GPU{'s' * (len(mine) > 1)}")
    where = f" on {nodes} nodes" if nodes > 1 else ""
    return " + ".join(parts) + where


def stop_reason(error: BaseException) -> str:
    """Why a run (training, evaluation) stopped, in a few words (the CLI prints the error
    itself afterwards)."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    if isinstance(error, SystemExit):
        return f"exit requested ({error.code})"
    return type(error).__name__


class TrainingAborted(RunAborted):
    """The run cannot go on (e.g. too many non-finite updates in a row)."""


@dataclass
class RunLoop:
    """One run's loop settings; :meth:`run` drives it.

    Attributes:
        output_dir: the run folder.
        config: the job's resolved config, written to ``config.yaml``.
        logging: the ``runner.logging`` section.
        command: the CLI command, for the resume hint (``train``, ``math-grpo``).
        unit: ``iter`` or ``step``: the progress bar's label and the checkpoint folder prefix
            (``checkpoints/<unit>_<n>``).
        total: iterations of the whole run.
        save_interval: checkpoint every this many iterations (and after the last).
        max_nan_updates: abort after this many skipped (non-finite) updates in a row.
        devices: the cluster's devices, recorded in ``run_info.jsonl``.
        header: lines printed before the first iteration: what runs where (see
            :func:`parameter_counts`, :func:`device_summary`).
        settings: every setting of the job, defaults included
            (:func:`~rlinf_vla.run.checkpoints.settings_of`), written to
            ``configs/settings_<k>.yaml`` for a resume to compare with.
    """

    output_dir: Path
    config: dict[str, Any]
    logging: LoggingConfig
    command: str
    unit: str
    total: int
    save_interval: int
    max_nan_updates: int
    devices: list[str] | None = None
    header: list[str] | None = None
    last_checkpoint: Path | None = None
    settings: dict[str, Any] | None = None

    def run(
        self,
        start: int,
        iteration: Callable[[int, MetricsLogger, Say], dict[str, Any]],
        save: Callable[[int], Path],
        status: Callable[[dict[str, Any]], str],
        before: Callable[[MetricsLogger, Say], str | None] | None = None,
    ) -> Path:
        """Run iterations ``start .. total - 1``; returns the run folder.

        Args:
            start: the first iteration (0, or the resumed checkpoint's).
            iteration: ``iteration(i, logger, say)`` runs iteration ``i`` (0-based) and returns
                its metrics, evaluation included when one is due; the ``logger`` is there for
                artefacts such as videos, the metrics themselves are logged here.
            save: ``save(n)`` writes the checkpoint after ``n`` iterations, returns its folder.
            status: the progress bar's text for an iteration's metrics.
            before: ``before(logger, say)`` runs once before the first iteration (e.g. an
                initial evaluation); the line it returns, if any, is printed.

        Raises:
            TrainingAborted: ``max_nan_updates`` non-finite updates in a row. Whatever
            ``iteration`` or ``save`` raise is re-raised; either way the console names the
            last checkpoint to resume from.
        """
        from rich.console import Console

        changes = self._record_start(start)
        logger = MetricsLogger(
            self.output_dir,
            self.logging,
            run_name=self.output_dir.name,
            resume_iteration=start,
            full_config=self.config,
        )
        console = Console(stderr=True)
        for line in self.header or []:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        console.print(f"run folder: {self.output_dir}", markup=False, highlight=False)
        word = _WORDS.get(self.unit, self.unit)
        if start:
            console.print(f"resuming after {word} {start} of {self.total}", highlight=False)
        if changes:
            provenance.warn(console, changes, "the run started")
        i = start
        try:
            with _Bar(self, console, start, status) as bar:
                line = before(logger, bar.say) if before is not None else None
                if line:
                    bar.console.print(line)
                for i in range(start, self.total):
                    bar.doing = i + 1
                    metrics = iteration(i, logger, bar.say)
                    with self._disk_full_aborts("metrics.jsonl"):
                        logger.log(metrics)
                    bar.done(i + 1, metrics)
                    self._check_finite(metrics, bar.console, i + 1)
                    bar.warn_if_no_update(i + 1, metrics)
                    if (i + 1) % self.save_interval == 0 or i + 1 == self.total:
                        t0 = time.perf_counter()
                        with self._disk_full_aborts(f"the checkpoint of {word} {i + 1}"):
                            self.last_checkpoint = save(i + 1)
                        bar.console.print(
                            _saved_line(self.last_checkpoint, time.perf_counter() - t0),
                            highlight=False,
                            markup=False,
                            soft_wrap=True,
                        )
        except BaseException as e:
            console.print(f"[bold red]training stopped in {word} {i + 1}:[/] {stop_reason(e)}")
            console.print(self.resume_hint(), soft_wrap=True, markup=False, highlight=False)
            raise
        finally:
            logger.close()
        return self.output_dir

    def _record_start(self, start: int) -> list[str]:
        """Write the run folder's configs and this start's line of ``run_info.jsonl``; returns
        what changed since the run started (:func:`rlinf_vla.provenance.record`)."""
        import yaml

        self.output_dir.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(self.config, sort_keys=False)
        first = self.output_dir / "config.yaml"
        if start == 0 or not first.exists():  # a resume keeps the first start's
            first.write_text(text)
        changes = provenance.record(
            self.output_dir, provenance.collect(start=start, devices=self.devices)
        )
        # Each start's own config, numbered as its line in run_info.jsonl (0: the first).
        starts = self.output_dir / "configs"
        starts.mkdir(exist_ok=True)
        number = len(provenance.read(self.output_dir)) - 1
        (starts / f"start_{number}.yaml").write_text(text)
        if self.settings is not None:
            (starts / f"settings_{number}.yaml").write_text(
                yaml.safe_dump(self.settings, sort_keys=False)
            )
        return changes

    @contextlib.contextmanager
    def _disk_full_aborts(self, what: str) -> Iterator[None]:
        """Turn a full disk while writing ``what`` into :class:`RunAborted` naming the run
        folder (instead of an ``OSError`` or torch's "unexpected pos" from a worker)."""
        try:
            yield
        except Exception as e:
            message = disk_full_message(e, self.output_dir, what)
            if message is None:
                raise
            raise RunAborted(message) from e

    def resume_hint(self) -> str:
        """Where the last checkpoint is and how to resume from it."""
        last = self.last_checkpoint or last_checkpoint(self.output_dir, self.unit)
        if last is None:
            return f"no checkpoint was saved yet (run folder: {self.output_dir})"
        return (
            f"last checkpoint: {last}\nresume with: rlinf-vla {self.command} ... "
            f"runner.resume={self.output_dir}"
        )

    def _check_finite(self, metrics: dict[str, Any], console: Any, n: int) -> None:
        word = _WORDS.get(self.unit, self.unit)
        skipped = metrics.get("train/skipped_updates", 0)
        if skipped:
            console.print(
                f"[yellow]warning:[/] {word} {n}: {skipped:.0f} update(s) skipped for a "
                "non-finite loss or gradient"
            )
        streak = metrics.get("train/nan_streak", 0)
        if streak >= self.max_nan_updates:
            raise TrainingAborted(
                f"{streak:.0f} optimizer updates in a row had a non-finite loss or gradient "
                f"(runner.max_nan_updates={self.max_nan_updates}); lower algo.lr, check the "
                "rewards, or resume from an earlier checkpoint"
            )


class _Bar:
    """A run's progress bar: redrawn on a terminal; in a log file (stderr not a terminal) one
    plain line per iteration and one per status shown between them."""

    def __init__(
        self, loop: RunLoop, console: Any, start: int, status: Callable[[dict[str, Any]], str]
    ) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.loop, self.start, self.status = loop, start, status
        self.word = _WORDS.get(loop.unit, loop.unit)
        self.plain = not console.is_terminal
        self.doing = start  # the iteration under way (``start`` before the first)
        self.told: set[str] = set()  # the reasons for iterations without an update, given once
        self.started = time.perf_counter()
        columns = [
            TextColumn(f"[bold]{loop.unit} {{task.completed}}/{{task.total}}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
        ]
        self.progress = Progress(*columns, console=console, disable=self.plain)
        self.console = self.progress.console

    def __enter__(self) -> _Bar:
        self.progress.__enter__()
        self.task = self.progress.add_task(
            self.loop.command, total=self.loop.total, completed=self.start, status=""
        )
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def say(self, text: str) -> None:
        """Show ``text`` as the status of the iteration under way."""
        self.progress.update(self.task, status=text)
        if self.plain:
            self.console.print(
                f"{self.loop.unit} {self.doing}/{self.loop.total}: {text}", markup=False
            )

    def done(self, n: int, metrics: dict[str, Any]) -> None:
        """Iteration ``n`` (1-based) finished with ``metrics``."""
        self.progress.update(self.task, completed=n, status=self.status(metrics))
        if self.plain:
            self.console.print(
                _plain_line(self.loop.unit, n - self.start, n, self.loop.total, self.started)
                + f"  {self.status(metrics)}",
                markup=False,
                highlight=False,
            )

    def warn_if_no_update(self, n: int, metrics: dict[str, Any]) -> None:
        """Say why iteration ``n`` changed nothing, if it did not: in full the first time,
        then its first clause."""
        reason = no_update_reason(metrics)
        if reason:
            short = reason.split(":")[0].split(" (")[0]
            self.console.print(
                f"[yellow]warning:[/] {self.word} {n} did not update the policy: "
                + (short if reason in self.told else reason),
                soft_wrap=True,
            )
            self.told.add(reason)


def no_update_reason(metrics: dict[str, Any]) -> str | None:
    """Why an iteration took no optimizer step (``train/update_steps`` 0), from its metrics,
    or ``None`` when it took one (or its trainer does not count them)."""
    if metrics.get("train/update_steps", 1) != 0:
        return None
    if metrics.get("train/samples", 1) == 0:
        return (
            "no sample entered the loss (every group was dropped, e.g. by dynamic sampling, or "
            "no episode was scored)"
        )
    if metrics.get("train/skipped_zero_advantage", 0):
        return (
            "every advantage was 0: the episodes of each group scored alike (all succeeded or "
            "all failed), so the policy gradient is 0; more envs per group, more "
            "runner.rollout_chunks or a warm start that sometimes succeeds give groups that "
            "differ (train/skipped_zero_advantage counts the minibatches left out)"
        )
    if metrics.get("train/kl_stopped", 0):
        return "the first minibatch's approx_kl exceeded 1.5 x algo.target_kl"
    return "no minibatch was taken (train/update_steps is 0)"


def _plain_line(unit: str, done: int, n: int, total: int, started: float) -> str:
    """``iter 3/10  0:00:42 elapsed, ~0:01:38 left`` for a log file."""
    elapsed = time.perf_counter() - started
    left = elapsed / done * (total - n) if done else 0.0

    def clock(seconds: float) -> str:
        s = int(seconds)
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"

    return f"{unit} {n}/{total}  {clock(elapsed)} elapsed, ~{clock(left)} left"


def _saved_line(path: Path, seconds: float) -> str:
    """``checkpoint <path>: 15.24 GiB written in 41.3 s`` (every file in it; KiB / MiB / GiB)."""
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1024
    units = ["KiB", "MiB", "GiB"]
    while size >= 1024 and len(units) > 1:
        size /= 1024
        units.pop(0)
    return f"checkpoint {path}: {size:.2f} {units[0]} written in {seconds:.1f} s"
