"""Learning on a real simulator: collect -> sft -> PPO / GRPO on ManiSkill3, greedy success.

One command runs the whole recipe with the package's own commands (in this process, each on
its own local Ray instance) and prints a table (JSON too, default
``benchmarks/results/maniskill_learning.json``):

1. ``rlinf-vla collect``: ``--demos`` successful episodes of the task's scripted expert
   (reset ids from 0);
2. ``rlinf-vla sft``: behaviour cloning of a small OpenVLA-OFT for ``--sft-steps`` steps;
3. ``rlinf-vla train algo=ppo`` and ``algo=grpo``, each from the SFT checkpoint, for
   ``--ppo-iterations`` / ``--grpo-iterations`` iterations.

Every success rate is the greedy policy's on the same ``--eval-episodes`` held-out scenes
(reset ids near ``2**31``, never used by a demonstration or by training), with a Wilson 95 %
interval::

    .venv/bin/python benchmarks/maniskill_learning.py                      # PushCube, seed 0
    .venv/bin/python benchmarks/maniskill_learning.py --seed 1             # a second training seed
    .venv/bin/python benchmarks/maniskill_learning.py --task PickCube-v1 --demos 100

The policy is the tiny OpenVLA-OFT preset (0.48 M parameters); it sees one 64 x 64 camera and a privileged state (``env.state_mode=privileged``: the
robot's joints and TCP pose followed by the task's object and goal poses, ManiSkill's own state
observation), which keeps it small enough to learn on a 2-core CPU. ``--set
stage.section.key=value`` changes any setting of one stage (``sft``, ``ppo``, ``grpo``,
``collect``), e.g. ``--set ppo.algo.lr=3e-4``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

from rlinf_vla import cli
from rlinf_vla.eval.stats import wilson_interval
from rlinf_vla.pipelines.tracking import read_metrics


def env_args(args: argparse.Namespace, num_envs: int) -> list[str]:
    return [
        "env=maniskill",
        f"env.task={args.task}",
        f"env.num_envs={num_envs}",
        "env.sim_backend=cpu",
        f"env.image_size={args.image_size}",
        "env.state_mode=privileged",
    ]


def policy_args(args: argparse.Namespace) -> list[str]:
    return ["policy=openvla_oft", f"policy.chunk_size={args.chunk}"]


def common(out: Path, seed: int) -> list[str]:
    return [
        f"runner.output_dir={out}",
        f"runner.seed={seed}",
        "runner.logging.tensorboard=true",
        "cluster.devices_per_node=1",
    ]


def stage_sets(args: argparse.Namespace, stage: str) -> list[str]:
    prefix = f"{stage}."
    return [s.removeprefix(prefix) for s in args.set if s.startswith(prefix)]


def run(command: list[str]) -> float:
    """Run one ``rlinf-vla`` command in this process; returns its wall time."""
    print("+ rlinf-vla " + " ".join(command), flush=True)
    t0 = time.perf_counter()
    code = cli.main(command)
    if code != 0:
        raise SystemExit(f"rlinf-vla {command[0]} failed with exit code {code}")
    return time.perf_counter() - t0


def last_eval(run_dir: Path) -> dict[str, Any]:
    rows = [r for r in read_metrics(run_dir) if r.get("eval/success_rate") is not None]
    return rows[-1]


def evaluations(run_dir: Path) -> list[tuple[int, float]]:
    return [
        (int(r["iteration"]), float(r["eval/success_rate"]))
        for r in read_metrics(run_dir)
        if r.get("eval/success_rate") is not None
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--task", default="PushCube-v1")
    p.add_argument("--demos", type=int, default=40, help="successful expert episodes")
    p.add_argument("--seed", type=int, default=0, help="seed of sft and RL (not of the demos)")
    p.add_argument("--image-size", type=int, default=64, help="camera image side")
    p.add_argument("--chunk", type=int, default=4, help="actions per policy call")
    p.add_argument("--sft-steps", type=int, default=500)
    p.add_argument("--ppo-iterations", type=int, default=40)
    p.add_argument("--grpo-iterations", type=int, default=20)
    p.add_argument("--envs", type=int, default=8, help="training envs (CPU processes)")
    p.add_argument("--eval-episodes", type=int, default=64)
    p.add_argument("--work", type=Path, default=Path("runs/maniskill_learning"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/maniskill_learning.json"))
    p.add_argument("--set", action="append", default=[], help="stage.section.key=value")
    p.add_argument("--skip", nargs="*", default=[], choices=["ppo", "grpo"])
    args = p.parse_args()

    work = args.work / f"{args.task}-seed{args.seed}"
    demos = args.work / f"{args.task}-demos{args.demos}"
    results: dict[str, Any] = {
        "config": vars(args) | {"work": str(args.work), "out": str(args.out)}
    }
    times: dict[str, float] = {}
    if not (demos / "meta" / "info.json").exists():
        times["collect"] = run(
            [
                "collect",
                *env_args(args, 2),
                f"collect.episodes={args.demos}",
                f"collect.output_dir={demos}",
                *stage_sets(args, "collect"),
            ]
        )
    results["collect"] = json.loads((demos / "meta" / "collect.json").read_text())
    results["collect"].pop("config", None)

    sft = work / "sft"
    steps = args.sft_steps
    times["sft"] = run(
        [
            "sft",
            *env_args(args, 8),
            *policy_args(args),
            f"data.paths=[{demos}]",
            f"sft.steps={steps}",
            "sft.lr=3e-4",
            "sft.lr_schedule=linear",  # a constant rate leaves the last checkpoint's success to chance
            "sft.batch_size=64",
            "sft.micro_batch_size=64",
            f"runner.eval_interval={max(1, steps // 4)}",
            "runner.eval_at_start=true",
            f"runner.eval_episodes={args.eval_episodes}",
            f"runner.save_interval={steps}",
            *common(sft, args.seed),
            *stage_sets(args, "sft"),
        ]
    )
    checkpoint = sft / "checkpoints" / f"step_{steps}"
    rows = {"sft": (last_eval(sft), evaluations(sft))}

    for algo, iterations in (("ppo", args.ppo_iterations), ("grpo", args.grpo_iterations)):
        if algo in args.skip:
            continue
        out = work / algo
        extra = ["algo.group_size=4", "env.group_size=4"] if algo == "grpo" else []
        times[algo] = run(
            [
                "train",
                *env_args(args, args.envs),
                "policy=openvla_oft",
                f"policy.checkpoint={checkpoint}",
                f"algo={algo}",
                *extra,
                "algo.lr=1e-5",  # 1e-4 collapses the chunk-level Gaussian (approx_kl 5)
                "runner.rollout_chunks=13",
                f"runner.max_iterations={iterations}",
                f"runner.eval_interval={max(1, iterations // 4)}",
                f"runner.eval_episodes={args.eval_episodes}",
                f"runner.save_interval={iterations}",
                *common(out, args.seed),
                *stage_sets(args, algo),
            ]
        )
        rows[algo] = (last_eval(out), evaluations(out))

    table = []
    n = args.eval_episodes
    start = rows["sft"][1][0][1] if rows["sft"][1] else math.nan
    print(
        f"\n{args.task}, {args.demos} demos, seed {args.seed}: greedy success on {n} held-out scenes"
    )
    print(f"{'stage':<22}{'success':>9}{'95% interval':>18}{'minutes':>9}")
    base = None
    for name, (final, curve) in rows.items():
        rate = float(final["eval/success_rate"])
        lo, hi = wilson_interval(round(rate * n), n) or (math.nan, math.nan)
        label = {"sft": f"sft ({steps} steps)"}.get(name, f"{name} from sft")
        if name == "sft":
            base = rate
            print(f"{'random init (step 0)':<22}{start:>9.3f}{'':>18}{'':>9}")
        delta = "" if name == "sft" else f"  ({100 * (rate - base):+.1f} points)"
        print(
            f"{label:<22}{rate:>9.3f}{f'[{lo:.2f}, {hi:.2f}]':>18}{times[name] / 60:>9.1f}{delta}"
        )
        table.append(
            {
                "stage": name,
                "success": rate,
                "interval": [lo, hi],
                "curve": curve,
                "seconds": times[name],
            }
        )
    if "collect" in times:
        print(f"{'collect':<22}{'':>9}{'':>18}{times['collect'] / 60:>9.1f}")
    print(f"total {sum(times.values()) / 60:.1f} minutes")
    results.update(
        table=table,
        seconds=times,
        machine={"cpus": __import__("os").cpu_count(), "platform": platform.platform()},
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
