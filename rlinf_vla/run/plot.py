"""``rlinf-vla plot <run dir>``: learning curves of a training run as one PNG.

Reads ``<run>/metrics.jsonl`` and draws one panel per metric against environment steps (a
``train`` run: success rate and return from training episodes, the greedy evaluation when the
run has one, the PPO losses, KL and clip fraction, and the throughput; the supervised loss
of an ``sft`` or DAgger run) or against sampled
responses (a ``math-grpo`` run: accuracy, held-out accuracy, reward, response length); both
with the workers' memory, where a leak or a creep towards out-of-memory shows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rlinf_vla.run.tracking import read_metrics

#: The worker groups whose memory the trainers log (``memory/<group>_*``).
_GROUPS = ("env", "rollout", "reward", "actor")

# (panel title, metrics drawn in it)
PANELS: list[tuple[str, list[str]]] = [
    (
        "success rate",
        ["env/success_rate", "env/first_episode_success_rate", "eval/success_rate"],
    ),
    ("episode return", ["env/episode_return", "eval/episode_return"]),
    ("policy loss", ["train/policy_loss"]),
    # behaviour cloning (sft) and DAgger: the policy's own supervised loss
    ("supervised loss", ["train/loss"]),
    ("DAgger: policy vs expert action error", ["dagger/action_error"]),
    ("value loss", ["train/value_loss"]),
    ("entropy", ["train/entropy"]),
    ("approx. KL / clip fraction", ["train/approx_kl", "train/clip_fraction"]),
    ("gradient norm", ["train/grad_norm"]),
    ("env steps / s", ["throughput/env_steps_per_s"]),
    ("accuracy", ["reward/accuracy", "eval/accuracy"]),
    ("reward", ["reward/mean"]),
    ("response length (tokens)", ["response/length_mean", "eval/response_length"]),
    ("generated tokens / s", ["throughput/tokens_per_s"]),
    ("resident memory (GiB)", [f"memory/{g}_rss_gib" for g in _GROUPS] + ["memory/total_rss_gib"]),
    ("GPU memory peak (GiB)", [f"memory/{g}_gpu_peak_gib" for g in _GROUPS]),
]


def _x_key(rows: list[dict[str, Any]]) -> str:
    """What the curves are drawn against: env steps, sampled responses, or iterations."""
    for key in ("env_steps", "samples"):
        if any(key in row for row in rows):
            return key
    return "iteration"


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    x_key = _x_key(rows)
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            xs.append(float(row.get(x_key, row["iteration"])))
            ys.append(float(value))
    return xs, ys


def drawn_panels(rows: list[dict[str, Any]]) -> list[tuple[str, list[tuple[str, list, list]]]]:
    """The panels with something to draw: ``(title, [(metric, xs, ys), ...])``."""
    return [
        (title, [(k, *_series(rows, k)) for k in keys])
        for title, keys in PANELS
        if any(_series(rows, k)[0] for k in keys)
    ]


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Render the learning curves of ``run_dir`` to ``output`` (default ``<run>/curves.png``).

    Panels whose metrics the run never logged (e.g. the value loss of a GRPO run) are left out.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``metrics.jsonl``.
        ValueError: the file has no rows yet.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{Path(run_dir) / 'metrics.jsonl'} has no rows yet")
    panels = drawn_panels(rows)
    x_key = _x_key(rows)
    cols = 2
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(11, 3.2 * nrows), squeeze=False)
    for ax, (title, curves) in zip(axes.flat, panels, strict=False):
        for key, xs, ys in curves:
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3, label=key)
        ax.set_title(title)
        ax.set_xlabel(
            {"env_steps": "env steps", "samples": "sampled responses"}.get(x_key, "iteration")
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"{Path(run_dir).resolve().name}: {len(rows)} iterations")
    fig.tight_layout()
    out = Path(output) if output else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
