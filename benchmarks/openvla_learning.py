"""Tiny OpenVLA learning on the toy env: greedy success before and after RL, per setting.

A learning experiment, not a speed benchmark: it reproduces the measurements in
docs/training.md ("Learning tests") so that other settings can be tried from the same
starting point as the OpenVLA learning tests.

Each case:

1. builds ``make_policy("openvla", preset="tiny", ...)`` with ``--seed``;
2. pretrains it in up to three stages that never reward an action that fits the scene, so the
   policy still has to learn to act (``rlinf_vla.pipelines.toy_pretraining``, shared with the
   learning tests): the vision tower learns to localise the scene (``--pretrain-steps``), the language
   model learns to caption where the target lies from the agent (``--vlm-steps``, on
   ``--vlm-scenes``, training ``--vlm-train``: the language model alone by default), and the
   action read-out learns to hold still (``--rest-steps``);
3. saves that policy as a checkpoint, measures its greedy success on 64 held-out scenes, trains
   it with the real ``rlinf-vla train`` (local Ray, collocated) and measures the last checkpoint
   on the same scenes.

Prints a table and writes JSON (default ``benchmarks/results/openvla_learning.json``)::

    # the PPO learning test's case: the warm start, then PPO of a LoRA on lm_head
    python benchmarks/openvla_learning.py
    # the GRPO learning test's case
    python benchmarks/openvla_learning.py --algo grpo --envs 128 --iterations 32 \
        --minibatch 768 --set ++algo.normalize_std=false --set ++algo.gamma=0.8 \
        --set ++algo.lr_schedule=linear
    # the whole model instead of the read-out, smaller steps
    python benchmarks/openvla_learning.py --readout-lora 0 --lr 5e-4

The JSON also holds how well the scene can be read off the language model at the action
positions (``direction_probe``: a linear classifier of where the target lies, per axis,
trained on the hidden states that predict each action token) after pretraining and after RL;
it shows whether RL kept or destroyed what pretraining taught.

The env is the easiest toy setting (one shape, the agent starting at the centre, 2-D actions,
dense reward, success radius 0.1, 24-step episodes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from rlinf_vla import cli
from rlinf_vla.pipelines.toy_pretraining import (
    direction_probe,
    greedy_success,
    pretrain_vision,
    pretrain_vlm,
    rest_action_head,
)
from rlinf_vla.policies import make_policy

ENV = {
    "action_dim": 2,
    "num_objects": 1,
    "agent_start": "center",
    "reward_mode": "dense",
    "success_radius": 0.1,
    "max_episode_steps": 24,
}


def run_case(args: argparse.Namespace, work: Path) -> dict:
    policy_cfg = {
        "preset": "tiny",
        "action_dim": 2,
        "chunk_size": args.chunk,
        "n_action_bins": args.bins,
        "logprob_granularity": "token",
    }
    env_cfg = {**ENV, "num_envs": args.envs}
    policy = make_policy("openvla", **policy_cfg, seed=args.seed)
    t0 = time.perf_counter()
    losses = pretrain_vision(policy, env_cfg, args.pretrain_steps, args.pretrain_lr)
    vlm_losses = pretrain_vlm(
        policy, env_cfg, args.vlm_steps, args.pretrain_lr, args.vlm_scenes, args.vlm_train
    )
    if args.rest_steps:
        rest_action_head(policy, env_cfg, args.rest_steps)
    pretrain_s = time.perf_counter() - t0
    # The rest stage trains lm_head only: the hidden states the probe reads are unchanged.
    probe = {"pretrained": direction_probe(policy, env_cfg)}
    init = work / "init"
    policy.save_pretrained(init)
    before = greedy_success(policy, env_cfg)

    algo = {
        "lr": args.lr,
        "update_epochs": args.epochs,
        "minibatch_size": args.minibatch,
        "micro_batch_size": args.minibatch,
        "clip_low": args.clip,
        "clip_high": args.clip,
        "gamma": 0.8,
    }
    if args.algo == "ppo":
        algo["lam"] = 0.9  # GAE's; GRPO's preset refuses it
    if args.algo == "grpo":
        algo["group_size"] = args.group_size
    runner = {
        "seed": args.seed,
        "max_iterations": args.iterations,
        "rollout_chunks": args.rollout_chunks,
        "save_interval": args.iterations,
        "output_dir": str(work / "run"),
    }
    readout = []
    if args.readout_lora:
        readout = [
            f"++policy.lora_rank={args.readout_lora}",
            '++policy.lora_target_modules=".*lm_head"',
        ]
    overrides = [
        "train",
        "cluster.devices_per_node=1",
        "placement=collocated",
        "env=toy",
        "policy=openvla",
        f"algo={args.algo}",
        f"policy.checkpoint={init}",
        *(f"++env.{k}={json.dumps(v)}" for k, v in env_cfg.items()),
        *(f"++algo.{k}={json.dumps(v)}" for k, v in algo.items()),
        *(f"++runner.{k}={json.dumps(v)}" for k, v in runner.items()),
        "runner.logging.tensorboard=false",
        *readout,
        *args.set,
    ]
    t0 = time.perf_counter()
    if cli.main(overrides) != 0:
        raise SystemExit("rlinf-vla train failed")
    train_s = time.perf_counter() - t0
    rows = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    last = work / "run" / "checkpoints" / f"iter_{args.iterations}" / "policy"
    trained = make_policy("openvla", checkpoint=str(last))
    after = greedy_success(trained, env_cfg)
    probe["trained"] = direction_probe(trained, env_cfg)
    return {
        "settings": {**vars(args), "policy": policy_cfg, "env": env_cfg, "algo_cfg": algo},
        "vision_loss_first_last": [losses[0], losses[-1]] if losses else None,
        "vlm_loss_first_last": [vlm_losses[0], vlm_losses[-1]] if vlm_losses else None,
        "pretrain_s": round(pretrain_s, 1),
        "direction_probe": probe,
        "greedy_before": before,
        "greedy_after": after,
        "sampled_success_curve": [round(r["env/success_rate"], 3) for r in rows],
        "entropy_curve": [round(r["train/entropy"], 3) for r in rows],
        "train_s": round(train_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algo", choices=["ppo", "grpo"], default="ppo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=48)
    parser.add_argument("--rollout-chunks", type=int, default=24)
    parser.add_argument("--envs", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=1)
    parser.add_argument("--bins", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--minibatch", type=int, default=192)
    parser.add_argument("--clip", type=float, default=0.3)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--pretrain-steps", type=int, default=1500)
    parser.add_argument("--vlm-steps", type=int, default=500)
    parser.add_argument(
        "--vlm-scenes", choices=["center", "paths", "walks", "random"], default="walks"
    )
    parser.add_argument("--vlm-train", choices=["lm", "all"], default="lm")
    parser.add_argument("--rest-steps", type=int, default=100)
    parser.add_argument("--pretrain-lr", type=float, default=1e-3)
    parser.add_argument(
        "--readout-lora",
        type=int,
        default=8,
        help="RL trains a LoRA of this rank on lm_head alone (0: the whole model)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra rlinf-vla train override, e.g. ++algo.entropy_coef=0.01 (repeatable)",
    )
    parser.add_argument("--out", default="benchmarks/results/openvla_learning.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_case(args, Path(tmp))
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    s = result["settings"]
    print(
        f"{'algo':<5} {'seed':>4} {'iters':>5} {'chunk':>5} {'bins':>4} {'lr':>7} "
        f"{'pretrain':>8} {'before':>6} {'after':>6} {'train s':>7}"
    )
    print(
        f"{s['algo']:<5} {s['seed']:>4} {s['iterations']:>5} {s['chunk']:>5} {s['bins']:>4} "
        f"{s['lr']:>7.0e} {s['pretrain_steps']:>8} {result['greedy_before']:>6.2f} "
        f"{result['greedy_after']:>6.2f} {result['train_s']:>7.0f}"
    )
    for stage, accuracy in result["direction_probe"].items():
        print(f"direction read off the action positions, {stage}: {accuracy}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
