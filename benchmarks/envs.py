"""Env throughput: steps/s for several ``num_envs``, image sizes and chunk lengths.

Prints a table and writes JSON (default ``benchmarks/results/envs.json``)::

    python benchmarks/envs.py                      # toy, maniskill, libero
    python benchmarks/envs.py --envs metaworld     # MetaWorld (not in the default set)
    python benchmarks/envs.py --envs toy --seconds 3
    python benchmarks/envs.py --images docs/img    # also save one observation each

Each case builds the env, resets it, warms up with one chunk and then steps zero-action chunks for
``--seconds``. ``env steps/s`` counts every env's steps; ``per env`` divides by ``num_envs`` (for
the subprocess simulators that is the speed of one env process). Chunk length ``K=1`` renders the
cameras at every step; with ``K=8`` only the last step of each chunk is rendered.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import textwrap
import time
from dataclasses import asdict, dataclass

import torch

from rlinf_vla.envs import make_env


@dataclass
class Case:
    env: str
    num_envs: int
    image_size: int
    chunk: int
    config: dict


@dataclass
class Row:
    env: str
    num_envs: int
    image_size: int
    chunk: int
    cameras: int
    config: str
    build_s: float
    env_steps_per_s: float
    per_env_steps_per_s: float


def cases(envs: list[str], quick: bool) -> list[Case]:
    out: list[Case] = []
    if "toy" in envs:
        for n in (1, 16, 64, 256):
            for k in (1, 8):
                out.append(Case("toy", n, 64, k, {}))
        out.append(Case("toy", 64, 128, 1, {}))
    if "maniskill" in envs:
        base = {"task": "PickCube-v1", "sim_backend": "cpu"}
        for s in (128,) if quick else (128, 224):
            for n in (1, 2):
                for k in (1, 8):
                    out.append(Case("maniskill", n, s, k, {**base, "fast_render": True}))
            out.append(Case("maniskill", 1, s, 1, {**base, "fast_render": False}))
        # Two cameras: the Panda with a hand camera.
        wrist = {**base, "robot": "panda_wristcam", "wrist": True}
        for fast in (True, False):
            out.append(Case("maniskill", 1, 128, 1, {**wrist, "fast_render": fast}))
    if "libero" in envs:
        base = {"suite": "libero_spatial", "task_ids": (0,), "settle_steps": 10}
        for n in (1,) if quick else (1, 2):
            for k in (1, 8):
                out.append(Case("libero", n, 128, k, {**base, "fast_render": True}))
        out.append(Case("libero", 1, 128, 1, {**base, "fast_render": False}))
        if not quick:
            out.append(Case("libero", 1, 224, 1, {**base, "fast_render": True}))
    if "metaworld" in envs:
        base = {"task": "pick-place-v3"}
        for n in (1,) if quick else (1, 2):
            for k in (1, 8):
                out.append(Case("metaworld", n, 128, k, {**base, "fast_render": True}))
        for k in (1, 8):
            out.append(Case("metaworld", 1, 128, k, {**base, "fast_render": False}))
        if not quick:
            out.append(Case("metaworld", 1, 224, 1, {**base, "fast_render": True}))
    return out


def run_case(case: Case, seconds: float, image_dir: str | None) -> Row:
    t0 = time.perf_counter()
    env = make_env(case.env, num_envs=case.num_envs, image_size=case.image_size, **case.config)
    build_s = time.perf_counter() - t0
    try:
        obs = env.reset(torch.arange(case.num_envs))
        if image_dir is not None:
            save_observation(obs, os.path.join(image_dir, f"envs_{case.env}.png"))
        actions = torch.zeros(case.num_envs, case.chunk, env.action_dim)
        env.chunk_step(actions)  # warm-up
        steps = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            env.chunk_step(actions)
            steps += case.chunk
        elapsed = time.perf_counter() - t0
    finally:
        env.close()
    rate = steps * case.num_envs / elapsed
    short = {k: v for k, v in case.config.items() if k not in ("sim_backend", "task_ids")}
    return Row(
        env=case.env,
        num_envs=case.num_envs,
        image_size=case.image_size,
        chunk=case.chunk,
        cameras=len(obs.images),
        config=" ".join(f"{k}={v}" for k, v in short.items()),
        build_s=round(build_s, 1),
        env_steps_per_s=round(rate, 1),
        per_env_steps_per_s=round(rate / case.num_envs, 1),
    )


def save_observation(obs, path: str) -> None:
    """Save env 0's cameras side by side, with its instruction underneath, as a PNG."""
    from PIL import Image, ImageDraw

    images = [obs.images[k][0].cpu().numpy() for k in sorted(obs.images, key=lambda k: k != "main")]
    size = 224
    tiles = [Image.fromarray(img).resize((size, size), Image.NEAREST) for img in images]
    lines = textwrap.wrap(obs.instruction[0], width=6 * len(tiles) * size // 36)
    canvas = Image.new("RGB", (size * len(tiles), size + 6 + 14 * len(lines)), (0, 0, 0))
    for i, tile in enumerate(tiles):
        canvas.paste(tile, (i * size, 0))
    draw = ImageDraw.Draw(canvas)
    for j, line in enumerate(lines):
        draw.text((4, size + 3 + 14 * j), line, fill=(255, 255, 255))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    canvas.save(path, optimize=True)


def print_table(rows: list[Row]) -> None:
    head = ("env", "B", "px", "K", "cams", "build s", "env steps/s", "per env", "config")
    lines = [
        (
            r.env,
            r.num_envs,
            r.image_size,
            r.chunk,
            r.cameras,
            r.build_s,
            r.env_steps_per_s,
            r.per_env_steps_per_s,
            r.config,
        )
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    for line in (head, *lines):
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", default="toy,maniskill,libero")
    parser.add_argument("--seconds", type=float, default=10.0, help="timed stepping per case")
    parser.add_argument("--quick", action="store_true", help="fewer simulator cases")
    parser.add_argument("--out", default="benchmarks/results/envs.json")
    parser.add_argument("--images", default=None, help="save one observation per env here")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads of this process (0 = torch's default); on a 2-core machine "
        "shared with simulator subprocesses one thread avoids OpenMP stalls in small ops",
    )
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    envs = [e.strip() for e in args.envs.split(",") if e.strip()]
    rows = []
    saved: set[str] = set()
    for case in cases(envs, args.quick):
        image_dir = args.images if args.images and case.env not in saved else None
        saved.add(case.env)
        try:
            row = run_case(case, args.seconds, image_dir)
        except ImportError as e:
            print(f"skip {case.env}: {e}", file=sys.stderr)
            continue
        rows.append(row)
        print(
            f"{row.env} B={row.num_envs} px={row.image_size} K={row.chunk}: "
            f"{row.per_env_steps_per_s} steps/s per env",
            file=sys.stderr,
            flush=True,
        )
    print_table(rows)
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_average": os.getloadavg(),
            "torch_threads": torch.get_num_threads(),
        },
        "seconds_per_case": args.seconds,
        "rows": [asdict(r) for r in rows],
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
