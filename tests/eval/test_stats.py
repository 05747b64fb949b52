"""Wilson intervals against hand computations; error trials count as failures in the headline
rate and are left out of the rate over valid trials."""

from __future__ import annotations

import math

import pytest

from rlinf_vla.eval.stats import aggregate, summarize, wilson_interval


def test_wilson_seven_of_ten_by_hand() -> None:
    # p = 0.7, z = 1.96: z^2 = 3.8415, 1 + z^2/n = 1.38415,
    # centre = (0.7 + 0.19207) / 1.38415 = 0.64457,
    # half = 1.96 / 1.38415 * sqrt(0.021 + 0.0096037) = 1.41603 * 0.174939 = 0.24772.
    low, high = wilson_interval(7, 10)
    assert low == pytest.approx(0.3968, abs=1e-4)
    assert high == pytest.approx(0.8922, abs=1e-4)


def test_wilson_edges() -> None:
    # 0 of 50: [0, z^2 / (n + z^2)] = [0, 3.8415 / 53.8415].
    low, high = wilson_interval(0, 50)
    assert low == 0.0 and high == pytest.approx(3.841459 / 53.841459, rel=1e-6)
    low, high = wilson_interval(50, 50)
    assert high == 1.0 and low == pytest.approx(50 / 53.841459, rel=1e-6)
    assert wilson_interval(0, 0) is None
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_interval_narrows_with_n_and_contains_p() -> None:
    widths = []
    for n in (10, 100, 1000):
        low, high = wilson_interval(n // 2, n)
        assert low < 0.5 < high
        widths.append(high - low)
    assert widths[0] > widths[1] > widths[2]
    # For large n it approaches the normal interval p +- z sqrt(p (1 - p) / n).
    assert widths[2] == pytest.approx(2 * 1.96 * math.sqrt(0.25 / 1000), rel=1e-2)


def _t(task: str, success: bool | None, error: str | None = None, suite: str = "s") -> dict:
    return {"suite": suite, "task": task, "task_index": 0, "success": success, "error": error}


def test_errors_count_as_failures_in_the_headline_rate() -> None:
    trials = [
        _t("a", True),
        _t("a", True),
        _t("a", False),
        _t("a", None, "crashed twice"),
        _t("b", True),
        _t("b", None, "crashed twice"),
        _t("c", True, suite="other"),
    ]
    s = summarize(trials[:4])
    assert (s["trials"], s["valid"], s["successes"], s["failures"], s["errors"]) == (4, 3, 2, 1, 1)
    # Headline: 2 successes of 4 trials. Wilson, p = 0.5, n = 4: centre 0.5,
    # half = 1.96 / (1 + 3.8415 / 4) * sqrt(0.25 / 4 + 3.8415 / 64) = 0.99980 * 0.35003.
    assert s["success_rate"] == 0.5
    assert s["ci95"] == pytest.approx([0.150039, 0.849961], abs=1e-6)
    # Errors left out: 2 of 3.
    assert s["success_rate_valid"] == pytest.approx(2 / 3)
    assert s["ci95_valid"] == pytest.approx([0.207660, 0.938508], abs=1e-6)
    agg = aggregate(trials)
    by_task = {t["task"]: t for t in agg["tasks"]}
    assert by_task["b"]["success_rate"] == 0.5 and by_task["b"]["success_rate_valid"] == 1.0
    suite = agg["suites"]["s"]
    assert suite["successes"] == 3 and suite["trials"] == 6 and suite["errors"] == 2
    assert suite["success_rate"] == 0.5 and suite["success_rate_valid"] == 0.75
    assert agg["overall"]["success_rate"] == pytest.approx(4 / 7)
    assert agg["overall"]["success_rate_valid"] == pytest.approx(0.8)
    only_errors = summarize([_t("x", None, "boom")])
    # 0 of 1: [0, z^2 / (1 + z^2)] = [0, 3.841459 / 4.841459].
    assert only_errors["success_rate"] == 0.0
    assert only_errors["ci95"] == pytest.approx([0.0, 0.793451], abs=1e-6)
    assert only_errors["success_rate_valid"] is None and only_errors["ci95_valid"] is None
    assert summarize([])["success_rate"] is None
