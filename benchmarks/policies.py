"""``act`` latency and peak memory of every policy family; prints a table and writes JSON.

    python benchmarks/policies.py                        # tiny preset on CPU, batch 1/8/32
    python benchmarks/policies.py --families openvla pi0 --batches 1 8 --repeats 5
    python benchmarks/policies.py --output /tmp/policies.json

With a CUDA GPU the script also runs the ``full`` preset (published sizes, random weights,
bfloat16) at batch 8 and 64 (``--full-batches``; ``--no-full`` skips it). Each family runs in its
own subprocess, so the peak memory of one does not leak into the next:

- CPU: ``peak_rss_mib`` is the process's peak resident memory after the batch (monotonic over
  the batches of a family, which run in increasing order) and ``act_rss_mib`` the part above the
  resident memory right after building the policy;
- CUDA: ``peak_mem_mib`` is ``torch.cuda.max_memory_allocated`` during the timed ``act`` calls.

Results go to ``benchmarks/results/policies.json`` by default.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

FAMILIES = ("openvla", "openvla_oft", "pi0", "pi05")
#: cameras and state size each family reads; LIBERO-like settings.
INPUTS: dict[str, tuple[tuple[str, ...], int | None]] = {
    "openvla": (("main",), None),
    "openvla_oft": (("main", "wrist"), 8),
    "pi0": (("main", "wrist"), 8),
    "pi05": (("main", "wrist"), 8),
}
#: executed chunk sizes: OpenVLA decodes one 7-D action, OFT 8 (LIBERO), π0 5 of its horizon
#: (the tiny π0 horizon is 4).
CHUNK = {"openvla": 1, "openvla_oft": 8, "pi0": 5, "pi05": 5}
TINY_CHUNK = {**CHUNK, "pi0": 4, "pi05": 4}


def _rss_mib() -> float:
    """Peak resident set size of this process in MiB (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def _obs(name: str, batch: int, size: int, device: str) -> Any:
    import torch

    from rlinf_vla.types import Observation

    cameras, state_dim = INPUTS[name]
    g = torch.Generator().manual_seed(0)
    images = {
        k: torch.randint(0, 256, (batch, size, size, 3), generator=g, dtype=torch.uint8).to(device)
        for k in cameras
    }
    state = None if state_dim is None else (torch.rand(batch, state_dim, generator=g) * 2 - 1)
    return Observation(images=images, state=state, instruction=["pick up the red cube"] * batch)


def _run_family(args: dict[str, Any], queue: Any) -> None:
    """Child process: build one family and time ``act`` at each batch size."""
    import torch

    from rlinf_vla.policies import make_policy

    name, preset, device = args["family"], args["preset"], args["device"]
    torch.manual_seed(0)
    try:
        chunk = (CHUNK if preset == "full" else TINY_CHUNK)[name]
        kw: dict[str, Any] = {"preset": preset, "device": device, "chunk_size": chunk}
        if preset == "full" and name.startswith("pi0"):
            kw["num_steps"] = 10  # openpi's inference default
        t0 = time.perf_counter()
        policy = make_policy(name, **kw)
        build_s = time.perf_counter() - t0
        policy.eval()
        params = sum(p.numel() for p in policy.parameters())
        base_rss = _rss_mib()
        size = 224 if preset == "full" else 64
        rows = []
        for batch in args["batches"]:
            obs = _obs(name, batch, size, device)
            for _ in range(args["warmup"]):
                policy.act(obs)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args["repeats"]):
                t = time.perf_counter()
                policy.act(obs)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            row = {
                "family": name,
                "preset": preset,
                "device": device,
                "dtype": str(policy.config.torch_dtype).replace("torch.", ""),
                "batch": batch,
                "chunk": chunk,
                "params_m": round(params / 1e6, 3),
                "build_s": round(build_s, 2),
                "act_ms_median": round(1000 * statistics.median(times), 2),
                "act_ms_min": round(1000 * min(times), 2),
                "actions_per_s": round(batch * chunk / statistics.median(times), 1),
            }
            if device.startswith("cuda"):
                row["peak_mem_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            else:
                row["peak_rss_mib"] = round(_rss_mib(), 1)
                row["act_rss_mib"] = round(_rss_mib() - base_rss, 1)
            rows.append(row)
        queue.put(rows)
    except Exception as e:  # reported in the table instead of aborting the other families
        queue.put([{"family": name, "preset": preset, "device": device, "error": repr(e)}])


def run(
    family: str, preset: str, device: str, batches: list[int], warmup: int, repeats: int
) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = {
        "family": family,
        "preset": preset,
        "device": device,
        "batches": sorted(batches),
        "warmup": warmup,
        "repeats": repeats,
    }
    proc = ctx.Process(target=_run_family, args=(args, queue))
    proc.start()
    rows = queue.get()
    proc.join()
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [
        "family",
        "preset",
        "device",
        "dtype",
        "batch",
        "chunk",
        "params_m",
        "act_ms_median",
        "act_ms_min",
        "actions_per_s",
        "peak_rss_mib",
        "act_rss_mib",
        "peak_mem_mib",
        "error",
    ]
    cols = [c for c in cols if any(c in r for r in rows)]
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    print("-+-".join("-" * widths[c] for c in cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--full-batches", nargs="+", type=int, default=[8, 64])
    parser.add_argument("--no-full", action="store_true", help="skip the full preset on GPU")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", default="benchmarks/results/policies.json")
    args = parser.parse_args(argv)

    import torch

    rows: list[dict[str, Any]] = []
    for fam in args.families:
        rows += run(fam, "tiny", "cpu", args.batches, args.warmup, args.repeats)
    if torch.cuda.is_available() and not args.no_full:
        for fam in args.families:
            rows += run(fam, "full", "cuda", args.full_batches, args.warmup, args.repeats)
    print_table(rows)
    result = {
        "benchmark": "policies.act",
        "host": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "rows": rows,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
