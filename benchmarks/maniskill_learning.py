"""Learning on a real simulator: collect -> sft -> PPO / GRPO on ManiSkill3, greedy success.

One command runs the whole recipe with the package's own commands (in this process, each on
its own local Ray instance) and prints a table (JSON too, default
``benchmarks/results/maniskill_learning.json``):

1. ``rlinf-vla collect``: ``--demos`` successful episodes of the task's scripted expert
   (reset ids from 0);
2. ``rlinf-vla sft``: behaviour cloning of a small policy for ``--sft-steps`` steps;
3. ``rlinf-vla train algo=ppo`` and ``algo=grpo``, each from the SFT checkpoint, for
   ``--ppo-iterations`` / ``--grpo-iterations`` iterations.

Every success rate is the greedy policy's on the same ``--eval-episodes`` held-out scenes
(reset ids near ``2**31``, never used by a demonstration or by training), with a Wilson 95 %
interval. The column ``check`` evaluates each stage's final checkpoint once more with
``rlinf-vla eval`` on as many other scenes (seeds from ``--check-seed``), which no run chose
a checkpoint by (the two measures of the same checkpoint differ by up to +-0.1 on 64 episodes;
π0's greedy action also starts from noise drawn per observation)::

    .venv/bin/python benchmarks/maniskill_learning.py                 # PushCube, seed 0
    .venv/bin/python benchmarks/maniskill_learning.py --seed 1        # a second training seed
    .venv/bin/python benchmarks/maniskill_learning.py --policy pi0    # the tiny π0
    .venv/bin/python benchmarks/maniskill_learning.py --policy smolvla   # the tiny SmolVLA

The policy is a tiny preset (``--policy``: OpenVLA-OFT by default, 0.48 M parameters, whose
RL stages train its Gaussian action head, the value head and the log-std; or π0 (0.17 M) or
SmolVLA (0.44 M), with Flow-SDE sampling); it sees one 64 x 64 camera and a privileged state
(``env.state_mode=privileged``: the robot's joints and TCP pose followed by the task's object
and goal poses, ManiSkill's own state observation), which keeps it small enough to learn on a
2-core CPU. The SFT length and the RL settings of each policy are in ``RECIPES``
(docs/experiments/ has the runs that chose them). ``--set stage.section.key=value`` changes
any setting of one stage (``sft``, ``ppo``, ``grpo``, ``collect``), e.g. ``--set
ppo.algo.lr=3e-4``. ``--plot`` draws each run's curves (``rlinf-vla plot``) next to its run
folder.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlinf_vla import cli
from rlinf_vla.eval.stats import wilson_interval
from rlinf_vla.run.tracking import read_metrics

# What each policy family needs beyond the common settings: its section for sft and train, the
# envs of the SFT's evaluation, and its RL keys (common to PPO and GRPO, then per algorithm).
RECIPES: dict[str, dict[str, Any]] = {
    "pi0": {
        "policy": ["policy=pi0", "policy.preset=tiny"],
        "sft_envs": 4,
        "sft_steps": 1000,  # 0.67 greedy from 200 demonstrations
        "rl": [
            "policy.logprob_granularity=token",  # one ratio per denoising step and action
            "policy.detach_value_input=true",  # the value loss does not move the expert
            # Flow-SDE noise: at 0.5 (the default) over 3 denoising steps the trained sampler is
            # far from the ODE policy that is evaluated, and held-out success did not move
            "policy.noise_level=0.2",
        ],
        # a rate decaying to 0 settles the last checkpoint (the learning tests' finding); a
        # warm-up of it keeps AdamW's first steps (every weight moved by about lr) from
        # throwing the warm start off (GRPO at seed 1 lost 25 points in 10 iterations without)
        "ppo": [
            "algo.lr=1e-4",
            "algo.lr_schedule=linear",
            "algo.warmup_iterations=5",
            "algo.critic_warmup_iterations=3",
            # the time limit is terminal: a push stuck until it scores 0, as GRPO scores it,
            # instead of the critic's value of the stuck state; PPO then learns to recover
            # (seeds 0-2: +12.0 / +12.5 on average -> +12.5 / +15.1; experiments/...-learning-10)
            "algo.bootstrap_truncated=false",
        ],
        "grpo": ["algo.lr=1e-4", "algo.lr_schedule=linear", "algo.warmup_iterations=5"],
    },
    "openvla_oft": {
        "policy": ["policy=openvla_oft"],
        "sft_envs": 8,
        # greedy 0.20 after 1000 steps, 0.48 after 1500 (room left for RL); a 3000-step run
        # passed 0.95 by its step 1500 (docs/experiments/2026-11-28-maniskill-learning-13.md)
        "sft_steps": 1500,
        "rl": [
            "policy.clip_greedy=true",  # evaluate the greedy action as the env executes it
            'policy.trainable_modules="(action_head|value_head|log_std)"',
            "policy.detach_value_input=true",
            "algo.lr=1e-4",  # Adam moves the head's output by about lr x fan-in per step
            "algo.log_std_lr=1e-3",
            # as π0's: warmed up over 5 iterations, decaying to 0
            "algo.lr_schedule=linear",
            "algo.warmup_iterations=5",
        ],
        "ppo": ["algo.critic_warmup_iterations=3", "algo.bootstrap_truncated=false"],
        "grpo": [],
    },
}
# SmolVLA: the same flow-matching RL as pi0 (FlowMatchingPolicy), so pi0's recipe unchanged
RECIPES["smolvla"] = {**RECIPES["pi0"], "policy": ["policy=smolvla", "policy.preset=tiny"]}


# Training envs per algorithm (``--envs`` sets both), chosen on π0's runs. GRPO learns from
# the groups whose episodes differ: 16 groups per update gained 19-25 points at RL seeds 0 and
# 1, where 8 gained -5 to 17. PPO with 80 envs gained more at two seeds and lost 14 at the
# third on the check, where 40 gained 9-16 at all three
# (docs/experiments/2026-11-28-maniskill-learning-9.md).
ENVS = {"ppo": 40, "grpo": 80}


def env_args(args: argparse.Namespace, num_envs: int) -> list[str]:
    """The env's keys; the state is ``args.state`` where a caller has one (privileged here)."""
    return [
        "env=maniskill",
        f"env.task={args.task}",
        f"env.num_envs={num_envs}",
        "env.sim_backend=cpu",
        f"env.image_size={args.image_size}",
        f"env.state_mode={getattr(args, 'state', 'privileged')}",
    ]


def policy_args(args: argparse.Namespace) -> list[str]:
    return [*RECIPES[args.policy]["policy"], f"policy.chunk_size={args.chunk}"]


def common(out: Path, seed: int) -> list[str]:
    # runner.resume=auto: a stage that was stopped (a crash, the machine's memory) continues
    # from its last checkpoint, with the same rollouts and updates as one that ran through
    return [
        f"runner.output_dir={out}",
        "runner.resume=auto",
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


@contextlib.contextmanager
def stage_lock(folder: Path) -> Iterator[None]:
    """Hold the stage that writes ``folder`` for this command: a second command that reaches the
    same stage (two seeds' commands started at once both collect the demonstrations, or score
    the same warm start) waits here, then finds the stage finished and reuses it, instead of
    writing into the same folder at once. The lock is ``folder`` + ``.lock`` beside it, held
    with ``flock``, so a command that dies lets go of it."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another command to finish {folder} ...", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def collect_once(out: Path, keys: list[str]) -> None:
    """``rlinf-vla collect`` with ``keys`` into ``out``, unless a finished dataset is there (a
    command that reaches it while another collects waits, then reuses it)."""
    with stage_lock(out):
        if not (out / "meta" / "info.json").exists():
            run(["collect", *keys, f"collect.output_dir={out}"])


def write_results(path: Path, results: dict[str, Any]) -> None:
    """Write a study's ``results`` as JSON to ``path``, with the machine it ran on."""
    results["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")


def evaluations(run_dir: Path) -> list[tuple[int, float]]:
    """``(iteration or step, greedy success)`` of every evaluation of a run."""
    return [
        (int(r.get("iteration", r.get("step", 0))), float(r["eval/success_rate"]))
        for r in read_metrics(run_dir)
        if r.get("eval/success_rate") is not None
    ]


def episode_chunks(args: argparse.Namespace) -> int:
    """Chunk steps that hold one whole episode of the task (its registered time limit)."""
    from rlinf_vla.envs import env_config

    steps = env_config("maniskill", task=args.task, sim_backend="cpu").episode_steps() or 100
    return math.ceil(steps / args.chunk)


def train_command(args: argparse.Namespace, algo: str, checkpoint: Path, out: Path) -> list[str]:
    recipe, iterations = RECIPES[args.policy], getattr(args, f"{algo}_iterations")
    chunks = episode_chunks(args)
    if algo == "grpo":
        # GRPO scores each env's first episode: one episode per env, groups of --group envs.
        rollout = chunks
        extra = [f"algo.group_size={args.group}", f"env.group_size={args.group}"]
    else:
        rollout = args.ppo_rollouts * chunks  # one episode length: ~60 episodes with 40 envs
        extra = []
    envs = args.envs or ENVS[algo]
    minibatch = args.minibatch or envs * rollout // 2
    return [
        "train",
        *env_args(args, envs),
        *RECIPES[args.policy]["policy"],
        f"policy.checkpoint={checkpoint}",
        f"algo={algo}",
        *recipe["rl"],
        *recipe[algo],
        *extra,
        f"algo.update_epochs={args.epochs}",
        f"algo.minibatch_size={minibatch}",
        f"algo.micro_batch_size={minibatch}",
        f"runner.rollout_chunks={rollout}",
        f"runner.max_iterations={iterations}",
        f"runner.eval_interval={args.eval_every}",
        f"runner.eval_episodes={args.eval_episodes}",
        f"runner.eval_num_envs={args.eval_envs}",
        "runner.eval_videos=false",
        f"runner.save_interval={iterations}",
        *common(out, args.seed),
        *stage_sets(args, algo),
    ]


def check(args: argparse.Namespace, checkpoint: Path, out: Path) -> dict[str, Any]:
    """``rlinf-vla eval`` of one checkpoint on ``--eval-episodes`` other held-out scenes (seeds
    from ``--check-seed``): a second measure that no training run has looked at."""
    done = out / "results.json"
    if not done.exists() or json.loads(done.read_text())["overall"]["trials"] < args.eval_episodes:
        # rlinf-vla eval resumes an interrupted evaluation from the trials it recorded
        run(
            [
                "eval",
                *env_args(args, args.eval_envs),
                *RECIPES[args.policy]["policy"],
                f"policy.checkpoint={checkpoint}",
                f"eval.trials_per_task={args.eval_episodes}",
                f"eval.seed={args.check_seed}",
                f"eval.output_dir={out}",
                "eval.progress=false",
            ]
        )
    return json.loads((out / "results.json").read_text())["overall"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--task", default="PushCube-v1")
    p.add_argument("--policy", default="openvla_oft", choices=sorted(RECIPES))
    p.add_argument("--demos", type=int, default=200, help="successful expert episodes")
    p.add_argument("--seed", type=int, default=0, help="seed of PPO and GRPO")
    p.add_argument("--sft-seed", type=int, default=0, help="seed of the SFT warm start")
    p.add_argument("--image-size", type=int, default=64, help="camera image side")
    p.add_argument("--chunk", type=int, default=4, help="actions per policy call")
    own = ", ".join(f"{name} {recipe['sft_steps']}" for name, recipe in RECIPES.items())
    p.add_argument("--sft-steps", type=int, default=None, help=f"default: the policy's ({own})")
    p.add_argument("--ppo-iterations", type=int, default=40)
    p.add_argument("--grpo-iterations", type=int, default=40)
    p.add_argument(
        "--envs",
        type=int,
        default=None,
        help="training envs (in as many processes as cores); default: PPO 40, GRPO 80",
    )
    p.add_argument("--group", type=int, default=5, help="GRPO: envs per group")
    p.add_argument(
        "--ppo-rollouts", type=int, default=1, help="PPO: episode lengths of chunks per iteration"
    )
    p.add_argument("--epochs", type=int, default=2, help="update epochs per iteration")
    p.add_argument(
        "--minibatch",
        type=int,
        default=None,
        help="chunk steps per optimizer step; default: half of an iteration's",
    )
    p.add_argument("--eval-episodes", type=int, default=64)
    p.add_argument("--eval-envs", type=int, default=4, help="envs of the greedy evaluation")
    p.add_argument("--eval-every", type=int, default=20, help="iterations between evaluations")
    p.add_argument(
        "--check-seed", type=int, default=1_000_000, help="first seed of the final check's scenes"
    )
    p.add_argument("--work", type=Path, default=Path("runs/maniskill_learning"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/maniskill_learning.json"))
    p.add_argument("--set", action="append", default=[], help="stage.section.key=value")
    p.add_argument("--skip", nargs="*", default=[], choices=["ppo", "grpo"])
    p.add_argument("--plot", action="store_true", help="draw each run's curves (PNG)")
    args = p.parse_args()
    if args.sft_steps is None:
        args.sft_steps = RECIPES[args.policy]["sft_steps"]

    # Demonstrations and the warm start are made once and shared by the RL seeds.
    demos = args.work / f"{args.task}-demos{args.demos}"
    sft = (
        args.work
        / f"{args.task}-{args.policy}-demos{args.demos}-sft{args.sft_steps}-seed{args.sft_seed}"
    )
    work = sft.with_name(f"{sft.name}-rl{args.seed}")
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

    steps = args.sft_steps
    checkpoint = sft / "checkpoints" / f"step_{steps}" / "policy"
    if not checkpoint.exists():
        times["sft"] = run(
            [
                "sft",
                *env_args(args, RECIPES[args.policy]["sft_envs"]),
                *policy_args(args),
                f"data.paths=[{demos}]",
                f"sft.steps={steps}",
                "sft.lr=3e-4",
                "sft.lr_schedule=linear",  # a constant rate leaves the last checkpoint's success to chance
                "sft.batch_size=64",
                "sft.micro_batch_size=64",
                f"runner.eval_interval={max(1, steps // 2)}",
                "runner.eval_at_start=true",
                f"runner.eval_episodes={args.eval_episodes}",
                "runner.eval_videos=false",
                f"runner.save_interval={steps}",
                *common(sft, args.sft_seed),
                *stage_sets(args, "sft"),
            ]
        )
    runs, finals = {"sft": sft}, {"sft": checkpoint}
    for algo in ("ppo", "grpo"):
        if algo not in args.skip:
            runs[algo] = work / algo
            last = getattr(args, f"{algo}_iterations")
            finals[algo] = runs[algo] / "checkpoints" / f"iter_{last}" / "policy"
            if not finals[algo].exists():  # a finished run is reused (e.g. to add its check)
                times[algo] = run(train_command(args, algo, checkpoint, runs[algo]))
    # the warm start's check is shared by every RL seed
    checks = {
        name: check(args, path, sft / "check" if name == "sft" else work / f"check-{name}")
        for name, path in finals.items()
    }

    n = args.eval_episodes
    curves = {name: evaluations(path) for name, path in runs.items()}
    start = curves["sft"][-1][1]
    print(
        f"\n{args.task}, {args.policy}, {args.demos} demos, seed {args.seed}: "
        f"greedy success on {n} held-out scenes"
    )
    print(f"{'stage':<22}{'success':>9}{'95% interval':>18}{'check':>8}{'minutes':>9}   curve")
    if curves["sft"][0][0] == 0:  # the SFT's evaluation before its first step
        print(f"{'random init (step 0)':<22}{curves['sft'][0][1]:>9.3f}")
    table = []
    for name, curve in curves.items():
        rate = curve[-1][1]
        lo, hi = wilson_interval(round(rate * n), n) or (math.nan, math.nan)
        label = f"sft ({steps} steps)" if name == "sft" else f"{name} from sft"
        delta = "" if name == "sft" else f"{100 * (rate - start):+.1f} points"
        shown = " ".join(f"{r:.2f}@{i}" for i, r in curve)
        again = checks[name]["success_rate"]
        if name != "sft":
            delta += f" (check {100 * (again - checks['sft']['success_rate']):+.1f})"
        print(
            f"{label:<22}{rate:>9.3f}{f'[{lo:.2f}, {hi:.2f}]':>18}{again:>8.3f}"
            f"{times.get(name, math.nan) / 60:>9.1f}   {shown}  {delta}"
        )
        row = {"stage": name, "success": rate, "interval": [lo, hi], "curve": curve}
        row["check"] = {"success": again, "interval": checks[name]["ci95"]}
        row |= {"seconds": times.get(name), "run_dir": str(runs[name])}
        if name != "sft":
            row["gain_points"] = 100 * (rate - start)
        table.append(row)
        if args.plot:
            cli.main(["plot", str(runs[name])])
    if "collect" in times:
        print(f"{'collect':<22}{'':>9}{'':>18}{times['collect'] / 60:>9.1f}")
    print(f"total {sum(times.values()) / 60:.1f} minutes")
    results.update(table=table, seconds=times)
    write_results(args.out, results)


if __name__ == "__main__":
    main()
