"""Beyond imitation: few-demonstration behaviour cloning trained to its plateau, then PPO, GRPO and
DAgger from it, on ManiSkill3 from the cameras and the robot's proprioception, over seeds.

One command runs the whole study with the package's own commands (in this process) and prints
a table (JSON too, default ``benchmarks/results/beyond_imitation.json``)::

    .venv/bin/python benchmarks/beyond_imitation.py                       # PushCube, 20 demos
    .venv/bin/python benchmarks/beyond_imitation.py --task PickCube-v1 --demos 50
    .venv/bin/python benchmarks/beyond_imitation.py --demos 5 10 20 50 --algos   # BC alone

1. ``rlinf-vla collect``: ``--demos`` successful episodes of the task's scripted expert (reset
   ids from 0; several numbers run the study once for each, and a last table gives behaviour
   cloning's success against the number of demonstrations);
2. ``rlinf-vla sft`` at each ``--sft-seeds``: behaviour cloning for ``--sft-steps`` steps at a
   constant rate, evaluated every ``--sft-eval-every`` steps on ``--eval-episodes`` validation
   scenes (``runner.eval_scenes=validation``); the warm start is the checkpoint with the best
   validation success (``best_checkpoint``), so neither its length nor its choice looks at the
   scenes it is scored on;
3. ``rlinf-vla train`` with each of ``--algos`` (``ppo``, ``grpo``, ``dagger``) from each warm
   start at each of ``--seeds`` (``--algos`` with none: behaviour cloning alone).

Every checkpoint that enters the table (each warm start, each run's last one) is scored by
``rlinf-vla eval`` on two sets of scenes no choice was made on: ``held-out`` (reset ids from
``2**31 - 2**20``, the scenes of the training runs' own evaluations) and ``check`` (ids from
``--check-seed``). A stage's row gives the mean and standard deviation over its runs, the range,
and its gain over the warm start it started from (paired by SFT seed), mean and smallest.

The policy is the tiny OpenVLA-OFT (0.48 M parameters, a Gaussian action head) with one 64 x 64
camera; ``--state proprio`` (the default) gives it the robot's joint positions and TCP pose, as
a VLA sees the world, ``--state privileged`` adds the object and goal poses. Finished stages
are reused from ``--work``, so a second command with other seeds adds runs to the same study;
commands started at once wait for each other where they share a stage (the demonstrations, a
warm start and its scores).
``--set stage.section.key=value`` changes one stage's setting (``collect``, ``sft``, ``ppo``,
``grpo``, ``dagger``); with ``--variant NAME`` the RL runs go to folders of their own (ending in
``-NAME``) beside the warm starts they start from, so that RL recipes are compared on the same
warm starts in one work folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

# the helpers of the privileged-state benchmark beside this file (run as a script, its folder
# is on the path)
from maniskill_learning import (
    collect_once,
    common,
    env_args,
    episode_chunks,
    evaluations,
    run,
    stage_lock,
    stage_sets,
    write_results,
)

from rlinf_vla import cli
from rlinf_vla.pipelines.evaluation import EVAL_RESET_ID_BASE, best_checkpoint
from rlinf_vla.run.checkpoints import latest_config

ALGOS = ("ppo", "grpo", "dagger")

# Settings of each algorithm (the RL ones: those of benchmarks/maniskill_learning.py's
# OpenVLA-OFT recipe, on the whole policy unless --head-only; DAgger: behaviour cloning's rate
# on the whole policy).
HEAD_ONLY = 'policy.trainable_modules="(action_head|value_head|value_encoder|log_std)"'
RECIPE: dict[str, list[str]] = {
    "rl": [
        "policy.clip_greedy=true",  # evaluate the greedy action as the env executes it
        "policy.detach_value_input=true",
        "algo.lr=1e-4",
        "algo.log_std_lr=1e-3",
        "algo.lr_schedule=linear",
        "algo.warmup_iterations=5",
    ],
    "ppo": ["algo.critic_warmup_iterations=3", "algo.bootstrap_truncated=false"],
    "grpo": [],
    # behaviour cloning's rate and batch on the whole policy: 4 passes over each rollout's
    # samples (520 with 40 envs on PushCube), drawn from everything gathered so far
    "dagger": ["policy.clip_greedy=true", "algo.lr=3e-4"],
}
ENVS = {"ppo": 40, "grpo": 80, "dagger": 40}
VARIANT_HELP = (
    "a name for this command's RL settings (its --set values): the RL runs' folders end in "
    "-NAME, so that a variant shares the demonstrations and warm starts of --work with the "
    "study it departs from"
)


def eval_results(
    env: list[str], checkpoint: Path, out: Path, trials: int, first: int, total: int
) -> dict[str, Any]:
    """``rlinf-vla eval`` of ``checkpoint``'s greedy policy on the env ``env``, ``trials`` per
    task from seed ``first``, into ``out`` (an interrupted evaluation resumes, one with its
    ``total`` trials is read back): its ``results.json``."""
    done = out / "results.json"
    with stage_lock(out):
        if not done.exists() or json.loads(done.read_text())["overall"]["trials"] < total:
            run(
                [
                    "eval",
                    *env,
                    "policy=openvla_oft",
                    f"policy.checkpoint={checkpoint}",
                    "policy.clip_greedy=true",
                    f"eval.trials_per_task={trials}",
                    f"eval.seed={first}",
                    f"eval.output_dir={out}",
                    "eval.progress=false",
                ]
            )
    return json.loads(done.read_text())


def score(args: argparse.Namespace, checkpoint: Path, out: Path, first: int) -> float:
    """Greedy success of ``checkpoint`` on ``--eval-episodes`` scenes from reset id ``first``."""
    env = env_args(args, args.eval_envs)
    n = args.eval_episodes
    return float(eval_results(env, checkpoint, out, n, first, n)["overall"]["success_rate"])


def scores(args: argparse.Namespace, checkpoint: Path, out: Path) -> dict[str, float]:
    return {
        "held_out": score(args, checkpoint, out / "eval-held-out", EVAL_RESET_ID_BASE),
        "check": score(args, checkpoint, out / "eval-check", args.check_seed),
    }


def warm_start(
    args: argparse.Namespace, demos: list[Path], out: Path, seed: int, keys: list[str]
) -> dict[str, Any]:
    """Behaviour cloning on ``demos`` at seed ``seed`` into ``out`` (``rlinf-vla sft`` with
    ``keys``, the env's and any others, on the env's validation scenes; a finished run is
    reused), its validation curve and the chosen checkpoint."""
    wall = None
    with stage_lock(out):
        if not (out / "checkpoints" / f"step_{args.sft_steps}").exists():
            wall = run(
                [
                    "sft",
                    *keys,
                    "policy=openvla_oft",
                    f"policy.chunk_size={args.chunk}",
                    f"data.paths=[{','.join(str(d) for d in demos)}]",
                    f"sft.steps={args.sft_steps}",
                    "sft.lr=3e-4",
                    "sft.batch_size=64",
                    "sft.micro_batch_size=64",
                    f"runner.eval_interval={args.sft_eval_every}",
                    "runner.eval_at_start=false",
                    f"runner.eval_episodes={args.eval_episodes}",
                    "runner.eval_scenes=validation",
                    "runner.eval_videos=false",
                    f"runner.save_interval={args.sft_eval_every}",
                    *common(out, seed),
                    *stage_sets(args, "sft"),
                ]
            )
    chosen = best_checkpoint(out, "step")
    print(chosen.notes[0])
    return {
        "seed": seed,
        "run_dir": str(out),
        "checkpoint": str(chosen.path / "policy"),
        "chosen_step": chosen.number,
        "validation_curve": evaluations(out),
        "seconds": wall,
    }


def sft_stage(args: argparse.Namespace, demos: Path, n: int, seed: int) -> dict[str, Any]:
    """The warm start at SFT seed ``seed`` on the ``n`` demonstrations in ``demos``: its run,
    its validation curve, the chosen checkpoint and its scores."""
    name = f"{args.task}-{args.state}-demos{n}-sft{args.sft_steps}-seed{seed}"
    out = args.work / name
    warm = warm_start(args, [demos], out, seed, env_args(args, 8))
    return warm | scores(args, Path(warm["checkpoint"]), out / "chosen")


def check_reuse(out: Path, settings: dict[str, Any]) -> None:
    """Refuse a stage folder that was made with other ``settings`` (dotted keys of the run's
    ``config.yaml`` -> this command's values). A finished stage is reused by its folder's
    name, and a stopped one resumed, but the name does not hold every setting (the PPO
    stage's has neither the envs nor the iterations): without this, a command with
    ``--envs 40`` would report the 10-env run found under the same name."""
    found = latest_config(out)  # the config of the run's last start, if it started
    if found is None:
        return
    made, differ = found[1], []
    for key, want in settings.items():
        got: Any = made
        for part in key.split("."):
            got = got.get(part) if isinstance(got, dict) else None
        if not _same(got, want):
            differ.append(f"{key}={got} there, {want} here")
    if differ:
        raise SystemExit(
            f"{out} was made with other settings ({'; '.join(differ)}): give this study a "
            "--work of its own, or remove that folder"
        )


def _same(got: Any, want: Any) -> bool:
    """Whether a run's config value ``got`` is this command's ``want`` (a value, or the text
    of a ``--set``: ``1e-4`` is 0.0001, ``true`` is True)."""
    if str(got).lower() == str(want).lower():
        return True
    try:
        return float(got) == float(want)
    except (TypeError, ValueError):
        return False


def set_settings(args: argparse.Namespace, stage: str) -> dict[str, str]:
    """The ``--set`` values of ``stage``, by dotted key: a stage folder made without them (a
    sparse-reward run reused by a dense-reward study) is not this command's."""
    return dict(s.split("=", 1) for s in stage_sets(args, stage))


def rl_run(
    args: argparse.Namespace,
    algo: str,
    warm: dict[str, Any],
    seed: int,
    env: list[str],
    envs: int,
    chunks: int,
) -> dict[str, Any]:
    """One run of ``algo`` from the warm start ``warm`` at seed ``seed`` on the env ``env``
    (its keys, with ``envs`` training envs; ``chunks`` chunk steps per rollout), unless
    finished: its record and ``last``, the path of its last checkpoint."""
    recipe = RECIPE["rl"] + [HEAD_ONLY] * args.head_only if algo != "dagger" else []
    variant = f"-{args.variant}" if args.variant else ""
    out = Path(warm["run_dir"] + f"-{algo}{'-head' * args.head_only}{seed}{variant}")
    iterations = getattr(args, f"{algo}_iterations")
    last = out / "checkpoints" / f"iter_{iterations}" / "policy"
    extra = []
    if algo == "grpo":  # GRPO scores each env's first episode: groups of --group envs
        extra = [f"algo.group_size={args.group}", f"env.group_size={args.group}"]
    minibatch = 64 if algo == "dagger" else envs * chunks // args.minibatches
    epochs = 4 if algo == "dagger" else args.epochs
    settings = {
        "env.num_envs": envs,
        "runner.max_iterations": iterations,
        "runner.rollout_chunks": chunks,
        "algo.update_epochs": epochs,
        "algo.minibatch_size": minibatch,
    }
    if algo == "grpo":
        settings["algo.group_size"] = args.group
    with stage_lock(out):
        check_reuse(out, settings | set_settings(args, algo))
        wall = None
        if not last.exists():
            wall = run(
                [
                    "train",
                    *env,
                    "policy=openvla_oft",
                    f"policy.checkpoint={warm['checkpoint']}",
                    f"algo={algo}",
                    *recipe,
                    *extra,
                    f"algo.update_epochs={epochs}",
                    f"algo.minibatch_size={minibatch}",
                    f"algo.micro_batch_size={minibatch}",
                    *RECIPE[algo],
                    f"runner.rollout_chunks={chunks}",
                    f"runner.max_iterations={iterations}",
                    f"runner.eval_interval={args.eval_every}",
                    f"runner.eval_episodes={args.eval_episodes}",
                    f"runner.eval_num_envs={args.eval_envs}",
                    "runner.eval_videos=false",
                    # a stopped run resumes from it
                    f"runner.save_interval={args.eval_every or iterations}",
                    *common(out, seed),
                    *stage_sets(args, algo),
                ]
            )
    return {
        "algo": algo,
        "variant": args.variant,
        "head_only": args.head_only and algo != "dagger",
        "seed": seed,
        "sft_seed": warm["seed"],
        "run_dir": str(out),
        "curve": evaluations(out),
        "held_gib": held_memory(out),
        "seconds": wall,
        "last": str(last),
    }


def held_memory(run_dir: Path) -> float | None:
    """The most a run's workers held together (GiB, ``memory/total_rss_gib`` over its
    iterations); ``None`` for a run that did not log it."""
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    held = [r["memory/total_rss_gib"] for r in rows if "memory/total_rss_gib" in r]
    return round(max(held), 2) if held else None


def train_stage(args: argparse.Namespace, algo: str, warm: dict[str, Any], seed: int) -> dict:
    """One run of ``algo`` from the warm start ``warm`` at seed ``seed``, and its scores."""
    envs = ENVS[algo]
    record = rl_run(args, algo, warm, seed, env_args(args, envs), envs, episode_chunks(args))
    last = Path(record.pop("last"))
    return record | scores(args, last, Path(record["run_dir"]) / "final")


def summary(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "runs": len(values),
    }


def table(
    warm: list[dict[str, Any]], runs: list[dict[str, Any]], head_only: bool
) -> list[dict[str, Any]]:
    """One row per stage: each measure's summary over its runs, and the gain (points) over the
    run's own warm start."""
    start = {w["seed"]: w for w in warm}
    rows = [{"stage": "bc", **{m: summary([w[m] for w in warm]) for m in ("held_out", "check")}}]
    for algo in ALGOS:
        mine = [r for r in runs if r["algo"] == algo]
        if not mine:
            continue
        row: dict[str, Any] = {"stage": algo + "-head" * (head_only and algo != "dagger")}
        for m in ("held_out", "check"):
            row[m] = summary([r[m] for r in mine])
            row[f"{m}_gain"] = summary([100 * (r[m] - start[r["sft_seed"]][m]) for r in mine])
        rows.append(row)
    return rows


def _cell(row: dict[str, Any], m: str) -> str:
    s = row[m]
    return f"{s['mean']:.3f} +- {s['std']:.3f} [{s['min']:.2f}, {s['max']:.2f}]"


def _gain(row: dict[str, Any], m: str) -> str:
    g = row.get(f"{m}_gain")
    return "" if g is None else f"{g['mean']:+.1f} ({g['min']:+.1f})"


def show(rows: list[dict[str, Any]], args: argparse.Namespace, demos: int) -> None:
    n = args.eval_episodes
    print(
        f"\n{args.task} from {args.state} state, {demos} demonstrations: greedy success on "
        f"{n} held-out scenes and {n} check scenes, mean +- sd [min, max] over runs"
    )
    print(f"{'stage':<8}{'runs':>5}  {'held-out':<26}{'gain (min)':<18}{'check':<26}gain (min)")
    for row in rows:
        print(
            f"{row['stage']:<8}{row['held_out']['runs']:>5}  {_cell(row, 'held_out'):<26}"
            f"{_gain(row, 'held_out'):<18}{_cell(row, 'check'):<26}{_gain(row, 'check')}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--task", default="PushCube-v1")
    p.add_argument("--state", default="proprio", choices=["proprio", "privileged"])
    p.add_argument(
        "--demos", type=int, nargs="+", default=[20], help="successful expert episodes (each)"
    )
    p.add_argument("--sft-steps", type=int, default=3000)
    p.add_argument("--sft-eval-every", type=int, default=500, help="SFT steps between evaluations")
    p.add_argument("--sft-seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="RL / DAgger seeds")
    p.add_argument("--algos", nargs="*", default=list(ALGOS), choices=ALGOS)
    p.add_argument("--ppo-iterations", type=int, default=40)
    p.add_argument("--grpo-iterations", type=int, default=40)
    p.add_argument("--dagger-iterations", type=int, default=20)
    p.add_argument("--group", type=int, default=5, help="GRPO: envs per group")
    p.add_argument("--epochs", type=int, default=2, help="RL update epochs per iteration")
    p.add_argument(
        "--minibatches", type=int, default=2, help="RL minibatches per epoch (of one rollout)"
    )
    p.add_argument(
        "--head-only",
        action="store_true",
        help="RL trains the action head, value head and log-std only (the privileged-state "
        "benchmark's recipe); by default every weight trains, the vision encoder too",
    )
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--chunk", type=int, default=4, help="actions per policy call")
    p.add_argument("--eval-episodes", type=int, default=64)
    p.add_argument("--eval-envs", type=int, default=4, help="envs of each evaluation")
    p.add_argument("--eval-every", type=int, default=20, help="iterations between evaluations")
    p.add_argument("--check-seed", type=int, default=1_000_000)
    p.add_argument("--work", type=Path, default=Path("runs/beyond_imitation"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/beyond_imitation.json"))
    p.add_argument("--set", action="append", default=[], help="stage.section.key=value")
    p.add_argument("--variant", default="", help=VARIANT_HELP)
    p.add_argument("--plot", action="store_true", help="draw each run's curves (PNG)")
    args = p.parse_args()

    t0 = time.perf_counter()
    studies = [study(args, n) for n in args.demos]
    if len(studies) > 1:
        show_by_demos(studies, args)
    minutes = (time.perf_counter() - t0) / 60
    print(f"total {minutes:.1f} minutes")
    results = {
        "config": vars(args) | {"work": str(args.work), "out": str(args.out)},
        "studies": studies,
        "minutes": minutes,
    }
    write_results(args.out, results)


def study(args: argparse.Namespace, n: int) -> dict[str, Any]:
    """The study with ``n`` demonstrations: collect, the warm starts, the runs, their table."""
    demos = args.work / f"{args.task}-demos{n}"
    collect_once(demos, [*env_args(args, 2), f"collect.episodes={n}", *stage_sets(args, "collect")])
    warm = [sft_stage(args, demos, n, s) for s in args.sft_seeds]
    runs = [
        train_stage(args, algo, w, seed) for w in warm for algo in args.algos for seed in args.seeds
    ]
    rows = table(warm, runs, args.head_only)
    show(rows, args, n)
    for algo in args.algos:
        held = [r["held_gib"] for r in runs if r["algo"] == algo and r["held_gib"] is not None]
        if held:  # what a machine needs for one run (add them up for runs at once)
            print(f"{algo}: a run's workers held at most {max(held):.1f} GiB")
    for w in warm:
        curve = " ".join(f"{r:.2f}@{s}" for s, r in w["validation_curve"])
        print(f"bc seed {w['seed']}: validation {curve}; chose step {w['chosen_step']}")
    if args.plot:
        for r in [*warm, *runs]:
            cli.main(["plot", r["run_dir"]])
    return {"demos": n, "table": rows, "warm_starts": warm, "runs": runs}


def show_by_demos(studies: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Behaviour cloning's success against the number of demonstrations: its best validation
    point and its held-out and check scores, mean +- sd over the SFT seeds."""
    print(
        f"\n{args.task}: behaviour cloning against the number of demonstrations "
        f"({len(args.sft_seeds)} SFT seed(s), {args.sft_steps} steps, the best of its "
        "validation points)"
    )
    print(f"{'demos':>5}  {'best validation':<18}{'held-out':<30}check")
    for st in studies:
        warm = st["warm_starts"]
        best = summary([max(r for _, r in w["validation_curve"]) for w in warm])
        bc = st["table"][0]
        print(
            f"{st['demos']:>5}  {best['mean']:.3f} +- {best['std']:.3f}    "
            f"{_cell(bc, 'held_out'):<30}{_cell(bc, 'check')}"
        )


if __name__ == "__main__":
    main()
