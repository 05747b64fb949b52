"""Policy-server round-trip latency on loopback, excluding model time; prints a table, writes JSON.

    python benchmarks/serve.py                       # tiny openvla_oft, 2 x 224 px
    python benchmarks/serve.py --requests 1000 --clients 1 4
    python benchmarks/serve.py --policy pi0 --image-size 224 --output /tmp/serve.json

Each client connects, sends ``--warmup`` requests, then ``--requests`` requests with two uint8
cameras of ``--image-size`` px, an 8-d state and an instruction, one at a time. For every
request the client measures the round trip (encode, send, server decode + validation + queue
+ batch + act + encode, receive, decode); the server reports the time spent inside
``policy.act`` (``infer_ms``), and ``overhead = round trip - infer_ms`` is the serving cost the
target (p99 < 20 ms) is about. With several clients, requests that arrive together share one
``act`` call (``mean batch``); their ``queue`` time is mostly waiting for the ``act`` of the
batch ahead of them, which the overhead column then includes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np


def run_case(url: str, clients: int, requests: int, warmup: int, size: int, seed: int) -> dict:
    from rlinf_vla.real_robot.client import PolicyClient

    rng = np.random.default_rng(seed)
    obs = {
        "main": rng.integers(0, 256, (size, size, 3), dtype=np.uint8),
        "wrist": rng.integers(0, 256, (size, size, 3), dtype=np.uint8),
    }
    state = rng.uniform(-1, 1, 8).astype(np.float32)
    conns = [PolicyClient(url) for _ in range(clients)]
    rtt: list[float] = []
    infer: list[float] = []
    queue: list[float] = []
    batch: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    def worker(c) -> None:
        for _ in range(warmup):
            c.infer(obs, state, "pick up the red cube")
        barrier.wait()
        for _ in range(requests):
            t = time.perf_counter()
            _, timing = c.infer(obs, state, "pick up the red cube")
            dt = (time.perf_counter() - t) * 1000.0
            with lock:
                rtt.append(dt)
                infer.append(timing["infer_ms"])
                queue.append(timing["queue_ms"])
                batch.append(timing["batch_size"])

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    for c in conns:
        c.close()
    rtt_a, infer_a = np.array(rtt), np.array(infer)
    over = rtt_a - infer_a
    pct = lambda x, q: float(np.percentile(x, q))  # noqa: E731
    return {
        "clients": clients,
        "requests": len(rtt),
        "image_size": size,
        "request_bytes": int(sum(v.nbytes for v in obs.values()) + state.nbytes),
        "rtt_p50_ms": pct(rtt_a, 50),
        "rtt_p99_ms": pct(rtt_a, 99),
        "infer_p50_ms": pct(infer_a, 50),
        "queue_p50_ms": pct(np.array(queue), 50),
        "overhead_p50_ms": pct(over, 50),
        "overhead_p99_ms": pct(over, 99),
        "overhead_max_ms": float(over.max()),
        "mean_batch": float(np.mean(batch)),
        "requests_per_s": len(rtt) / wall,
    }


def render(rows: list[dict]) -> str:
    head = (
        "| clients | image | request kB | round trip p50 / p99 (ms) | act p50 (ms) | queue p50 (ms) | "
        "overhead p50 / p99 / max (ms) | mean batch | req/s |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r['clients']} | 2 x {r['image_size']} px | {r['request_bytes'] / 1024:.0f} | "
        f"{r['rtt_p50_ms']:.2f} / {r['rtt_p99_ms']:.2f} | {r['infer_p50_ms']:.2f} | {r['queue_p50_ms']:.2f} | "
        f"{r['overhead_p50_ms']:.2f} / {r['overhead_p99_ms']:.2f} / {r['overhead_max_ms']:.2f} | "
        f"{r['mean_batch']:.2f} | {r['requests_per_s']:.0f} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policy", default="openvla_oft", help="registered policy (preset tiny)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=500, help="per client")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--output", default="benchmarks/results/serve.json")
    args = parser.parse_args(argv)

    import torch

    from rlinf_vla.policies import make_policy
    from rlinf_vla.real_robot.server import PolicyServer, ServerConfig

    torch.set_num_threads(1)  # the server's one inference thread; leaves a core to the client
    policy = make_policy(args.policy, preset="tiny", seed=0).eval()
    server = PolicyServer(policy, args.policy, ServerConfig(port=0))
    rows = []
    with server.run_in_thread() as url:
        for n in args.clients:
            rows.append(run_case(url, n, args.requests, args.warmup, args.image_size, seed=n))
    table = render(rows)
    print(f"policy server round trip on loopback ({args.policy} tiny, {os.cpu_count()} CPUs)\n")
    print(table)
    result = {
        "benchmark": "serve",
        "policy": args.policy,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
