"""Channel benchmark: small-message latency and large-tensor throughput versus raw Ray.

Compared in one run, on one local Ray instance:

- small messages: a round trip through a channel (the message travels to the channel actor
  and back) versus a raw actor round trip (``ray.get(actor.echo.remote(msg))``), once as
  ``put`` then ``get`` (two calls) and once as ``exchange`` (put + get in one call, the
  request/response pattern the training pipeline uses between env and rollout workers);
- large tensors (64 MB by default): ``put`` then ``get`` through a channel versus raw
  ``ray.get(ray.put(tensor))``.

Methods alternate call by call, so load from other processes hits them alike; the table
reports medians. Targets: a channel round trip (``exchange``) at most 1.5x the raw actor round
trip; channel throughput at least 80% of raw ``ray.put``/``ray.get``. Separate ``put`` and
``get`` are two Ray calls and are reported next to it.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlinf_vla.bench import register_benchmark
from rlinf_vla.config import check_at_least

LATENCY_TARGET = 1.5
THROUGHPUT_TARGET = 0.8


@dataclass
class ChannelBenchConfig:
    """The ``benchmark`` section for ``benchmark=channel``."""

    name: str = "channel"
    small_messages: int = 1000
    small_payload_bytes: int = 100
    large_mb: int = 64
    large_repeats: int = 8
    rounds: int = 3
    warmup: int = 50

    def __post_init__(self) -> None:
        positive = ("small_messages", "small_payload_bytes", "large_mb", "large_repeats", "rounds")
        check_at_least(self, "benchmark", positive, 1)
        check_at_least(self, "benchmark", ("warmup",), 0)


class _Echo:
    def echo(self, x: Any) -> Any:
        return x


def _interleaved(
    methods: dict[str, Callable[[], Any]], n: int, rounds: int, warmup: int
) -> dict[str, list[float]]:
    """Time ``n * rounds`` calls of each method, alternating methods call by call.

    Alternating at the finest grain makes load from other processes hit every method alike.
    """
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(n * rounds):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return samples


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(
    cfg: ChannelBenchConfig, cluster: Any, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the benchmark on ``cluster``; returns the results (also the JSON written)."""
    import ray
    import torch

    from rlinf_vla.runtime import Channel

    echo = ray.remote(_Echo).options(num_cpus=0).remote()
    unbounded = Channel.create("bench-unbounded")
    bounded = Channel.create("bench-bounded", maxsize=64)
    ray.get(echo.echo.remote(None))

    message = {"step": 0, "payload": b"x" * cfg.small_payload_bytes}
    progress(f"small messages: {cfg.rounds} rounds x {cfg.small_messages} round trips per method")
    small = _interleaved(
        {
            "raw actor call": lambda: ray.get(echo.echo.remote(message)),
            "channel put+get": lambda: (unbounded.put("k", message), unbounded.get("k")),
            "channel put+get (maxsize=64)": lambda: (bounded.put("k", message), bounded.get("k")),
            "channel exchange (put+get in one call)": lambda: unbounded.exchange("k", message, "k"),
        },
        cfg.small_messages,
        cfg.rounds,
        cfg.warmup,
    )
    tensor = torch.ones(cfg.large_mb * 2**20 // 4, dtype=torch.float32)
    mb = tensor.nbytes / 2**20
    progress(
        f"large tensors: {cfg.rounds} rounds x {cfg.large_repeats} transfers of {mb:.0f} MB per method"
    )
    large = _interleaved(
        {
            "raw ray.put+ray.get": lambda: ray.get(ray.put(tensor)),
            "channel put+get": lambda: (unbounded.put("big", tensor), unbounded.get("big")),
        },
        cfg.large_repeats,
        cfg.rounds,
        min(cfg.warmup, 2),
    )
    for ch in (unbounded, bounded):
        ch.close()
    ray.kill(echo)

    raw_lat = statistics.median(small["raw actor call"])
    raw_tp = mb / statistics.median(large["raw ray.put+ray.get"])
    rows = []
    for name, xs in small.items():
        med = statistics.median(xs)
        rows.append(
            {
                "test": "small message round trip",
                "method": name,
                "median_us": med * 1e6,
                "p90_us": _quantile(xs, 0.9) * 1e6,
                "vs_raw": med / raw_lat,
            }
        )
    for name, xs in large.items():
        tp = mb / statistics.median(xs)
        rows.append(
            {
                "test": f"{mb:.0f} MB tensor transfer",
                "method": name,
                "median_ms": statistics.median(xs) * 1e3,
                "throughput_mb_s": tp,
                "vs_raw": tp / raw_tp,
            }
        )
    latency_ratio = statistics.median(small["channel exchange (put+get in one call)"]) / raw_lat
    separate_ratio = statistics.median(small["channel put+get"]) / raw_lat
    throughput_ratio = (mb / statistics.median(large["channel put+get"])) / raw_tp
    return {
        "benchmark": "channel",
        "config": cfg.__dict__,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": cluster.num_devices if cluster.devices[0].kind == "cpu" else None,
            "ray": ray.__version__,
            "torch": torch.__version__,
        },
        "rows": rows,
        "targets": {
            "latency_ratio": latency_ratio,
            "latency_target_max": LATENCY_TARGET,
            "latency_ok": latency_ratio <= LATENCY_TARGET,
            "separate_put_get_ratio": separate_ratio,
            "throughput_ratio": throughput_ratio,
            "throughput_target_min": THROUGHPUT_TARGET,
            "throughput_ok": throughput_ratio >= THROUGHPUT_TARGET,
        },
    }


def render(result: dict[str, Any]) -> str:
    """The results as a Markdown table (printed, and pasted into docs/runtime.md)."""
    lines = [
        "| test | method | median | p90 / throughput | vs raw |",
        "|---|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        if "median_us" in r:
            lines.append(
                f"| {r['test']} | {r['method']} | {r['median_us']:.0f} µs | {r['p90_us']:.0f} µs | {r['vs_raw']:.2f}x |"
            )
        else:
            lines.append(
                f"| {r['test']} | {r['method']} | {r['median_ms']:.1f} ms | {r['throughput_mb_s']:.0f} MB/s | {r['vs_raw']:.2f}x |"
            )
    t = result["targets"]
    lines.append("")
    lines.append(
        f"Channel round trip (exchange) {t['latency_ratio']:.2f}x raw actor call (target <= "
        f"{t['latency_target_max']}x: {'met' if t['latency_ok'] else 'NOT met'}; separate put and get "
        f"{t['separate_put_get_ratio']:.2f}x); channel throughput {t['throughput_ratio']:.0%} of raw "
        f"ray.put/get (target >= {t['throughput_target_min']:.0%}: {'met' if t['throughput_ok'] else 'NOT met'})."
    )
    return "\n".join(lines)


register_benchmark("channel", ChannelBenchConfig, run, render)
