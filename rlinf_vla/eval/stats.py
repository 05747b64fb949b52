"""Success rates with Wilson score intervals, per task and per suite.

Error trials (a simulator that crashed on every attempt) are reported two ways: the headline
rate counts them as failures (``successes / trials``, as the official loops, which count every
episode they start), and ``success_rate_valid`` leaves them out (``successes / valid``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

#: Two-sided 95% standard normal quantile.
Z95 = 1.959963984540054


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson score interval of a binomial proportion (``None`` when ``n == 0``).

    With ``p = successes / n``::

        centre = (p + z^2 / (2n)) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / (4 n^2))

    Unlike the normal approximation it stays inside ``[0, 1]`` and is not degenerate at
    ``p = 0`` or ``p = 1`` (0 of 50 gives ``[0, 0.071]``).
    """
    if n <= 0:
        return None
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes} must lie in [0, n={n}]")
    p = successes / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(trials: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts, success rate and Wilson 95% interval of some trials.

    A trial with a non-empty ``error`` is an error; otherwise ``success`` decides. Returns
    ``trials`` (all), ``valid`` (successes + failures), ``successes``, ``failures``, ``errors``,
    ``success_rate`` (``successes / trials``: errors count as failures; ``None`` without
    trials) with its ``ci95`` (``[low, high]`` or ``None``), and ``success_rate_valid``
    (``successes / valid``: errors left out; ``None`` without valid trials) with its
    ``ci95_valid``.
    """
    n = successes = errors = 0
    for t in trials:
        n += 1
        if t.get("error"):
            errors += 1
        elif t.get("success"):
            successes += 1
    valid = n - errors
    ci = wilson_interval(successes, n)
    ci_valid = wilson_interval(successes, valid)
    return {
        "trials": n,
        "valid": valid,
        "successes": successes,
        "failures": valid - successes,
        "errors": errors,
        "success_rate": successes / n if n else None,
        "ci95": list(ci) if ci is not None else None,
        "success_rate_valid": successes / valid if valid else None,
        "ci95_valid": list(ci_valid) if ci_valid is not None else None,
    }


def condition(trial: Mapping[str, Any]) -> str:
    """The row a trial counts in: its suite, or ``<suite>/<perturbation>`` for a trial of a
    perturbed (out-of-distribution) variant of the suite."""
    kind = trial.get("perturbation")
    return f"{trial['suite']}/{kind}" if kind else trial["suite"]


def aggregate(trials: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Per-task and per-suite summaries (:func:`summarize`), in the trials' order.

    Returns ``{"tasks": [{suite, perturbation, task, task_index, ...summary}], "suites":
    {suite: summary}, "overall": summary}``. A suite's rate pools its trials (with equal trials
    per task this is the mean of the task rates, the number papers report). Perturbed trials
    count under their own row, ``<suite>/<perturbation>`` (:func:`condition`), never pooled
    with the suite's unperturbed ones; ``overall`` pools every trial.
    """
    by_task: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    by_suite: dict[str, list[Mapping[str, Any]]] = {}
    index: dict[tuple[str, str], int] = {}
    for t in trials:
        key = (condition(t), t["task"])
        by_task.setdefault(key, []).append(t)
        by_suite.setdefault(condition(t), []).append(t)
        index.setdefault(key, int(t.get("task_index", 0)))
    tasks = [
        {
            "suite": ts[0]["suite"],
            "perturbation": ts[0].get("perturbation"),
            "task": name,
            "task_index": index[(c, name)],
            **summarize(ts),
        }
        for (c, name), ts in by_task.items()
    ]
    return {
        "tasks": tasks,
        "suites": {s: summarize(ts) for s, ts in by_suite.items()},
        "overall": summarize(trials),
    }


def compare_ood(trials: list[Mapping[str, Any]], kinds: list[str]) -> list[dict[str, Any]]:
    """In-distribution vs out-of-distribution rows, per suite, in the order of ``kinds``
    (``"none"``: the unperturbed tasks).

    Each row is ``{suite, perturbation, tasks, ...summary}``; a perturbed row also has
    ``in_distribution`` (:func:`summarize` of the unperturbed trials of the same tasks and
    init states, so that both rates cover the same episodes) and ``delta`` (its
    ``success_rate`` minus the in-distribution one), both ``None`` without unperturbed trials.
    """
    rows = []
    suites = list(dict.fromkeys(t["suite"] for t in trials))
    for suite in suites:
        plain = {
            (t["task"], t["init_state"]): t
            for t in trials
            if t["suite"] == suite and not t.get("perturbation")
        }
        for kind in kinds:
            own = [
                t
                for t in trials
                if t["suite"] == suite and (t.get("perturbation") or "none") == kind
            ]
            if not own:
                continue
            row: dict[str, Any] = {
                "suite": suite,
                "perturbation": kind,
                "tasks": len({t["task"] for t in own}),
                **summarize(own),
            }
            if kind != "none":
                same = [plain[k] for t in own if (k := (t["task"], t["init_state"])) in plain]
                base = summarize(same) if same else None
                row["in_distribution"] = base
                row["delta"] = (
                    row["success_rate"] - base["success_rate"]
                    if base is not None and row["success_rate"] is not None
                    else None
                )
            rows.append(row)
    return rows
