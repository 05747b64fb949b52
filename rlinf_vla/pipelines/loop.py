"""The loop shell the trainers share (``rlinf-vla train`` and ``rlinf-vla math-grpo``).

A trainer supplies what one iteration does, how to save a checkpoint and what its progress bar
shows; :class:`RunLoop` does the rest, the same way for every command:

- writes ``config.yaml`` into the run folder, appends this start's software and machine to
  ``run_info.jsonl`` (:mod:`rlinf_vla.provenance`; a resumed run prints what changed since the
  run started) and opens the :class:`MetricsLogger` (which, on a
  resumed run, truncates ``metrics.jsonl`` back to the checkpoint);
- shows a progress bar (iterations done, the trainer's status line, time remaining);
- logs each iteration's metrics, warns about skipped non-finite updates and aborts after
  ``max_nan_updates`` of them in a row;
- saves a checkpoint every ``save_interval`` iterations and after the last one;
- when the run stops early (an error, a crashed worker, Ctrl-C), prints the last checkpoint and
  the command that resumes from it, then re-raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlinf_vla import provenance
from rlinf_vla.config import RunAborted
from rlinf_vla.pipelines.tracking import LoggingConfig, MetricsLogger, last_checkpoint

__all__ = ["RunLoop", "TrainingAborted"]

#: ``say(text)``: show ``text`` as the progress bar's status (e.g. during an evaluation).
Say = Callable[[str], None]

_WORDS = {"iter": "iteration", "step": "step"}


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
    last_checkpoint: Path | None = None

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
        import yaml
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(yaml.safe_dump(self.config, sort_keys=False))
        changes = provenance.record(
            self.output_dir, provenance.collect(start=start, devices=self.devices)
        )
        logger = MetricsLogger(
            self.output_dir,
            self.logging,
            run_name=self.output_dir.name,
            resume_iteration=start,
            full_config=self.config,
        )
        console = Console(stderr=True)
        if changes:
            provenance.warn(console, changes, "the run started")
        columns = [
            TextColumn(f"[bold]{self.unit} {{task.completed}}/{{task.total}}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
        ]
        i = start
        try:
            with Progress(*columns, console=console) as progress:
                task = progress.add_task(self.command, total=self.total, completed=start, status="")

                def say(text: str) -> None:
                    progress.update(task, status=text)

                line = before(logger, say) if before is not None else None
                if line:
                    progress.console.print(line)
                for i in range(start, self.total):
                    metrics = iteration(i, logger, say)
                    logger.log(metrics)
                    progress.update(task, completed=i + 1, status=status(metrics))
                    self._check_finite(metrics, progress.console, i + 1)
                    if (i + 1) % self.save_interval == 0 or i + 1 == self.total:
                        self.last_checkpoint = save(i + 1)
        except BaseException as e:
            word = _WORDS.get(self.unit, self.unit)
            console.print(f"[bold red]training stopped in {word} {i + 1}:[/] {type(e).__name__}")
            console.print(self.resume_hint(), soft_wrap=True, markup=False, highlight=False)
            raise
        finally:
            logger.close()
        return self.output_dir

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
