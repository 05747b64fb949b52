"""Scoring sampled answers and aggregating them the way reasoning papers report them.

Shared by ``rlinf-vla math-eval`` and the held-out evaluation of ``rlinf-vla math-grpo``
(which is ``avg@1`` of greedy answers). A problem ``i`` has ``n`` samples, ``c_i`` of them
correct; over ``N`` problems::

    avg@n      = 1/N  sum_i  c_i / n
    pass@k     = 1/N  sum_i  1 - C(n - c_i, k) / C(n, k)      (k <= n; Chen et al. 2021)

``pass@k`` is the unbiased estimate of the chance that at least one of ``k`` samples is
correct, computed from all ``n`` samples; ``pass@1`` equals ``avg@n``. Each is a mean over
problems of a per-problem value ``x_i``; its 95 % interval is the normal one from the
standard error over problems::

    mean +- 1.959964 * s / sqrt(N),   s = sqrt( sum_i (x_i - mean)^2 / (N - 1) )

clipped to ``[0, 1]`` (none for ``N = 1``). The problems are the sampled unit: the interval
says how much the score would move on another problem set of the same kind, with the spread
of each problem's own samples included in ``x_i``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rlinf_vla.reasoning.reward import score_response

#: the 97.5 % quantile of the standard normal distribution
Z95 = 1.959963984540054


@dataclass(frozen=True)
class SampleScore:
    """One sampled response, scored.

    Attributes:
        answer: the extracted answer (``None``: no answer found).
        correct: it matches the reference (``math-verify``).
        boxed: it was read from ``\\boxed{}``.
        length: response tokens (with the end token, if any).
        cut: the response hit the new-token limit.
    """

    answer: str | None
    correct: bool
    boxed: bool
    length: int
    cut: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def score_sample(
    text: str, reference: str, length: int, cut: bool, fallback_last_number: bool = True
) -> SampleScore:
    """Score one response with math-grpo's verifier (:func:`~rlinf_vla.reasoning.reward
    .score_response`)."""
    r = score_response(text, reference, fallback_last_number=fallback_last_number)
    return SampleScore(r.answer, r.correct, r.formatted, length, cut)


def pass_at_k(n: int, c: int, k: int) -> float:
    """``1 - C(n - c, k) / C(n, k)``: the chance that ``k`` of ``n`` samples, ``c`` of them
    correct, drawn without replacement, hold at least one correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_interval(values: Sequence[float], z: float = Z95) -> dict[str, Any]:
    """``{"value": mean, "ci95": [low, high] or None}``: the normal interval from the standard
    error of ``values`` (sample standard deviation, ``N - 1``), clipped to ``[0, 1]``."""
    n = len(values)
    if n == 0:
        return {"value": None, "ci95": None}
    mean = sum(values) / n
    if n == 1:
        return {"value": mean, "ci95": None}
    s = math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1))
    half = z * s / math.sqrt(n)
    return {"value": mean, "ci95": [max(0.0, mean - half), min(1.0, mean + half)]}


def pass_ks(n: int) -> list[int]:
    """The ``k`` of the reported ``pass@k``: the powers of two up to ``n``, and ``n``."""
    ks = [2**j for j in range(n.bit_length()) if 2**j <= n]
    return ks if ks[-1] == n else [*ks, n]


def summarize(problems: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """The metrics of scored problems, each a list of its samples (:class:`SampleScore`
    dicts: ``correct``, ``boxed``, ``answer``, ``length``, ``cut``).

    Every problem must have the same number of samples ``n``.

    Returns:
        ``problems`` (N), ``samples_per_problem`` (n), ``avg@n`` and ``pass@k`` for
        :func:`pass_ks` (each ``{"value", "ci95"}``), ``boxed_rate``, ``unparseable_rate``,
        ``cut_at_limit_rate`` and ``mean_length`` over every sample.
    """
    if not problems:
        raise ValueError("no problems to summarize")
    n = len(problems[0])
    if n == 0 or any(len(p) != n for p in problems):
        raise ValueError(
            f"every problem needs the same number (>= 1) of samples, got {sorted({len(p) for p in problems})}"
        )
    correct = [sum(bool(s["correct"]) for s in p) for p in problems]
    out: dict[str, Any] = {"problems": len(problems), "samples_per_problem": n}
    out[f"avg@{n}"] = mean_interval([c / n for c in correct])
    for k in pass_ks(n):
        out[f"pass@{k}"] = mean_interval([pass_at_k(n, c, k) for c in correct])
    samples = [s for p in problems for s in p]
    total = len(samples)
    out["boxed_rate"] = sum(bool(s["boxed"]) for s in samples) / total
    out["unparseable_rate"] = sum(s["answer"] is None for s in samples) / total
    out["cut_at_limit_rate"] = sum(bool(s["cut"]) for s in samples) / total
    out["mean_length"] = sum(s["length"] for s in samples) / total
    return out
