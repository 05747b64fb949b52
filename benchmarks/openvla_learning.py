"""Tiny OpenVLA learning on the toy env: greedy success before and after RL, per setting.

A learning experiment, not a speed benchmark: the tiny OpenVLA has no CI learning test yet, and
this script reproduces the measurements in docs/training.md ("Learning tests") so the next
settings can be tried from the same starting point.

Each case:

1. builds ``make_policy("openvla", preset="tiny", ...)`` with ``--seed``;
2. pretrains it in up to two stages that never show it an action token, so the policy still
   has to learn to act:

   - *vision* (``--pretrain-steps``): the vision tower and projector learn to localise the scene
     (AdamW regressing the agent's and the target's positions from the mean projected patch,
     agent anywhere), standing in for the pretrained DINOv2/SigLIP towers;
   - *vision-language* (``--vlm-steps``): the language model learns to describe the scene in
     text after the action prompt, teacher-forced over the full vocabulary: where the target
     lies from the agent, one letter per axis (``l``/``c``/``r``, ``u``/``c``/``d``; 0.1 dead
     zone), repeated once per action slot. This stands in for the VLM OpenVLA starts from. By
     default only the language model trains here (``--vlm-train lm``; Prismatic also freezes
     the vision tower when it trains the VLM), on scenes with the agent at the centre
     (``--vlm-scenes center``);
3. saves that policy as a checkpoint, measures its greedy success on 64 held-out scenes, trains
   it with the real ``rlinf-vla train`` (local Ray, collocated) and measures the last checkpoint
   on the same scenes.

Prints a table and writes JSON (default ``benchmarks/results/openvla_learning.json``)::

    PYTHONPATH=. python benchmarks/openvla_learning.py                    # the default case
    PYTHONPATH=. python benchmarks/openvla_learning.py --iterations 40 --lr 7e-4
    PYTHONPATH=. python benchmarks/openvla_learning.py --chunk 2 --rollout-chunks 12 --epochs 4
    # the VLM warm start, then RL of the action read-out alone (LoRA on lm_head):
    PYTHONPATH=. python benchmarks/openvla_learning.py --vlm-steps 300 --iterations 48 \
        --lr 1e-2 --set ++algo.minibatch_size=96 --set ++algo.micro_batch_size=96 \
        --set ++policy.lora_rank=8 --set "++policy.lora_target_modules=.*lm_head"

The JSON also holds how well the scene can be read off the language model at the action
positions (:func:`direction_probe`: a linear classifier of where the target lies, per axis,
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

import torch

from rlinf_vla import cli
from rlinf_vla.envs import make_env
from rlinf_vla.pipelines.evaluation import greedy_eval
from rlinf_vla.policies import make_policy

ENV = {
    "action_dim": 2,
    "num_objects": 1,
    "agent_start": "center",
    "reward_mode": "dense",
    "success_radius": 0.1,
    "max_episode_steps": 24,
}
EVAL_EPISODES = 64


def pretrain_vision(policy, env_cfg: dict, steps: int, lr: float, batch: int = 64) -> list[float]:
    """Train ``vision_backbone`` + ``projector`` to regress (agent xy, target xy) from the mean
    projected patch of fresh toy scenes (the agent in a random cell). Returns the loss curve."""
    env = make_env("toy", **{**env_cfg, "num_envs": batch, "agent_start": "random"})
    head = torch.nn.Linear(policy.vla.llm_dim, 4)
    params = [
        *policy.vla.vision_backbone.parameters(),
        *policy.vla.projector.parameters(),
        *head.parameters(),
    ]
    opt = torch.optim.AdamW(params, lr=lr)
    gen = torch.Generator().manual_seed(12345)
    losses = []
    try:
        for _ in range(steps):
            obs = env.reset(reset_ids=torch.randint(0, 2**30, (batch,), generator=gen))
            target = torch.cat([obs.state, env.target_pos], dim=1)
            feats = policy.vla.patch_embeddings(policy.processor.pixel_values(obs)).mean(1)
            loss = torch.nn.functional.mse_loss(head(feats), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        env.close()
    return losses


def relation(agent: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Where the target lies from the agent, per axis: ``long [B, 2]`` in {0, 1, 2} (x: left,
    centre, right; y: up, centre, down; within 0.1 counts as centre)."""
    d = target - agent
    return (d > 0.1).long() - (d < -0.1).long() + 1


def relation_chars(policy, agent: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Token ids ``[B, chunk * action_dim]`` of the caption: ``l``/``c``/``r`` for x and
    ``u``/``c``/``d`` for y, repeated once per action slot."""
    tok = policy.processor.tokenizer
    letters = torch.tensor([[tok(c).input_ids[-1] for c in axis] for axis in ("lcr", "ucd")])
    rel = relation(agent, target)
    pair = torch.stack([letters[0][rel[:, 0]], letters[1][rel[:, 1]]], dim=1)
    return pair.repeat(1, policy.config.chunk_size)


def pretrain_vlm(
    policy, env_cfg: dict, steps: int, lr: float, scenes: str, train: str, batch: int = 64
) -> list[float]:
    """Vision-language pretraining: the caption of :func:`relation_chars` after the action
    prompt, teacher-forced, cross-entropy over the full vocabulary. ``train="lm"`` updates the
    language model only, ``"all"`` the whole model. No action token is ever a target."""
    start = "random" if scenes == "random" else "center"
    env = make_env("toy", **{**env_cfg, "num_envs": batch, "agent_start": start})
    module = policy.vla.language_model if train == "lm" else policy
    opt = torch.optim.AdamW(module.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(12345)
    losses = []
    try:
        for _ in range(steps):
            obs = env.reset(reset_ids=torch.randint(0, 2**30, (batch,), generator=gen))
            if scenes == "paths":
                # The agent part of the way to the target (envs that arrive start over).
                for _ in range(int(torch.randint(0, 9, (1,), generator=gen))):
                    obs = env.chunk_step(env.oracle_actions(1)).obs
            ids = relation_chars(policy, obs.state, env.target_pos)
            hidden, flat = policy._teacher_forced(policy._prefix(obs), ids.view(batch, -1, 2))
            logits = policy.vla.language_model.lm_head(hidden).float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), flat.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        env.close()
    return losses


def direction_probe(policy, env_cfg: dict, scenes: int = 512, steps: int = 300) -> list[float]:
    """Per action position, the held-out accuracy of a linear classifier of :func:`relation`
    (mean over x and y) on the language model's hidden state that predicts that action token,
    with random action tokens fed before it (chance is about 0.4). Trained on 3/4 of
    ``scenes`` held-out scenes, scored on the rest."""
    env = make_env("toy", **{**env_cfg, "num_envs": scenes})
    try:
        obs = env.reset(reset_ids=torch.arange(10**6, 10**6 + scenes))
        labels = relation(obs.state, env.target_pos)
    finally:
        env.close()
    cfg = policy.config
    gen = torch.Generator().manual_seed(0)
    index = torch.randint(0, cfg.n_action_bins, (scenes, cfg.chunk_size, 2), generator=gen)
    ids = policy.processor.action_tokenizer.from_index(index)
    with torch.no_grad():
        hidden, _ = policy._teacher_forced(policy._prefix(obs), ids)
    train, test = slice(0, scenes * 3 // 4), slice(scenes * 3 // 4, scenes)
    accuracy = []
    for pos in range(hidden.shape[1]):
        h = hidden[:, pos].float()
        head = torch.nn.Linear(h.shape[1], 6)
        opt = torch.optim.Adam(head.parameters(), lr=1e-2)
        for _ in range(steps):
            out = head(h[train]).view(-1, 2, 3)
            loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), labels[train].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            pred = head(h[test]).view(-1, 2, 3).argmax(-1)
        accuracy.append(round(float((pred == labels[test]).float().mean()), 3))
    return accuracy


def greedy_success(policy, env_cfg: dict) -> float:
    env = make_env("toy", **{**env_cfg, "num_envs": 32})
    try:
        return greedy_eval(policy, env, EVAL_EPISODES).success_rate
    finally:
        env.close()


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
    pretrain_s = time.perf_counter() - t0
    probe = {"pretrained": direction_probe(policy, env_cfg)}
    init = work / "init"
    policy.save_pretrained(init)
    before = greedy_success(policy, env_cfg)

    algo = {
        "lr": args.lr,
        "update_epochs": args.epochs,
        "minibatch_size": 32,
        "micro_batch_size": 32,
        "gamma": 0.8,
        "lam": 0.9,
    }
    if args.algo == "grpo":
        algo["group_size"] = args.group_size
    runner = {
        "seed": args.seed,
        "max_iterations": args.iterations,
        "rollout_chunks": args.rollout_chunks,
        "save_interval": args.iterations,
        "output_dir": str(work / "run"),
    }
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
    parser.add_argument("--iterations", type=int, default=24)
    parser.add_argument("--rollout-chunks", type=int, default=6)
    parser.add_argument("--envs", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=4)
    parser.add_argument("--bins", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--vlm-steps", type=int, default=0)
    parser.add_argument("--vlm-scenes", choices=["center", "paths", "random"], default="paths")
    parser.add_argument("--vlm-train", choices=["lm", "all"], default="lm")
    parser.add_argument("--pretrain-lr", type=float, default=1e-3)
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
