"""``rlinf-vla collect``: demonstrations from an env's scripted expert, as a LeRobotDataset.

The expert (:meth:`rlinf_vla.envs.VectorEnv.expert_actions`: privileged state -> action, in
the action space the policies use) acts in ``env.num_envs`` envs at once (ManiSkill's CPU
simulator: one subprocess each). Episode ``k`` starts from reset id ``collect.first_reset_id +
k``, so the scenes are known and never those of the evaluation (its held-out ids lie near
``2**31``). Only successful episodes are written; both counts are reported and kept in the
dataset's ``meta/collect.json``.

The result is a LeRobotDataset v3.0 folder (:mod:`rlinf_vla.data`): features
``observation.images.<camera>`` (one MP4 per camera), ``observation.state``, ``action`` and the
instruction as the task, for ``rlinf-vla sft`` or any LeRobot reader.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlinf_vla.config import (
    ConfigError,
    RunAborted,
    SectionErrors,
    check_at_least,
    check_sections,
    from_section,
)


@dataclass
class CollectConfig:
    """The ``collect`` section.

    Attributes:
        episodes: successful episodes to keep.
        max_attempts: give up after this many episodes (``None``: 4 x ``episodes``), so an
            expert that rarely succeeds cannot run forever.
        output_dir: the dataset folder to write (must not hold a dataset unless ``overwrite``).
        overwrite: replace an existing dataset in ``output_dir``.
        first_reset_id: reset id of the first episode; episode ``k`` uses ``first + k``.
        fps: frames per second recorded in the dataset and its videos (ManiSkill's tabletop
            tasks act at 20 Hz).
        robot_type: the dataset's ``robot_type`` (``None``: the env's robot, e.g. ``panda``).
    """

    episodes: int = 100
    max_attempts: int | None = None
    output_dir: str | None = None
    overwrite: bool = False
    first_reset_id: int = 0
    fps: int = 20
    robot_type: str | None = None

    def __post_init__(self) -> None:
        check_at_least(self, "collect", ("episodes", "fps", "max_attempts"), 1)
        check_at_least(self, "collect", ("first_reset_id",), 0)
        if self.max_attempts is None:
            self.max_attempts = 4 * self.episodes
        if self.max_attempts < self.episodes:
            raise ConfigError(
                f"collect.max_attempts={self.max_attempts} is below collect.episodes="
                f"{self.episodes}"
            )
        if not self.output_dir:
            raise ConfigError("collect.output_dir: name the dataset folder to write")
        out = Path(self.output_dir)
        if out.exists() and any(out.iterdir()) and not self.overwrite:
            raise ConfigError(
                f"collect.output_dir={self.output_dir!r} is not empty: choose another folder "
                "or set collect.overwrite=true"
            )


class CollectFailed(RunAborted):
    """The expert solved no episode: there is nothing to write."""


@dataclass
class CollectJob:
    """A validated ``rlinf-vla collect`` job: ``env`` holds the keys the command line set,
    ``env_config`` the typed config the env is built from (``auto_reset`` off, every default
    resolved)."""

    env_name: str
    env: dict[str, Any]
    collect: CollectConfig
    env_config: Any = None
    raw: dict[str, Any] = field(default_factory=dict)


def validate(cfg: Any) -> CollectJob:
    """Typed sections; the env's config is checked, nothing is started."""
    from omegaconf import OmegaConf

    from rlinf_vla.config import named_section
    from rlinf_vla.envs import env_section_config

    check_sections(cfg, ("env", "collect"))
    env_name, env = named_section(cfg["env"], "env")
    errors = SectionErrors()
    collect = errors.build(lambda: from_section(CollectConfig, cfg["collect"], "collect"))

    def check_env() -> Any:
        cfg = env_section_config(env_name, env, auto_reset=False)
        # an env without an expert, or (ManiSkill) a task or control mode without one
        problem = cfg.expert_problem(env_name)
        if problem:
            raise ConfigError(f"collect records the env's scripted expert: {problem}")
        return cfg

    built = errors.build(check_env)
    errors.raise_any()
    raw = OmegaConf.to_container(cfg, resolve=True)
    return CollectJob(env_name, env, collect, built, raw)


@dataclass
class _Episode:
    reset_id: int
    images: dict[str, list[np.ndarray]] = field(default_factory=dict)
    state: list[np.ndarray] = field(default_factory=list)
    action: list[np.ndarray] = field(default_factory=list)


def _robot_type(job: CollectJob) -> str:
    """``collect.robot_type``, else the env's robot
    (:meth:`~rlinf_vla.envs.base.EnvConfig.robot_type`)."""
    return job.collect.robot_type or job.env_config.robot_type(job.env_name)


def collect(job: CollectJob, progress: Any = None) -> dict[str, Any]:
    """Run the expert until ``collect.episodes`` successes (or ``max_attempts`` episodes) and
    write them; returns the summary also saved as ``meta/collect.json``."""
    from rlinf_vla.envs import make_env

    c = job.collect
    env = make_env(job.env_name, job.env_config)  # auto_reset off (validate)
    writer = None
    attempts = kept = steps = 0
    lengths: list[int] = []
    reset_ids: list[int] = []
    t0 = time.perf_counter()
    try:
        n = env.num_envs
        while kept < c.episodes and attempts < c.max_attempts:
            batch = min(n, c.max_attempts - attempts)
            ids = torch.arange(attempts, attempts + n) + c.first_reset_id
            episodes, success, instructions, played = _play(env, ids, batch)
            steps += played
            for i, ep in enumerate(episodes):
                if kept >= c.episodes:
                    break  # the episodes after the last one needed are not counted
                attempts += 1
                if not success[i]:
                    continue
                if writer is None:
                    writer = _writer(job, env, ep)
                writer.add_episode(
                    images={k: np.stack(v) for k, v in ep.images.items()},
                    state=np.stack(ep.state) if ep.state else None,
                    action=np.stack(ep.action),
                    task=instructions[i],
                )
                kept += 1
                lengths.append(len(ep.action))
                reset_ids.append(ep.reset_id)
            if progress is not None:
                progress(kept, attempts)
    except BaseException:
        if writer is not None:
            writer.abort()  # no half dataset: the episodes so far are in a hidden folder
        raise
    finally:
        env.close()
    if writer is None:
        raise CollectFailed(
            f"the expert succeeded in none of {attempts} episodes of {job.env_name} "
            f"({getattr(job.env_config, 'task', '')}): no dataset was written"
        )
    path = Path(writer.close())
    summary = {
        "env": job.env_name,
        "task": getattr(job.env_config, "task", None),
        "attempted": attempts,
        "kept": kept,
        "success_rate": kept / attempts if attempts else 0.0,
        "first_reset_id": c.first_reset_id,
        "reset_ids": reset_ids,
        "mean_length": float(np.mean(lengths)),
        "env_steps": steps,
        "seconds": time.perf_counter() - t0,
        "config": job.raw,
    }
    (path / "meta" / "collect.json").write_text(json.dumps(summary, indent=2))
    return summary


def _play(env: Any, ids: Tensor, batch: int) -> tuple[list[_Episode], Tensor, list[str], int]:
    """The expert's episodes from resets ``ids`` on the first ``batch`` envs (the others idle):
    each one's frames, whether it succeeded, the last instructions and the env steps taken."""
    n = env.num_envs
    obs = env.reset(ids)
    episodes = [_Episode(int(i)) for i in ids[:batch]]
    running = torch.zeros(n, dtype=torch.bool)
    running[:batch] = True
    success = torch.zeros(n, dtype=torch.bool)
    steps = 0
    while running.any():
        actions = env.expert_actions().float()
        for i in torch.nonzero(running).flatten().tolist():
            ep = episodes[i]
            for cam, img in obs.images.items():
                ep.images.setdefault(cam, []).append(img[i].cpu().numpy())
            if obs.state is not None:
                ep.state.append(obs.state[i].cpu().numpy().astype(np.float32))
            ep.action.append(actions[i].cpu().numpy().astype(np.float32))
        result = env.chunk_step(actions[:, None])
        steps += int(running.sum())
        success |= result.success & running
        running &= ~result.info["done"]
        obs = result.obs
    return episodes, success, obs.instruction, steps


def _writer(job: CollectJob, env: Any, ep: _Episode) -> Any:
    from rlinf_vla.data import LeRobotWriter

    cameras = {k: tuple(v[0].shape[:2]) for k, v in ep.images.items()}
    return LeRobotWriter(
        job.collect.output_dir,
        fps=job.collect.fps,
        cameras=cameras,
        state_dim=len(ep.state[0]) if ep.state else None,
        action_dim=env.action_dim,
        robot_type=_robot_type(job),
        overwrite=job.collect.overwrite,
    )


def run(job: CollectJob) -> Path:
    """``rlinf-vla collect``: a progress bar (successes kept, episodes tried, time left)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    c = job.collect
    console = Console(stderr=True)
    # describe(): MetaWorld's MT10 has a `task` field that only MT1 reads
    what = job.env_config.describe()
    task_text = f" {what}" if what else ""
    console.print(
        f"rlinf-vla collect: {c.episodes} successful expert episodes of {job.env_name}{task_text} "
        f"in {job.env_config.num_envs} envs -> {c.output_dir}",
        markup=False,
        highlight=False,
    )
    columns = [
        TextColumn("[bold]kept {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("collect", total=c.episodes, status="")

        def progress(kept: int, attempts: int) -> None:
            bar.update(
                task, completed=kept, status=f"{attempts} tried ({kept / attempts:.0%} kept)"
            )

        summary = collect(job, progress)
    console.print(
        f"kept {summary['kept']} of {summary['attempted']} episodes "
        f"({summary['success_rate']:.1%} expert success), mean length "
        f"{summary['mean_length']:.1f} steps, {summary['seconds']:.0f} s",
        highlight=False,
    )
    if summary["kept"] < c.episodes:
        console.print(
            f"[yellow]warning:[/] only {summary['kept']} successful episodes within "
            f"collect.max_attempts={c.max_attempts}"
        )
    print(f"dataset: {c.output_dir}")
    return Path(c.output_dir)
