"""Greedy evaluation: the success rate of a policy's most likely actions on fixed scenes.

:func:`greedy_eval` runs ``episodes`` episodes, each from a given reset id, with
``policy.act(obs, greedy=True)`` (OpenVLA: the arg-max action tokens; π0: the ODE from
seeded noise as openpi, or from the noise mode with ``greedy_noise=zero``) and reports their
success, return and length. The scenes are fixed by the reset ids, so two evaluations of the same policy on the same env give the same numbers, and evaluations of
successive checkpoints compare the policies on the same scenes.

The training envs draw their reset ids by hashing (seed, group, episode) into ``[0, 2**31)``
(:meth:`rlinf_vla.envs.VectorEnv.next_reset_ids`); the default evaluation ids
``EVAL_RESET_ID_BASE + i`` are a contiguous block near the top of that range, so a training run
meets one of them with negligible probability (held-out scenes).

Example::

    env = make_env("toy", num_envs=16)
    policy = make_policy("openvla", checkpoint="runs/x/checkpoints/iter_20/policy")
    result = greedy_eval(policy, env, episodes=64, video_dir="runs/x/videos/eval_20")
    result.metrics()   # {"eval/success_rate": 0.91, "eval/episode_return": ..., ...}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlinf_vla.config import RunAborted
from rlinf_vla.envs.base import EnvConfig, VectorEnv
from rlinf_vla.policies.base import Policy
from rlinf_vla.run.checkpoints import Resume, checkpoint_folders, damage
from rlinf_vla.run.tracking import read_metrics
from rlinf_vla.types import ChunkResult

if TYPE_CHECKING:
    from rlinf_vla.envs.video import VideoRecorder

__all__ = [
    "EVAL_RESET_ID_BASE",
    "SCENE_BLOCKS",
    "VALIDATION_RESET_ID_BASE",
    "EvalResult",
    "best_checkpoint",
    "eval_reset_ids",
    "evaluate_on_worker",
    "greedy_eval",
]

#: First default evaluation reset id (``2**31 - 2**20``): far from ids drawn by training.
EVAL_RESET_ID_BASE = 2**31 - 2**20
#: First validation reset id (``2**31 - 2**21``): the block just below the held-out one, for
#: choosing a checkpoint (``runner.eval_scenes=validation``) without looking at the scenes it
#: is then scored on.
VALIDATION_RESET_ID_BASE = 2**31 - 2**21
#: Scenes an evaluation block holds (the blocks do not overlap).
SCENES_PER_BLOCK = 2**20
#: ``runner.eval_scenes`` -> the first reset id of its block.
SCENE_BLOCKS = {"held_out": EVAL_RESET_ID_BASE, "validation": VALIDATION_RESET_ID_BASE}


def check_eval_episodes(episodes: int) -> None:
    """``runner.eval_episodes`` must fit in one block of scenes (:data:`SCENES_PER_BLOCK`)."""
    from rlinf_vla.config import ConfigError

    if episodes > SCENES_PER_BLOCK:
        raise ConfigError(
            f"runner.eval_episodes must be <= {SCENES_PER_BLOCK} (a block of evaluation "
            f"scenes), got {episodes}"
        )


def eval_reset_ids(episodes: int, base: int = EVAL_RESET_ID_BASE) -> torch.Tensor:
    """The default held-out reset ids ``base, base + 1, ..., base + episodes - 1`` (long)."""
    return torch.arange(base, base + episodes, dtype=torch.long)


@dataclass
class EvalResult:
    """Per-episode outcomes of :func:`greedy_eval` (``E`` episodes, in reset-id order).

    Attributes:
        reset_ids: ``long [E]`` the reset id each episode started from.
        success: ``bool [E]`` the task was solved at some step.
        episode_return: ``float32 [E]`` summed reward.
        episode_length: ``long [E]`` env steps until the episode ended.
        invalid: ``bool [E]`` the simulator crashed (excluded from the rates).
        videos: MP4 files written (empty without ``video_dir``).
    """

    reset_ids: torch.Tensor
    success: torch.Tensor
    episode_return: torch.Tensor
    episode_length: torch.Tensor
    invalid: torch.Tensor
    videos: list[str] = field(default_factory=list)

    @property
    def success_rate(self) -> float:
        """Successes over valid episodes (``nan`` when none is valid)."""
        valid = ~self.invalid
        return float(self.success[valid].float().mean()) if valid.any() else float("nan")

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """Scalars for ``metrics.jsonl``: ``success_rate``, ``episode_return``,
        ``episode_length`` (means over valid episodes), ``episodes``, ``invalid_episodes``."""
        valid = ~self.invalid
        n = int(valid.sum())

        def mean(x: torch.Tensor) -> float:
            return float(x[valid].float().mean()) if n else float("nan")

        return {
            f"{prefix}success_rate": self.success_rate,
            f"{prefix}episode_return": mean(self.episode_return),
            f"{prefix}episode_length": mean(self.episode_length),
            f"{prefix}episodes": float(n),
            f"{prefix}invalid_episodes": float(int(self.invalid.sum())),
        }


@torch.no_grad()
def greedy_eval(
    policy: Policy,
    env: VectorEnv,
    episodes: int,
    reset_ids: torch.Tensor | list[int] | None = None,
    video_dir: str | Path | None = None,
    video_prefix: str = "eval",
    video_fps: int = 10,
    greedy: bool = True,
) -> EvalResult:
    """Run ``episodes`` episodes of ``policy`` on ``env`` and collect their outcomes.

    Episodes run in rounds of ``env.num_envs``: each round resets every env to its reset id
    (``env.reset(ids)``), then steps action chunks until every env has ended its episode
    (success, time limit or crash); what an env does after its episode ended (auto-reset) is
    ignored. The last round fills its spare envs with repeated ids whose results are dropped.
    The env's reset-id cursor is left alone except for the counts of started episodes (a
    training env can be shared, but its next training episodes then start from other ids; give
    evaluation its own env to keep a training run reproducible).

    Args:
        policy: any registered policy; it is put in eval mode for the call (restored after).
        env: a :class:`VectorEnv` of ``B`` envs (``B`` need not divide ``episodes``).
        episodes: number of episodes ``E`` (>= 1).
        reset_ids: ``[E]`` the scene of each episode; default :func:`eval_reset_ids`.
        video_dir: write an MP4 of every episode of env 0 there (one per round), with the
            instruction and the outcome drawn on each frame
            (``<video_prefix>_env0_ep<round>_<success|fail|invalid>.mp4``). To record every
            env step, chunks are then executed one step at a time (same outcomes, more
            rendering).
        video_prefix: file name prefix of the videos.
        video_fps: frames per second of the videos.
        greedy: ``False`` samples actions instead (the stochastic training policy's rate).

    Returns:
        An :class:`EvalResult`; ``result.metrics()`` gives the ``eval/*`` scalars.
    """
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    ids = eval_reset_ids(episodes) if reset_ids is None else torch.as_tensor(reset_ids).long()
    ids = ids.flatten()
    if ids.numel() != episodes:
        raise ValueError(f"reset_ids must hold episodes={episodes} ids, got {ids.numel()}")
    if (ids < 0).any():
        raise ValueError(f"reset_ids must be >= 0, got {ids.tolist()}")
    recorder = None
    if video_dir is not None:
        from rlinf_vla.envs.video import VideoRecorder

        recorder = VideoRecorder(
            str(video_dir), (0,), env.config.video_camera, video_fps, prefix=video_prefix
        )
    was_training = policy.training
    policy.eval()
    b = env.num_envs
    parts: list[tuple[torch.Tensor, ...]] = []
    try:
        for start in range(0, episodes, b):
            chunk_ids = ids[start : start + b]
            n = chunk_ids.numel()
            padded = torch.cat([chunk_ids, chunk_ids[:1].repeat(b - n)])
            outcome = _run_round(policy, env, padded, greedy, recorder)
            parts.append((*(x[:n] for x in outcome), chunk_ids))
    finally:
        policy.train(was_training)
        if recorder is not None:
            recorder.close()
    success, ret, length, invalid, rids = (torch.cat(x) for x in zip(*parts, strict=True))
    return EvalResult(
        reset_ids=rids,
        success=success,
        episode_return=ret,
        episode_length=length,
        invalid=invalid,
        videos=list(recorder.written) if recorder is not None else [],
    )


def _run_round(
    policy: Policy,
    env: VectorEnv,
    ids: torch.Tensor,
    greedy: bool,
    recorder: VideoRecorder | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One episode per env from ``ids [B]``: success, return, length, invalid (each ``[B]``)."""
    b = env.num_envs
    obs = env.reset(ids)
    running = torch.ones(b, dtype=torch.bool)
    success = torch.zeros(b, dtype=torch.bool)
    invalid = torch.zeros(b, dtype=torch.bool)
    ret = torch.zeros(b)
    length = torch.zeros(b, dtype=torch.long)
    if recorder is not None:
        recorder.start(torch.tensor([0]), obs.select([0]))
    # Every episode ends by its time limit, so this loop ends; the bound only guards against an
    # env that never reports the end of an episode.
    for _ in range(env.max_episode_steps + 1):
        if not running.any():
            break
        actions = policy.act(obs, greedy=greedy).actions.detach().cpu().float()
        steps = [actions] if recorder is None else list(actions.split(1, dim=1))
        for part in steps:
            res = env.chunk_step(part)
            done = res.info["done"] & running
            ret += torch.where(running, res.reward.sum(1), 0.0)
            length += _executed_steps(res, running)
            success |= res.success & running
            invalid |= res.info["invalid"] & running
            if recorder is not None and running[0]:
                frame = res.final_obs if bool(done[0]) and res.final_obs is not None else res.obs
                recorder.add(frame, torch.tensor([True] + [False] * (b - 1)), res.success)
                if bool(done[0]):
                    recorder.end(torch.tensor([0]), res.info["invalid"])
            running &= ~done
            obs = res.obs
            if not running.any():
                break
    return success & ~invalid, ret, length, invalid


def _executed_steps(res: ChunkResult, running: torch.Tensor) -> torch.Tensor:
    """Env steps of the chunk that belong to the running episodes ``[B]``: up to and including
    the step where an episode ended, the whole chunk otherwise."""
    ended = res.terminated | res.truncated  # [B, K]
    k = ended.shape[1]
    first_end = torch.where(
        ended.any(1),
        ended.float().argmax(1).long() + 1,
        torch.full_like(running, k, dtype=torch.long),
    )
    return torch.where(running, first_end, torch.zeros_like(first_end))


def evaluate_on_worker(
    rollout: Any,
    env_name: str,
    env: EnvConfig,
    runner: Any,
    video_dir: Path,
    logger: Any,
    step: int,
) -> dict[str, float]:
    """One evaluation round of a trainer (``train`` and ``sft``): rollout worker 0 of
    ``rollout`` runs :func:`greedy_eval` with the weights it holds, on ``runner.eval_episodes``
    scenes of the block ``runner.eval_scenes`` names (:data:`SCENE_BLOCKS`), on an env of its
    own made from ``env`` with ``runner.eval_num_envs`` envs (``None``: ``env``'s, at most the
    episodes); the driver writes the videos it returns into ``video_dir`` and hands them to
    ``logger``. Returns the ``eval/*`` metrics, ``eval/first_reset_id`` among them."""
    from rlinf_vla.envs import replace_config

    episodes = runner.eval_episodes
    envs = min(env.num_envs if runner.eval_num_envs is None else runner.eval_num_envs, episodes)
    env_cfg = replace_config(env, seed=runner.seed, group_size=1, num_envs=envs)
    first = SCENE_BLOCKS[runner.eval_scenes]
    ids = eval_reset_ids(episodes, first)
    call = rollout.evaluate(env_name, env_cfg, episodes, runner.eval_videos, ids, ranks=[0])
    [(metrics, blobs)] = call.wait()
    for name, blob in blobs.items():
        video_dir.mkdir(parents=True, exist_ok=True)
        (video_dir / name).write_bytes(blob)
        logger.log_video("eval/video", video_dir / name, step)
    return {**metrics, "eval/first_reset_id": float(first)}


def best_checkpoint(run_dir: str | Path, prefix: str, scenes: str = "validation") -> Resume:
    """The complete checkpoint of ``run_dir`` (``<prefix>_<n>``) whose evaluation after step or
    iteration ``n`` had the highest greedy success rate, among the evaluations on ``scenes``
    (``runner.eval_scenes``: ``validation`` by default, so that the scenes a checkpoint is
    then scored on played no part in choosing it); the latest of equal ones (the one trained
    longest). Its note names the rate and how many evaluations it was chosen from.

    Raises:
        RunAborted: no complete checkpoint was evaluated on ``scenes``.
    """

    run_dir = Path(run_dir)
    first = float(SCENE_BLOCKS[scenes])
    rates = {
        int(row.get("iteration", row.get("step", -1))): float(row["eval/success_rate"])
        for row in read_metrics(run_dir)
        if row.get("eval/success_rate") is not None and row.get("eval/first_reset_id") == first
    }
    saved = {int(p.name.rsplit("_", 1)[1]): p for p in checkpoint_folders(run_dir, prefix)}
    candidates = [(rate, n) for n, rate in rates.items() if n in saved and damage(saved[n]) is None]
    if not candidates:
        raise RunAborted(
            f"{run_dir}: no complete checkpoint was evaluated on {scenes} scenes "
            f"({len(rates)} evaluation(s) on them, checkpoints {sorted(saved)}): evaluate with "
            f"runner.eval_scenes={scenes} at the steps the run saves (runner.save_interval)"
        )
    rate, n = max(candidates)
    note = (
        f"checkpoints/{saved[n].name}: greedy success {rate:.3f} on {scenes} scenes, the best "
        f"of {len(candidates)} evaluated checkpoint(s)"
    )
    return Resume(saved[n], [note])
