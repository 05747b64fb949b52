"""``rlinf-vla <command> --multirun``: every combination of a sweep, one run after another.

Comma-separated values (``algo=ppo,grpo runner.seed=0,1``) and Hydra's other sweep syntax
(``range(0,3)``, ``choice(...)``) are expanded by Hydra's own basic sweeper into one list of
overrides per run, in Hydra's order. Every run's config is composed and validated before the
first one starts, so a sweep with a bad combination stops with every offending one named. The
runs then go one after another in this process, each in its own folder
``<hydra.sweep.dir>/<n>`` (default ``runs/multirun-<time>``; the command's folder key is set
for it), and a table of results ends the sweep (also written to ``multirun.json`` in the sweep
folder). A failed run does not stop the sweep; Ctrl-C or SIGTERM does.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from rlinf_vla.config import ConfigError, SectionErrors

#: the exit codes that stop a sweep (the user stopped it)
_STOPPED = (130, 143)


def combinations(overrides: Sequence[str]) -> list[list[str]]:
    """One list of overrides per run, as Hydra's basic sweeper orders them.

    Raises:
        ConfigError: an override Hydra's parser rejects.
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from None
    return [list(run) for batch in BasicSweeper.split_arguments(parsed, None) for run in batch]


def multirun(
    name: str,
    folder_key: str,
    overrides: Sequence[str],
    prepare: Callable[[list[str]], Any],
    execute: Callable[[Any], int],
) -> int:
    """Run every combination of ``overrides`` of command ``name``; 0 when every run succeeded,
    1 when one failed, 2 when a combination's config is invalid (nothing ran), or the code
    that stopped it.

    Args:
        folder_key: the key of the folder a run writes (set for each run).
        prepare: a run's overrides -> its validated job, nothing started (raises
            :class:`ConfigError`).
        execute: runs a job, returns its exit code.
    """
    sweep_dir, rest = _sweep_dir(overrides)
    prefix = f"rlinf-vla {name} --multirun"
    try:
        if any(o.partition("=")[0].lstrip("+~") == folder_key for o in rest):
            raise ConfigError(
                f"{folder_key}: the sweep gives each run its own folder under "
                "hydra.sweep.dir; set that instead"
            )
        runs = combinations(rest)
    except ConfigError as e:
        print(f"{prefix}: invalid config: {e}", file=sys.stderr)
        return 2
    jobs, errors = [], SectionErrors()
    for n, combo in enumerate(runs):
        folder = sweep_dir / str(n)
        try:
            jobs.append(prepare([*combo, f"{folder_key}={folder}"]))
        except ConfigError as e:
            errors.add(f"run {n} ({' '.join(combo) or 'the defaults'}): {e}")
    try:
        errors.raise_any()
    except ConfigError as e:
        print(f"{prefix}: invalid config: {e}", file=sys.stderr)
        return 2
    swept = _swept(runs)
    print(f"{prefix}: {len(runs)} run(s) in {sweep_dir}", file=sys.stderr)
    results: list[dict[str, Any]] = []
    for n, (combo, job) in enumerate(zip(runs, jobs, strict=True)):
        print(f"\n[{n + 1}/{len(runs)}] rlinf-vla {name} {' '.join(combo)}", file=sys.stderr)
        t0 = time.perf_counter()
        code = execute(job)
        folder = sweep_dir / str(n)
        results.append(
            {
                "run": n,
                "overrides": combo,
                "swept": [o for o in combo if o.partition("=")[0] in swept],
                "exit_code": code,
                "minutes": (time.perf_counter() - t0) / 60,
                "folder": str(folder),
                "success_rate": last_success(folder),
            }
        )
        if code in _STOPPED:
            break
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "multirun.json").write_text(json.dumps(results, indent=2))
    print(summary(results, len(runs)), file=sys.stderr)
    print(f"results: {sweep_dir / 'multirun.json'}", file=sys.stderr)
    codes = [r["exit_code"] for r in results]
    stopped = [c for c in codes if c in _STOPPED]
    return stopped[0] if stopped else int(any(codes))


def _swept(runs: list[list[str]]) -> set[str]:
    """The keys whose value differs between runs."""
    values: dict[str, set[str]] = {}
    for combo in runs:
        for o in combo:
            key, _, value = o.partition("=")
            values.setdefault(key, set()).add(value)
    return {k for k, v in values.items() if len(v) > 1}


def _sweep_dir(overrides: Sequence[str]) -> tuple[Path, list[str]]:
    """``hydra.sweep.dir`` (default ``runs/multirun-<time>``) and the other overrides."""
    given = [o for o in overrides if o.partition("=")[0].lstrip("+~") == "hydra.sweep.dir"]
    rest = [o for o in overrides if o not in given]
    if given:
        return Path(given[-1].partition("=")[2]), rest
    return Path("runs") / f"multirun-{datetime.now():%Y%m%d-%H%M%S}", rest


def last_success(folder: Path) -> float | None:
    """The last greedy success rate a run recorded: ``eval/success_rate`` in its
    ``metrics.jsonl`` (train, sft) or the overall rate of ``results.json`` (eval)."""
    metrics, results = folder / "metrics.jsonl", folder / "results.json"
    rate = None
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            rate = record.get("eval/success_rate", rate)
    elif results.exists():
        rate = json.loads(results.read_text()).get("overall", {}).get("success_rate")
    return rate


def summary(results: list[dict[str, Any]], total: int) -> str:
    """The sweep's table: one line per run."""
    lines = [f"\nmultirun: {len(results)} of {total} run(s)"]
    lines.append(f"{'run':>4}  {'result':<10}{'minutes':>8}  {'success':>8}  swept")
    for r in results:
        result = "ok" if r["exit_code"] == 0 else f"exit {r['exit_code']}"
        rate = "-" if r["success_rate"] is None else f"{r['success_rate']:.3f}"
        lines.append(
            f"{r['run']:>4}  {result:<10}{r['minutes']:>8.1f}  {rate:>8}  {' '.join(r['swept'])}"
        )
    return "\n".join(lines)
