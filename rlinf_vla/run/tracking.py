"""Where a run's metrics go: ``metrics.jsonl`` always, TensorBoard and wandb when enabled.

One :class:`MetricsLogger` per run. ``metrics.jsonl`` holds one JSON object per iteration
(the record a resumed run truncates back to its checkpoint); TensorBoard event files go to
``<run>/tensorboard/``; wandb runs offline unless an API key is configured, so a run never
blocks on a login prompt.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlinf_vla.config import ConfigError

log = logging.getLogger(__name__)


@dataclass
class LoggingConfig:
    """The ``runner.logging`` section.

    Attributes:
        tensorboard: write TensorBoard event files to ``<run>/tensorboard/``.
        wandb: log to Weights & Biases as well (needs the ``wandb`` package).
        wandb_project: the wandb project.
        wandb_mode: ``auto`` (online when an API key is configured, offline otherwise),
            ``online`` or ``offline``. Offline runs can be uploaded later with ``wandb sync``.
    """

    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "rlinf-vla"
    wandb_mode: str = "auto"

    def __post_init__(self) -> None:
        if self.wandb_mode not in ("auto", "online", "offline"):
            raise ConfigError(
                f"runner.logging.wandb_mode must be auto, online or offline, got {self.wandb_mode!r}"
            )


def _wandb_mode(requested: str) -> str:
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


def run_folder(name: str, output_dir: str | None, resume: str | None) -> Path:
    """A run's folder: the resumed one, ``output_dir``, or ``runs/<name>-<timestamp>``."""
    from datetime import datetime

    if resume:
        return Path(resume)
    if output_dir:
        return Path(output_dir)
    return Path("runs") / f"{name}-{datetime.now():%Y%m%d-%H%M%S}"


def check_writable(folder: str | Path, key: str) -> None:
    """``ConfigError`` naming ``key`` unless a file can be created, written and deleted in
    ``folder`` (made if missing; folders made only for the probe are removed again), so that
    a read-only or full disk fails before any worker starts."""
    folder = Path(folder)
    made = []  # the folders the probe creates, deepest first
    p = folder
    while not p.exists() and p != p.parent:
        made.append(p)
        p = p.parent
    probe = folder / f".rlinf-vla-write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        with contextlib.suppress(OSError):
            probe.unlink()
        reason = e.strerror or str(e)
        raise ConfigError(
            f"{key}: cannot write to {str(folder)!r} ({reason}); choose a writable folder with "
            "free space"
        ) from None
    finally:
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir()


def disk_full_message(error: BaseException, folder: Path, what: str) -> str | None:
    """A clear message when ``error`` (an exception, possibly a worker's with its traceback
    as text) comes from a full disk or an exhausted quota while writing ``what`` into
    ``folder``; ``None`` for any other error. Torch's zip writer reports a short write as
    "unexpected pos N vs M", which is counted as a full disk too."""
    chain, seen = [], error
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    full = any(
        isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain
    ) or any(
        m in str(e)
        for e in chain
        for m in ("No space left on device", "Disk quota exceeded", "unexpected pos")
    )
    if not full:
        return None
    try:
        free = f"{shutil.disk_usage(folder).free / 2**20:.0f} MiB free there now"
    except OSError:
        free = "its free space is unknown"
    return (
        f"no space left on the device of {folder} while writing {what} ({free}): free some "
        "space (or move the run folder to a larger disk), then resume"
    )


def check_resumable(resume: str | None, prefix: str) -> None:
    """``runner.resume`` names a run folder with a complete checkpoint (``ConfigError`` if not),
    so that a run that cannot resume fails before any worker starts."""
    if resume is None:
        return
    if not os.path.isdir(resume):
        raise ConfigError(f"runner.resume: {resume!r} is not a run folder")
    if last_checkpoint(Path(resume), prefix) is None:
        raise ConfigError(
            f"runner.resume: {resume!r} has no complete checkpoint "
            f"(checkpoints/{prefix}_N with a COMPLETE file): the run stopped before its first "
            "save; start it again instead"
        )


def resolve_resume(resume: str | None, output_dir: str | None, prefix: str) -> str | None:
    """``runner.resume`` as the run folder to continue, or ``None`` to start afresh.

    ``auto`` continues ``runner.output_dir`` when it holds a complete checkpoint and starts it
    otherwise, so that one command line serves the first start and every restart (a job
    requeued after a preemption). Any other value must be a resumable run folder
    (:func:`check_resumable`). Without ``runner.resume``, an ``output_dir`` that already holds
    a run (metrics or checkpoints) is refused: starting afresh would overwrite them.
    """
    for key, value in (("output_dir", output_dir), ("resume", resume)):
        if value is not None and not str(value).strip():
            raise ConfigError(
                f"runner.{key} is empty: name a folder, or leave it null"
                + (" (runs/<name>-<time>)" if key == "output_dir" else "")
            )
    if resume is None:
        if output_dir:
            _check_not_a_run(Path(output_dir), prefix)
        return None
    if resume != "auto":
        check_resumable(resume, prefix)
        return resume
    if not output_dir:
        raise ConfigError(
            "runner.resume=auto continues runner.output_dir when it has a checkpoint: set "
            "runner.output_dir too"
        )
    return output_dir if last_checkpoint(Path(output_dir), prefix) is not None else None


def _check_not_a_run(folder: Path, prefix: str) -> None:
    """``ConfigError`` if ``folder`` holds a run's metrics or checkpoints."""
    held = []
    metrics = folder / "metrics.jsonl"
    if metrics.is_file():
        rows = sum(1 for line in metrics.read_text().splitlines() if line.strip())
        if rows:
            held.append(f"{rows} row(s) in metrics.jsonl")
    saved = sorted((folder / "checkpoints").glob(f"{prefix}_*"))
    last = last_checkpoint(folder, prefix)
    if saved:
        held.append(
            f"checkpoints up to {last.name}" if last else f"{len(saved)} incomplete checkpoint(s)"
        )
    if held:
        fix = (
            "continue it with runner.resume=auto, or choose another runner.output_dir"
            if last
            else "it has no complete checkpoint to continue from: choose another runner.output_dir"
        )
        raise ConfigError(
            f"runner.output_dir: {str(folder)!r} already holds a run ({', '.join(held)}), "
            f"which a fresh start would overwrite; {fix} (or delete that folder first)"
        )


def complete_checkpoints(run_dir: Path, prefix: str = "iter") -> list[Path]:
    """The complete ``<run_dir>/checkpoints/<prefix>_N`` folders (each holding a ``COMPLETE``
    marker, written last), oldest first."""
    done = sorted(
        (int(p.name.rsplit("_", 1)[1]), p)
        for p in (Path(run_dir) / "checkpoints").glob(f"{prefix}_*")
        if (p / "COMPLETE").exists()
    )
    return [p for _, p in done]


def last_checkpoint(run_dir: Path, prefix: str = "iter") -> Path | None:
    """The newest complete checkpoint folder of a run (see :func:`complete_checkpoints`)."""
    done = complete_checkpoints(run_dir, prefix)
    return done[-1] if done else None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``<run_dir>/metrics.jsonl`` (one dict per iteration, in order); a torn last
    row is left out (see :func:`parse_metrics`)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a training run folder?")
    return [row for _, row in parse_metrics(path)]


def parse_metrics(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The non-empty lines of a ``metrics.jsonl`` with their rows.

    A last line that is not JSON is a row the run was writing when it stopped (a full disk, a
    killed process): it is dropped with a warning, so that the run can resume. A bad line
    before the last one is damage this cannot repair.

    Raises:
        ValueError: a line other than the last is not a JSON object (naming the line).
    """
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if i == len(lines) - 1:
                log.warning(
                    "%s: dropped its last row, which was cut off while being written (%s): %.80s",
                    path,
                    e,
                    line,
                )
                break
            raise ValueError(f"{path}: row {i + 1} is not a JSON object ({e})") from None
        rows.append((line, row))
    return rows


class MetricsLogger:
    """Appends iteration metrics to ``metrics.jsonl`` and mirrors them to TensorBoard/wandb.

    Args:
        run_dir: the run folder.
        config: the ``runner.logging`` section.
        run_name: the wandb run name.
        resume_iteration: a resumed run's checkpoint iteration; rows logged after it (by the
            interrupted run) are dropped so the file reads as one uninterrupted run.
        full_config: the resolved config, stored with the wandb run.
    """

    def __init__(
        self,
        run_dir: Path,
        config: LoggingConfig,
        run_name: str,
        resume_iteration: int = 0,
        full_config: dict[str, Any] | None = None,
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists():
            rows = parse_metrics(self.path)
            kept = [line for line, row in rows if row.get("iteration", 0) <= resume_iteration]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file = self.path.open("a")
        self._tb = None
        self._wandb = None
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_iteration + 1)
        if config.wandb:
            try:
                import wandb
            except ImportError:
                raise RuntimeError(
                    "runner.logging.wandb=true needs the wandb package: pip install wandb "
                    "(or install rlinf-vla with the [wandb] extra)"
                ) from None
            self._wandb = wandb.init(
                project=config.wandb_project,
                name=run_name,
                dir=str(run_dir),
                mode=_wandb_mode(config.wandb_mode),
                config=full_config or {},
                resume="allow",
                id=run_name.replace("/", "-"),
            )

    def log(self, metrics: dict[str, Any]) -> None:
        """Record one iteration's metrics (``metrics["iteration"]`` is the step)."""
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        step = int(metrics["iteration"])
        scalars = {
            k: float(v)
            for k, v in metrics.items()
            if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self._tb is not None:
            for k, v in scalars.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def log_video(self, tag: str, path: Path, step: int) -> None:
        """Attach an MP4 written by the evaluation to wandb (TensorBoard keeps scalars only)."""
        if self._wandb is not None:
            import wandb

            self._wandb.log({tag: wandb.Video(str(path), format="mp4")}, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
