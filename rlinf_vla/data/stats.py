"""Feature statistics in LeRobot's layout (``meta/stats.json`` and the per-episode
``stats/<feature>/<stat>`` columns).

Each feature gets ``min``, ``max``, ``mean``, ``std`` (population), ``count`` (number of frames,
shape ``[1]``) and the quantiles ``q01 q10 q50 q90 q99`` (LeRobot's list). Vectors ``[N, D]``
get ``[D]`` arrays (scalars ``[N]`` get ``[1]``); RGB images get one value per channel, shape
``[3, 1, 1]``, in ``[0, 1]`` (pixel / 255).

These are exact: quantiles are ``np.quantile``'s (linear interpolation) over all frames, and
image statistics come from an exact per-channel histogram of every pixel of every frame.
(LeRobot estimates quantiles from 5000-bin histograms, subsamples images, and merges episodes'
quantiles by taking their min or max; the values agree to that approximation.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "QUANTILES",
    "ImageStats",
    "aggregate_stats",
    "stats_from_json",
    "stats_to_json",
    "vector_stats",
]

#: LeRobot's quantiles and their keys.
QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}


def vector_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """Statistics over the first axis of ``[N]`` or ``[N, D]`` values."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    if x.shape[0] == 0:
        raise ValueError("statistics need at least one frame")
    stats = {
        "min": x.min(axis=0),
        "max": x.max(axis=0),
        "mean": x.mean(axis=0),
        "std": x.std(axis=0),
        "count": np.array([x.shape[0]], dtype=np.int64),
    }
    q = np.quantile(x, list(QUANTILES.values()), axis=0)
    for i, key in enumerate(QUANTILES):
        stats[key] = q[i]
    return stats


class ImageStats:
    """Exact per-channel statistics of ``uint8 [T, H, W, 3]`` frames, accumulated as a
    256-bin histogram per channel (so episodes merge without approximation)."""

    def __init__(self) -> None:
        self.hist = np.zeros((3, 256), dtype=np.int64)
        self.frames = 0

    def update(self, frames: np.ndarray) -> None:
        for c in range(3):
            self.hist[c] += np.bincount(frames[..., c].ravel(), minlength=256)
        self.frames += len(frames)

    def merge(self, other: ImageStats) -> None:
        self.hist += other.hist
        self.frames += other.frames

    def result(self) -> dict[str, np.ndarray]:
        """The statistics, shape ``[3, 1, 1]`` each (``count``: ``[1]``, frames), in [0, 1]."""
        if self.frames == 0:
            raise ValueError("statistics need at least one frame")
        values = np.arange(256, dtype=np.float64) / 255.0
        n = self.hist.sum(axis=1).astype(np.float64)  # pixels per channel
        mean = (self.hist * values).sum(axis=1) / n
        var = (self.hist * (values[None, :] - mean[:, None]) ** 2).sum(axis=1) / n
        present = self.hist > 0
        stats = {
            "min": values[present.argmax(axis=1)],
            "max": values[255 - present[:, ::-1].argmax(axis=1)],
            "mean": mean,
            "std": np.sqrt(var),
        }
        cum = np.cumsum(self.hist, axis=1)
        for key, q in QUANTILES.items():
            stats[key] = np.array(
                [_hist_quantile(cum[c], values, q) for c in range(3)], dtype=np.float64
            )
        out = {k: v.reshape(3, 1, 1) for k, v in stats.items()}
        out["count"] = np.array([self.frames], dtype=np.int64)
        return out


def _hist_quantile(cum: np.ndarray, values: np.ndarray, q: float) -> float:
    """``np.quantile`` (linear) of the sorted sample whose cumulative histogram is ``cum``."""
    n = int(cum[-1])
    pos = q * (n - 1)
    lo = int(np.floor(pos))
    hi = min(lo + 1, n - 1)
    # sorted[k] is the smallest value whose cumulative count exceeds k
    v_lo = values[np.searchsorted(cum, lo, side="right")]
    v_hi = values[np.searchsorted(cum, hi, side="right")]
    return float(v_lo + (pos - lo) * (v_hi - v_lo))


def aggregate_stats(per_episode: Sequence[dict[str, dict[str, np.ndarray]]]) -> dict:
    """Merge per-episode statistics (for datasets that only store those, like v2.1's
    ``episodes_stats.jsonl``): exact ``min``, ``max``, count-weighted ``mean`` and ``std``;
    quantiles are bounded the way LeRobot does it (the min of the episodes' lower quantiles,
    the max of their upper ones)."""
    keys = {k for s in per_episode for k in s}
    out: dict[str, dict[str, np.ndarray]] = {}
    for key in sorted(keys):
        items = [s[key] for s in per_episode if key in s]
        counts = np.array([float(np.ravel(s["count"])[0]) for s in items])
        means = np.stack([s["mean"] for s in items])
        w = counts.reshape((-1,) + (1,) * (means.ndim - 1))
        total = counts.sum()
        mean = (means * w).sum(axis=0) / total
        var = ((np.stack([s["std"] for s in items]) ** 2 + (means - mean) ** 2) * w).sum(0) / total
        agg = {
            "min": np.min(np.stack([s["min"] for s in items]), axis=0),
            "max": np.max(np.stack([s["max"] for s in items]), axis=0),
            "mean": mean,
            "std": np.sqrt(var),
            "count": np.array([int(total)], dtype=np.int64),
        }
        for q in QUANTILES:
            if all(q in s for s in items):
                stacked = np.stack([s[q] for s in items])
                agg[q] = stacked.min(axis=0) if QUANTILES[q] <= 0.5 else stacked.max(axis=0)
        out[key] = agg
    return out


def stats_to_json(stats: dict[str, dict[str, np.ndarray]]) -> dict:
    """Nested lists (``json.dump``-able)."""
    return {f: {k: np.asarray(v).tolist() for k, v in s.items()} for f, s in stats.items()}


def stats_from_json(raw: dict) -> dict[str, dict[str, np.ndarray]]:
    """Arrays (at least 1-D) from ``stats.json``'s nested lists."""
    return {
        f: {k: np.atleast_1d(np.asarray(v)) for k, v in s.items()}
        for f, s in raw.items()
        if isinstance(s, dict)
    }
