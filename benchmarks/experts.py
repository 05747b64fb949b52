"""Success of the ManiSkill scripted experts: episodes, success rate, mean length, Wilson 95 %.

Prints a table and writes JSON (default ``benchmarks/results/experts.json``)::

    python benchmarks/experts.py                                  # 100 episodes per task
    python benchmarks/experts.py --tasks PickCube-v1 --episodes 20

Each task runs through the package's env (``make_env("maniskill", sim_backend="cpu")``, one
subprocess per env) with the task's registered time limit. Episode ``i`` starts from reset id
``first_id + i`` (ids ``0..episodes-1`` by default), so the table is reproducible. Every step
asks the env for :meth:`~rlinf_vla.envs.VectorEnv.expert_actions` and executes it with
``chunk_step(actions[:, None])``; an episode succeeds when the task reports success at any
step, which ends it (ManiSkill's success terminates). Episodes whose simulator crashed are
counted apart and left out of the rate. Images are rendered every step (at ``--image-size``,
64 px by default, with ``fast_render`` to keep it cheap); the experts never look at them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass

import torch

from rlinf_vla.envs import make_env
from rlinf_vla.eval.stats import wilson_interval

DEFAULT_TASKS = "PickCube-v1,PushCube-v1,StackCube-v1"


@dataclass
class Row:
    task: str
    episodes: int
    successes: int
    success_rate: float
    wilson_low: float
    wilson_high: float
    mean_length: float
    mean_length_success: float
    invalid: int
    max_episode_steps: int
    failed_reset_ids: list[int]
    seconds: float


def run_task(task: str, episodes: int, first_id: int, num_envs: int, image_size: int) -> Row:
    """Run ``episodes`` expert episodes of ``task`` from reset ids ``first_id, first_id + 1, ...``."""
    t0 = time.perf_counter()
    env = make_env(
        "maniskill",
        task=task,
        num_envs=num_envs,
        sim_backend="cpu",
        image_size=image_size,
        fast_render=True,
        auto_reset=False,
    )
    ids = list(range(first_id, first_id + episodes))
    success: dict[int, bool] = {}
    length: dict[int, int] = {}
    invalid: list[int] = []
    try:
        for start in range(0, episodes, num_envs):
            batch = ids[start : start + num_envs]
            # A short last batch repeats its first id in the unused envs (their result is dropped).
            reset_ids = batch + [batch[0]] * (num_envs - len(batch))
            env.reset(torch.tensor(reset_ids))
            running = torch.ones(num_envs, dtype=torch.bool)
            succeeded = torch.zeros(num_envs, dtype=torch.bool)
            while running.any():
                res = env.chunk_step(env.expert_actions()[:, None])
                succeeded |= res.success & running
                done = res.info["done"] & running
                for i in torch.nonzero(done).flatten().tolist():
                    if i >= len(batch):
                        continue
                    rid = batch[i]
                    if bool(res.info["invalid"][i]):
                        invalid.append(rid)
                    else:
                        success[rid] = bool(succeeded[i])
                        length[rid] = int(res.info["elapsed_steps"][i])
                running &= ~done
        limit = env.max_episode_steps
    finally:
        env.close()
    n = len(success)
    wins = sum(success.values())
    lo, hi = wilson_interval(wins, n) or (float("nan"), float("nan"))
    won = [length[r] for r in success if success[r]]
    return Row(
        task=task,
        episodes=n,
        successes=wins,
        success_rate=round(wins / max(n, 1), 4),
        wilson_low=round(lo, 4),
        wilson_high=round(hi, 4),
        mean_length=round(sum(length.values()) / max(n, 1), 2),
        mean_length_success=round(sum(won) / max(len(won), 1), 2),
        invalid=len(invalid),
        max_episode_steps=limit,
        failed_reset_ids=sorted(r for r in success if not success[r]),
        seconds=round(time.perf_counter() - t0, 1),
    )


def print_table(rows: list[Row]) -> None:
    head = ("task", "episodes", "success", "Wilson 95%", "mean len", "limit", "invalid", "s")
    lines = [
        (
            r.task,
            r.episodes,
            f"{r.success_rate:.1%}",
            f"[{r.wilson_low:.1%}, {r.wilson_high:.1%}]",
            r.mean_length,
            r.max_episode_steps,
            r.invalid,
            r.seconds,
        )
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    for line in (head, *lines):
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated ManiSkill ids")
    parser.add_argument("--episodes", type=int, default=100, help="episodes per task")
    parser.add_argument("--first-id", type=int, default=0, help="reset id of the first episode")
    parser.add_argument("--num-envs", type=int, default=2, help="env subprocesses")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/experts.json")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads of this process (0 = torch's default)",
    )
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    rows = []
    for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
        row = run_task(task, args.episodes, args.first_id, args.num_envs, args.image_size)
        rows.append(row)
        print(
            f"{task}: {row.successes}/{row.episodes} ({row.seconds} s)", file=sys.stderr, flush=True
        )
    print_table(rows)
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_average": os.getloadavg(),
        },
        "settings": {
            "episodes": args.episodes,
            "first_id": args.first_id,
            "num_envs": args.num_envs,
            "image_size": args.image_size,
            "sim_backend": "cpu",
            "control_mode": "pd_ee_delta_pose",
        },
        "rows": [asdict(r) for r in rows],
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
