"""Beyond imitation on many tasks: one instruction-conditioned policy for MetaWorld's MT10,
behaviour cloning from a few demonstrations of each task, then RL (PPO or GRPO), scored per
task.

The multi-task part of the study "RL beats imitation" (``benchmarks/beyond_imitation.py`` is
the one-task part, on ManiSkill). One command runs it with the package's own commands (in
this process), prints a per-task table and writes JSON (default
``benchmarks/results/multitask.json``)::

    .venv/bin/python benchmarks/multitask.py                                  # about 85 min
    .venv/bin/python benchmarks/multitask.py --sft-seeds 0 1 --seeds 0 1 2    # the full grid

1. ``rlinf-vla collect``, once per task: ``--demos-per-task`` successful episodes of
   MetaWorld's scripted expert, from the task's configurations 0, 1, ... (reset ids
   ``50 t + c``, ``collect.first_reset_id=50 t``; a configuration the expert fails, such as
   door-open's 2 or peg-insert-side's 5, is replaced by the next one); ten datasets, which
   ``rlinf-vla sft`` trains on together (``data.paths=[...]``).
2. ``rlinf-vla sft`` at each ``--sft-seeds``: behaviour cloning of the tiny OpenVLA-OFT
   (``policy=openvla_oft policy.preset=tiny``; it reads the instruction, one 64 px camera
   and the hand position and gripper opening, ``env.state_mode=proprio``) for
   ``--sft-steps`` steps, evaluated every ``--sft-eval-every`` steps on ``--val-episodes``
   validation scenes (``runner.eval_scenes=validation``); the warm start is the checkpoint
   with the best validation success (``best_checkpoint``).
3. ``rlinf-vla train`` with each of ``--algos`` (``ppo``, the default, and ``grpo``) from each
   warm start at each ``--seeds`` on all ten tasks at once (beyond_imitation's RL recipe, the
   whole policy trained), ``--envs`` envs, ``--max-steps`` steps per episode (150: the expert
   needs 45-105 on average). GRPO scores each env's first episode in groups of ``--group``
   envs that share a scene (with ``--set grpo.env.task_per_env=true`` each group keeps one
   task, so ``--envs 40 --group 4`` gives every task one group an iteration).

Every checkpoint in the table (each warm start, each RL run's last one) is scored by
``rlinf-vla eval`` on ``--trials`` scenes of every task, twice: ``held-out`` and ``check``
scenes. The table gives, per task and averaged over the ten, the mean +- standard deviation
over runs of behaviour cloning and of each algorithm, and each run's gain over its own warm
start (paired by SFT seed, in points). Finished stages are reused from ``--work``, so a second
command with other seeds or algorithms adds runs to the same study (a stage folder made with
other envs, iterations, epochs, minibatches or group size is refused). ``--set
stage.section.key=value`` changes one stage's setting (``collect``, ``sft``, ``ppo``, ``grpo``).

Scenes. A MetaWorld task has only 50 configurations (goal and object positions) per
``env.scene_seed``, and reset id ``r`` picks one of them, so the package's scene blocks
(validation ids from ``2**31 - 2**21``, held-out ids from ``2**31 - 2**20``) and ``rlinf-vla
eval``'s trials (configurations ``0 .. n - 1`` of each task, whatever ``eval.seed``) would
replay the demonstrations' configurations with the default scene seed. Every set of scenes
here therefore has a scene seed of its own (``SCENE_SEEDS``; different seeds draw different
configurations, checked: none of the 50 of seeds 0 and 2 coincide for reach and door-open):

- demonstrations and PPO's training episodes: scene seed 0 (PPO draws all 50 configurations
  of every task, the demonstrated ones among them);
- validation (choosing the warm start): scene seed 1;
- held-out: scene seed 2, configurations ``0 .. --trials - 1`` of every task;
- check: scene seed 3, likewise.

So no scene that chooses or scores a checkpoint shares a configuration with a demonstration
or with PPO's training; validation, held-out and check scenes are disjoint from each other
too. The validation block takes its ids with ``env.reset_id_layout=interleaved`` (task
``r % 10``, configuration ``(r // 10) % 50``): with the default layout its consecutive ids
would hold one or two tasks (40 validation scenes: 4 of window-close, 36 of reach), so the
warm start would be chosen on reach. A PPO run's own evaluations (``--eval-every``, off by
default) run on its training env, scene seed 0: they measure the training configurations.

Reward. Sparse (1 at success, which ends the episode; the time limit is a failure,
``algo.bootstrap_truncated=false``): it is the measure the table reports and has the same
scale in every task. MetaWorld's dense reward (0 .. 10 per step, differently shaped per task)
ends with the episode at success, so an episode that hovers near the goal without meeting
the success test collects more of it than one that succeeds early.

Time on the 2-core machine, measured with ``--seeds 0`` (67 minutes in all): collecting 3.7
minutes, behaviour cloning 42.2 (3000 steps of about 0.8 s, three 40-scene validations, beside
other work; 17.7 alone on the machine), a PPO run
of 30 iterations of 10 envs x 38 chunks 14.6 (25-45 s an iteration; every new episode rebuilds its
worker's simulator for the task it draws), scoring a checkpoint on 2 x 50 scenes about 3 minutes.
``--set ppo.env.task_per_env=true`` keeps each PPO env on one task and draws only its configuration
(no simulator rebuilt between episodes: rollouts about 2.5x faster, docs/envs.md; give it a
``--work`` of its own, since finished stages are reused by name); the figures in
docs/demonstrations.md were measured without it. The default command (one SFT seed, two PPO seeds)
takes about 85 minutes, the full grid (2 SFT seeds x 3 PPO seeds: 2 warm starts, 6 PPO runs, 8
scored checkpoints) about 3.5-4 hours; it can be run in parts, finished stages being reused.
Whether 30 iterations of 10 envs (about 30 episodes per task) are enough for PPO to gain on every
task is what the study measures, not a given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# the helpers of the one-task study beside this file (run as a script, its folder is on the path)
from beyond_imitation import VARIANT_HELP, eval_results, rl_run, summary, warm_start
from maniskill_learning import collect_once, stage_sets, write_results

from rlinf_vla.envs.metaworld.config import MT10, VARIATIONS_PER_TASK

#: ``env.scene_seed`` of each set of scenes (each draws its own 50 configurations per task).
SCENE_SEEDS = {"demos": 0, "validation": 1, "held_out": 2, "check": 3}
MEASURES = ("held_out", "check")


def env_args(
    args: argparse.Namespace, num_envs: int, scenes: str, layout: str = "interleaved"
) -> list[str]:
    """The env's keys: MT10 from one fast-rendered camera and proprioception, the scene seed
    of ``scenes`` (:data:`SCENE_SEEDS`)."""
    return [
        "env=metaworld",
        "env.task_set=MT10",
        f"env.num_envs={num_envs}",
        f"env.image_size={args.image_size}",
        "env.fast_render=true",
        "env.state_mode=proprio",
        "env.reward_mode=sparse",
        f"env.max_episode_steps={args.max_steps}",
        f"env.scene_seed={SCENE_SEEDS[scenes]}",
        f"env.reset_id_layout={layout}",
    ]


def collect_demos(args: argparse.Namespace) -> list[Path]:
    """One dataset per task: ``--demos-per-task`` expert successes from its configurations
    0, 1, ... (a failed one is replaced by the next), each made once."""
    folders = []
    for t, task in enumerate(MT10):
        out = args.work / f"demos{args.demos_per_task}" / task
        collect_once(
            out,
            [
                *env_args(args, 2, "demos", layout="by_task"),
                f"collect.episodes={args.demos_per_task}",
                f"collect.first_reset_id={VARIATIONS_PER_TASK * t}",
                f"collect.max_attempts={args.demos_per_task + 5}",  # within the task's 50
                "collect.fps=80",
                *stage_sets(args, "collect"),
            ],
        )
        folders.append(out)
    return folders


def demo_configurations(folders: list[Path]) -> dict[str, list[int]]:
    """The configurations (scene seed 0) each task's demonstrations start from."""
    configs = {}
    for task, folder in zip(MT10, folders, strict=True):
        kept = json.loads((folder / "meta" / "collect.json").read_text())["reset_ids"]
        configs[task] = [r % VARIATIONS_PER_TASK for r in kept]
    return configs


def per_task(results: dict[str, Any]) -> dict[str, float]:
    """Success rate per task and ``average`` (all trials pooled: the tasks' mean, as every
    task has as many trials) of an ``rlinf-vla eval`` result."""
    rates = {t["task"]: float(t["success_rate"]) for t in results["tasks"]}
    return rates | {"average": float(results["overall"]["success_rate"])}


def scores(args: argparse.Namespace, checkpoint: Path, out: Path) -> dict[str, dict[str, float]]:
    """Per-task greedy success of ``checkpoint`` on the held-out and the check scenes."""
    total = args.trials * len(MT10)
    return {
        m: per_task(
            eval_results(
                env_args(args, args.eval_envs, m),
                checkpoint,
                out / f"eval-{m.replace('_', '-')}",
                args.trials,
                0,  # MetaWorld's trials are configurations 0 .. n - 1; the scene seed picks them
                total,
            )
        )
        for m in MEASURES
    }


def sft_stage(args: argparse.Namespace, demos: list[Path], seed: int) -> dict[str, Any]:
    """The warm start at SFT seed ``seed``: its run, validation curve and chosen checkpoint."""
    out = args.work / f"MT10-demos{args.demos_per_task}-sft{args.sft_steps}-seed{seed}"
    keys = [*env_args(args, args.eval_envs, "validation"), "policy.preset=tiny"]
    return warm_start(args, demos, out, seed, keys)


def rl_stage(
    args: argparse.Namespace, algo: str, warm: dict[str, Any], seed: int
) -> dict[str, Any]:
    """One run of ``algo`` from the warm start ``warm`` at seed ``seed`` (the training scenes)."""
    chunks = math.ceil(args.max_steps / args.chunk)  # one episode's chunk steps per rollout
    env = env_args(args, args.envs, "demos")
    return rl_run(args, algo, warm, seed, env, args.envs, chunks)


def row(task: str, warm: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One task's (or the average's) summaries: BC and each algorithm over their runs, and
    each algorithm's gain in points over each run's own warm start (``ppo_held_out``,
    ``gain_ppo_held_out``, ...)."""
    start = {w["seed"]: w for w in warm}
    out: dict[str, Any] = {"task": task}
    for m in MEASURES:
        out[f"bc_{m}"] = summary([w[m][task] for w in warm])
        for algo in dict.fromkeys(r["algo"] for r in runs):
            mine = [r for r in runs if r["algo"] == algo]
            out[f"{algo}_{m}"] = summary([r[m][task] for r in mine])
            gains = [100 * (r[m][task] - start[r["sft_seed"]][m][task]) for r in mine]
            out[f"gain_{algo}_{m}"] = summary(gains)
    return out


def _cell(s: dict[str, float] | None, points: bool = False) -> str:
    if s is None:
        return "-"
    return f"{s['mean']:+.1f} +- {s['std']:.1f}" if points else f"{s['mean']:.2f} +- {s['std']:.2f}"


def show(rows: list[dict[str, Any]], args: argparse.Namespace, runs: int, warms: int) -> None:
    print(
        f"\nMetaWorld MT10, one policy from pixels + proprio, {args.demos_per_task} demos per "
        f"task: greedy success on {args.trials} held-out and {args.trials} check scenes per "
        f"task; mean +- sd over {warms} BC and {runs} RL run(s) ({len(args.seeds)} seed(s) "
        f"of {', '.join(args.algos)}), gain in points (paired)"
    )
    for algo in args.algos:
        print(f"\n{algo.upper()}")
        head = f"{'task':<26}"
        for m in ("held-out", "check"):
            head += f"{'BC ' + m:<16}{algo.upper() + ' ' + m:<16}{'gain':<16}"
        print(head)
        for r in rows:
            line = f"{r['task']:<26}"
            for m in MEASURES:
                line += f"{_cell(r[f'bc_{m}']):<16}{_cell(r.get(f'{algo}_{m}')):<16}"
                line += f"{_cell(r.get(f'gain_{algo}_{m}'), points=True):<16}"
            print(line)


@contextlib.contextmanager
def timed(times: dict[str, float], stage: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    times[stage] = times.get(stage, 0.0) + time.perf_counter() - t0


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--demos-per-task", type=int, default=5, help="expert successes per task")
    p.add_argument("--sft-steps", type=int, default=3000)
    p.add_argument("--sft-eval-every", type=int, default=1000, help="SFT steps between evaluations")
    p.add_argument("--sft-seeds", type=int, nargs="+", default=[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="RL seeds")
    p.add_argument("--algos", nargs="+", default=["ppo"], choices=("ppo", "grpo"))
    p.add_argument("--ppo-iterations", type=int, default=30)
    p.add_argument("--grpo-iterations", type=int, default=30)
    p.add_argument(
        "--group",
        type=int,
        default=4,
        help="GRPO: envs per group (with env.task_per_env a group's envs share their task)",
    )
    p.add_argument("--envs", type=int, default=10, help="RL's training envs")
    p.add_argument("--epochs", type=int, default=2, help="RL update epochs per iteration")
    p.add_argument(
        "--minibatches", type=int, default=2, help="RL minibatches per epoch (of one rollout)"
    )
    p.add_argument("--max-steps", type=int, default=150, help="env steps per episode")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--chunk", type=int, default=4, help="actions per policy call")
    p.add_argument(
        "--val-episodes",
        dest="eval_episodes",
        type=int,
        default=40,
        help="validation scenes of each SFT evaluation (a multiple of 10: as many per task)",
    )
    p.add_argument("--trials", type=int, default=5, help="held-out and check scenes per task")
    p.add_argument("--eval-envs", type=int, default=2, help="envs of each evaluation")
    p.add_argument(
        "--eval-every", type=int, default=0, help="PPO iterations between its own evaluations"
    )
    p.add_argument("--work", type=Path, default=Path("runs/multitask"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/multitask.json"))
    p.add_argument("--set", action="append", default=[], help="stage.section.key=value")
    p.add_argument("--variant", default="", help=VARIANT_HELP)
    args = p.parse_args()
    if args.eval_episodes % len(MT10) or not 1 <= args.trials <= VARIATIONS_PER_TASK:
        p.error("--val-episodes must be a multiple of 10 and --trials lie in [1, 50]")
    if args.demos_per_task + 5 > VARIATIONS_PER_TASK:
        p.error("--demos-per-task must be at most 45 (a task has 50 configurations)")
    args.head_only = False  # beyond_imitation's PPO recipe trains the whole policy
    return args


def main() -> None:
    args = parse()
    times: dict[str, float] = {}
    with timed(times, "collect"):
        demos = collect_demos(args)
    with timed(times, "sft"):
        warm = [sft_stage(args, demos, s) for s in args.sft_seeds]
    with timed(times, "rl"):
        runs = [rl_stage(args, a, w, seed) for a in args.algos for w in warm for seed in args.seeds]
    with timed(times, "eval"):
        for w in warm:
            w |= scores(args, Path(w["checkpoint"]), Path(w["run_dir"]) / "chosen")
        for r in runs:
            r |= scores(args, Path(r.pop("last")), Path(r["run_dir"]) / "final")
    rows = [row(task, warm, runs) for task in (*MT10, "average")]
    show(rows, args, len(runs), len(warm))
    for w in warm:
        curve = " ".join(f"{r:.2f}@{s}" for s, r in w["validation_curve"])
        print(f"bc seed {w['seed']}: validation {curve}; chose step {w['chosen_step']}")
    print("minutes per stage: " + ", ".join(f"{k} {v / 60:.1f}" for k, v in times.items()))
    results = {
        "config": vars(args) | {"work": str(args.work), "out": str(args.out)},
        "scenes": {"scene_seeds": SCENE_SEEDS, "demo_configurations": demo_configurations(demos)},
        "table": rows,
        "warm_starts": warm,
        "runs": runs,
        "minutes": {k: v / 60 for k, v in times.items()},
    }
    write_results(args.out, results)


if __name__ == "__main__":
    main()
