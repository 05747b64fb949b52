"""The results folder: a durable trial log and the reports built from it.

``trials.jsonl`` gets one JSON line per finished trial, flushed and ``fsync``-ed before the next
trial is scheduled, so an interrupted evaluation loses at most the episodes that were running.
A re-run into the same folder reads it back and skips those trials: a torn last line from a
killed process is dropped, and so is a damaged line inside the file (named in a warning, the
file as it was kept beside it as ``trials.jsonl.damaged``), every valid record kept. The reports are rewritten from the log:

- ``results.json``: the ``protocol``, ``trials`` (sorted by suite, task index, init state),
  per-task and per-suite counts with success rates (errors counted as failures, and over
  valid trials only) and Wilson 95% intervals, ``overall``; nothing in it
  depends on timing or scheduling, so an interrupted-and-resumed run writes the same file as
  an uninterrupted one.
- ``results.csv``: one row per trial.
- ``summary.md``: the per-suite table (the one a paper prints), then the per-task table.

With ``eval.perturbation`` each trial also records its ``perturbation`` (the LIBERO-PRO kind,
``null`` for the unperturbed task) and ``changes`` (what the variant changed in that episode),
rates are kept apart per ``<suite>/<perturbation>``, and ``results.json`` / ``summary.md`` add
the in-distribution vs OOD comparison (``ood``).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from pathlib import Path
from typing import Any

from rlinf_vla.config import ConfigError
from rlinf_vla.eval.stats import aggregate, compare_ood, condition

log = logging.getLogger(__name__)

TRIALS_FILE = "trials.jsonl"
CONFIG_FILE = "eval_config.json"
#: Fields of a trial record, in CSV column order.
FIELDS = (
    "suite",
    "task",
    "task_index",
    "init_state",
    "reset_id",
    "success",
    "steps",
    "error",
    "instruction",
    "video",
    "perturbation",
    "changes",
)


class TrialLog:
    """Append-only JSONL of finished trials in ``folder``."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / TRIALS_FILE
        self.records: dict[tuple[str, str, int, str | None], dict[str, Any]] = {}
        self.dropped: list[int] = []  # line numbers of damaged lines dropped on reading
        self._load()

    @staticmethod
    def key(record: dict[str, Any]) -> tuple[str, str, int, str | None]:
        return (
            record["suite"],
            record["task"],
            int(record["init_state"]),
            record.get("perturbation"),
        )

    def _load(self) -> None:
        if not self.path.exists():
            return
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        kept: list[bytes] = []
        for n, line in enumerate(lines[:-1], start=1):  # after the last newline: incomplete
            try:
                record = json.loads(line)
                key = self.key(record)
            except (ValueError, KeyError, TypeError, AttributeError):
                if line.strip():
                    self.dropped.append(n)
                continue
            self.records[key] = record
            kept.append(line)
        if self.dropped:  # damage inside the file: keep a copy, say which lines went
            damaged = self.path.with_name(self.path.name + ".damaged")
            damaged.write_bytes(raw)
            log.warning(
                "%s: line(s) %s are not trial records and were dropped (the file as it was is "
                "in %s); the other %d records are kept and their trials not run again",
                self.path,
                self.dropped,
                damaged,
                len(self.records),
            )
        if self.dropped or lines[-1]:  # rewrite without them (and without a torn tail)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_bytes(b"".join(line + b"\n" for line in kept))
            os.replace(tmp, self.path)

    def __contains__(self, key: tuple) -> bool:
        """Whether trial ``(suite, task, init_state, perturbation)`` is recorded (a key
        without the perturbation: the unperturbed trial)."""
        return (key if len(key) == 4 else (*key, None)) in self.records

    def __len__(self) -> int:
        return len(self.records)

    def append(self, record: dict[str, Any]) -> None:
        """Write ``record`` durably (flush + fsync) and remember it."""
        line = json.dumps(record, sort_keys=True) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.records[self.key(record)] = record


def check_identity(folder: str | Path, identity: dict[str, Any], write: bool = True) -> None:
    """Check that a used folder holds the same evaluation, or (``write``) record the job's
    identity in a new folder.

    Raises:
        ConfigError: the folder holds results of an evaluation with other settings (the
            differing keys are named).
    """
    path = Path(folder) / CONFIG_FILE
    ident = json.loads(json.dumps(identity))  # as it reads back from JSON
    if path.exists():
        old = json.loads(path.read_text())
        if old != ident:
            diff = sorted(_diff(old, ident))
            raise ConfigError(
                f"eval.output_dir: {folder} holds results of an evaluation with other settings "
                f"(differing: {', '.join(diff)}); pick another eval.output_dir or restore them"
            )
        return
    if not write:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    _atomic_write(path, json.dumps(ident, indent=2, sort_keys=True) + "\n")


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def sort_trials(records: list[dict[str, Any]], order: dict[str, int]) -> list[dict[str, Any]]:
    """Trials sorted by suite (``<suite>/<perturbation>`` for perturbed trials, in ``order``),
    task index, task name and init state."""
    return sorted(
        records,
        key=lambda r: (
            order.get(condition(r), len(order)),
            condition(r),
            r["task_index"],
            r["task"],
            r["init_state"],
        ),
    )


def build_results(records: list[dict[str, Any]], header: dict[str, Any]) -> dict[str, Any]:
    """The content of ``results.json``: ``header`` plus trials and their aggregates."""
    trials = [{k: r.get(k) for k in FIELDS} for r in records]
    stats = aggregate(trials)
    pert = header.get("perturbation")
    if pert:
        stats["ood"] = compare_ood(trials, list(pert["kinds"]))
    return {**header, **stats, "trials": trials}


def write_reports(folder: str | Path, results: dict[str, Any]) -> None:
    """Write ``results.json``, ``results.csv`` and ``summary.md`` (each atomically)."""
    folder = Path(folder)
    _atomic_write(folder / "results.json", json.dumps(results, indent=2) + "\n")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(FIELDS), lineterminator="\n")
    writer.writeheader()
    for t in results["trials"]:
        row = {k: "" if t.get(k) is None else t[k] for k in FIELDS}
        if t.get("changes") is not None:
            row["changes"] = json.dumps(t["changes"], sort_keys=True)
        writer.writerow(row)
    _atomic_write(folder / "results.csv", buf.getvalue())
    _atomic_write(folder / "summary.md", render_summary(results))


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def _ci(ci: list[float] | None) -> str:
    return "n/a" if ci is None else f"[{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def render_summary(results: dict[str, Any]) -> str:
    """``summary.md``: per-suite and per-task success rates (%) with Wilson 95% intervals."""
    lines = [
        f"# Evaluation: {results.get('policy_name', '?')} on {results.get('env_name', '?')}",
        "",
    ]
    if results.get("checkpoint"):
        lines += [f"Checkpoint: `{results['checkpoint']}`", ""]
    planned, done = results.get("planned"), len(results["trials"])
    if planned is not None and done < planned:
        lines += [f"**Incomplete: {done} of {planned} planned trials finished.**", ""]
    proto = results.get("protocol")
    if proto:
        seed = proto.get("scene_seed")
        where = f", scene seed {seed}" if "scene_seed" in proto else ""
        loop = f" (reproduces {proto['reference_loop']})" if proto.get("reference_loop") else ""
        lines += [f"Protocol: {proto['name']}{where}{loop}", ""]
    lines += [
        "Success rate (%) over all trials, error trials (a simulator that crashed on every",
        "attempt) counted as failures, with its Wilson 95% interval; then the rate over valid",
        "trials only (errors left out).",
        "",
        "| Suite | Success (%) | 95% CI | Successes / trials | Excl. errors (%) | Errors |",
        "|---|---:|---|---:|---:|---:|",
    ]
    rows = list(results["suites"].items())
    if len(results["suites"]) > 1:
        rows.append(("**all**", results["overall"]))
    for suite, s in rows:
        lines.append(
            f"| {suite} | {_pct(s['success_rate'])} | {_ci(s['ci95'])} | "
            f"{s['successes']} / {s['trials']} | {_pct(s['success_rate_valid'])} | "
            f"{s['errors']} |"
        )
    lines += [
        "",
        "## Per task",
        "",
        "| Suite | # | Task | Success (%) | 95% CI | Successes / trials | Excl. errors (%) "
        "| Errors |",
        "|---|---:|---|---:|---|---:|---:|---:|",
    ]
    for t in results["tasks"]:
        lines.append(
            f"| {condition(t)} | {t['task_index']} | {t['task']} | {_pct(t['success_rate'])} | "
            f"{_ci(t['ci95'])} | {t['successes']} / {t['trials']} | "
            f"{_pct(t['success_rate_valid'])} | {t['errors']} |"
        )
    errors = [t for t in results["trials"] if t.get("error")]
    if errors:
        lines += ["", "## Errors", ""]
        lines += [
            f"- {condition(t)} / {t['task']} / init state {t['init_state']}: {t['error']}"
            for t in errors
        ]
    if results.get("ood"):
        lines += ["", *_ood_table(results)]
    return "\n".join(lines) + "\n"


def _ood_table(results: dict[str, Any]) -> list[str]:
    """The in-distribution vs OOD section of ``summary.md``."""
    pert = results["perturbation"]
    lines = [f"## In-distribution vs OOD (perturbation seed {pert['seed']})", ""]
    for name, what in (pert.get("what") or {}).items():
        lines.append(
            f"- {name}: {what['changes']}. Scenes: {what['scenes']}. Instruction: "
            f"{what['instruction']}."
        )
    lines += [
        "",
        "Success rate (%) with its Wilson 95% interval (errors as failures). For a perturbation,",
        "the in-distribution rate over the same tasks and init states and the difference",
        "(percentage points).",
        "",
        "| Suite | Perturbation | Tasks | Success (%) | 95% CI | Successes / trials "
        "| In-distribution, same trials (%) | Δ (points) |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in results["ood"]:
        base = r.get("in_distribution")
        same = f"{_pct(base['success_rate'])} {_ci(base['ci95'])}" if base else ""
        delta = "" if r.get("delta") is None else f"{100 * r['delta']:+.1f}"
        label = "none (in-distribution)" if r["perturbation"] == "none" else r["perturbation"]
        lines.append(
            f"| {r['suite']} | {label} | {r['tasks']} | {_pct(r['success_rate'])} | "
            f"{_ci(r['ci95'])} | {r['successes']} / {r['trials']} | {same} | {delta} |"
        )
    skipped = pert.get("skipped") or {}
    if any(skipped.values()):
        lines += ["", "Tasks without a variant under a perturbation (not run with it):", ""]
        lines += [
            f"- {kind}: {s['suite']} task {s['task_index']} ({s['task']}): {s['reason']}"
            for kind, items in skipped.items()
            for s in items
        ]
    return lines
