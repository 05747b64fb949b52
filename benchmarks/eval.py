"""Evaluation throughput: ``rlinf-vla eval`` versus a single-env sequential LIBERO loop.

The baseline is the loop of the official LIBERO evaluation scripts: one simulator in the
evaluating process; for every task and init state reset, set the init state, step the settle
actions, then query the policy whenever its action chunk is used up and step the env one action
at a time (each step renders the cameras, as the official env does) until success or the time
limit. Both sides use the same tiny OpenVLA-OFT checkpoint (random weights, seed 0), the same
tasks and init states, the same LIBERO core (:class:`rlinf_vla.envs.libero.env.LiberoCore`, same
image size and render settings) and one torch thread for the policy. The harness times the whole
``run()`` (Ray start, env workers and simulators, policy load, writing the reports).

Prints a table and writes JSON (default ``benchmarks/results/eval.json``)::

    python benchmarks/eval.py
    python benchmarks/eval.py --task-ids 0 1 --trials 4 --max-steps 60 --num-envs 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

import torch


def baseline(args: argparse.Namespace, ckpt: str) -> dict:
    """The single-env sequential loop; returns wall time and per-trial outcomes."""
    from rlinf_vla.envs.libero.config import LiberoEnvConfig
    from rlinf_vla.envs.libero.env import LiberoCore, suite_tasks
    from rlinf_vla.envs.vector import stack_obs
    from rlinf_vla.policies import make_policy

    start = time.monotonic()
    policy = make_policy("openvla_oft", checkpoint=ckpt, device="cpu").eval()
    all_tasks = suite_tasks(args.suite)
    tasks = tuple(all_tasks[i] for i in args.task_ids)
    cfg = LiberoEnvConfig(
        suite=args.suite,
        task_ids=tuple(args.task_ids),
        image_size=args.image_size,
        fast_render=args.fast_render,
        max_episode_steps=args.max_steps,
    )
    core = LiberoCore(cfg, tasks)
    outcomes = []
    try:
        for pos, task in enumerate(tasks):
            for state in range(args.trials):
                obs = core.reset(50 * pos + state)  # init state + settle steps
                queue: list[torch.Tensor] = []
                success, steps = False, 0
                while steps < args.max_steps:
                    if not queue:
                        with torch.inference_mode():
                            chunk = policy.act(stack_obs([obs]), greedy=True).actions[0]
                        queue = list(chunk.float())
                    obs, _, _, success = core.step(queue.pop(0).numpy(), True)
                    steps += 1
                    if success:
                        break
                outcomes.append((task.name, state, bool(success), steps))
    finally:
        core.close()
    return {"seconds": time.monotonic() - start, "outcomes": outcomes}


def harness(args: argparse.Namespace, ckpt: str, out: str) -> dict:
    from rlinf_vla.cli import compose
    from rlinf_vla.eval import run, validate

    overrides = [
        "env=libero",
        f"env.suite={args.suite}",
        f"env.task_ids=[{','.join(map(str, args.task_ids))}]",
        f"env.num_envs={args.num_envs}",
        f"env.image_size={args.image_size}",
        f"env.fast_render={str(args.fast_render).lower()}",
        f"+env.max_episode_steps={args.max_steps}",
        "policy=openvla_oft",
        f"policy.checkpoint={ckpt}",
        f"eval.trials_per_task={args.trials}",
        f"eval.output_dir={out}",
        "eval.policy_threads=1",
        "eval.progress=false",
        "eval.protocol=package",  # throughput at the chosen size and step limit, not official
        f"cluster.num_cpus={os.cpu_count()}",
    ]
    start = time.monotonic()
    results = run(validate(compose("eval", overrides)))
    seconds = time.monotonic() - start
    outcomes = [
        (t["task"], t["init_state"], bool(t["success"]), t["steps"]) for t in results["trials"]
    ]
    return {"seconds": seconds, "outcomes": outcomes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="libero_spatial")
    parser.add_argument("--task-ids", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--trials", type=int, default=4, help="init states per task")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--num-envs", type=int, default=2, help="parallel envs of the harness")
    parser.add_argument("--no-fast-render", dest="fast_render", action="store_false")
    parser.add_argument("--output", default="benchmarks/results/eval.json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from rlinf_vla.policies import make_policy

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(Path(tmp) / "ckpt")
        make_policy("openvla_oft", preset="tiny", seed=0).save_pretrained(ckpt)
        base = baseline(args, ckpt)
        ours = harness(args, ckpt, str(Path(tmp) / "eval"))

    n = len(base["outcomes"])
    rows = [
        ("single-env sequential loop", 1, base["seconds"], 3600 * n / base["seconds"]),
        ("rlinf-vla eval", args.num_envs, ours["seconds"], 3600 * n / ours["seconds"]),
    ]
    speedup = base["seconds"] / ours["seconds"]
    same = sorted(base["outcomes"]) == sorted(ours["outcomes"])
    lines = [
        f"LIBERO {args.suite} tasks {args.task_ids} x {args.trials} init states = {n} trials, "
        f"max {args.max_steps} steps, {args.image_size} px, fast_render={args.fast_render}, "
        f"tiny OpenVLA-OFT (chunk 8), {os.cpu_count()} cores",
        "",
        "| loop | envs | wall (s) | trials/hour | speedup |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, envs, sec, tph in rows:
        lines.append(f"| {name} | {envs} | {sec:.1f} | {tph:.0f} | {base['seconds'] / sec:.2f}x |")
    lines.append("")
    lines.append(f"same per-trial outcomes (success, steps) in both loops: {same}")
    print("\n".join(lines))
    result = {
        "config": vars(args),
        "machine": {"cores": os.cpu_count(), "platform": platform.platform()},
        "trials": n,
        "baseline": {"seconds": base["seconds"], "trials_per_hour": rows[0][3]},
        "harness": {"seconds": ours["seconds"], "trials_per_hour": rows[1][3]},
        "speedup": speedup,
        "same_outcomes": same,
        "outcomes": {"baseline": base["outcomes"], "harness": ours["outcomes"]},
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
