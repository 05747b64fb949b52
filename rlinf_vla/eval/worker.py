"""The env worker of the evaluation: a few single-env slots, each running one trial at a time.

The driver assigns a trial to a free slot (:meth:`EvalEnvWorker.start`: reset the slot's env to
the trial's reset id), batches the observations of all busy slots of all workers through the
policy, and sends each slot its action chunk (:meth:`EvalEnvWorker.step`). A slot reports its
trial when the episode ends: success, steps, whether the simulator crashed, and the video.

Each slot holds its own ``num_envs=1`` env (``auto_reset=False``), so trials start and end
independently; the slots of one worker are stepped in threads (their simulators live in
subprocesses). A slot whose env raised is closed and rebuilt for its next trial.
"""

from __future__ import annotations

import os
import re
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlinf_vla.runtime import Worker
from rlinf_vla.types import Observation

if TYPE_CHECKING:
    from rlinf_vla.envs.base import EnvConfig

#: Longest error text kept in a trial record.
MAX_ERROR_CHARS = 2000


def slug(text: str) -> str:
    """A file-name-safe version of a task name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:120] or "task"


def video_path(trial: dict[str, Any], outcome: str) -> str:
    """Where the video of ``trial`` goes, relative to the results folder (a perturbed trial's
    under ``<suite>-<perturbation>``)."""
    kind = trial.get("perturbation")
    return os.path.join(
        "videos",
        slug(f"{trial['suite']}-{kind}" if kind else trial["suite"]),
        f"{trial['task_index']:03d}_{slug(trial['task'])}",
        f"init{trial['init_state']:04d}_{outcome}.mp4",
    )


def _error_text(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text[-MAX_ERROR_CHARS:]


@dataclass
class _Slot:
    env: Any = None
    env_key: tuple | None = None
    trial: dict[str, Any] | None = None
    success: bool = False
    frames: list[np.ndarray] = field(default_factory=list)
    flags: list[bool] = field(default_factory=list)
    instruction: str = ""


class EvalEnvWorker(Worker):
    """A few envs (slots) of ``env_name``, each running the trial the driver assigns it.

    Args:
        env_name: a registered env.
        env_config: the env's typed config (``num_envs`` and the reset behaviour are set
            here: one env per slot, no auto-reset; a trial's ``env_key`` changes fields).
        slots_per_worker: envs of each worker, by rank.
        videos: ``none``, ``failures`` or ``all``.
        output_dir: the results folder (videos go to ``<output_dir>/videos/``).
        video_fps: frames per second of the videos.
        video_camera: the camera the videos show.
    """

    def __init__(
        self,
        env_name: str,
        env_config: EnvConfig,
        slots_per_worker: list[int],
        videos: str = "none",
        output_dir: str = ".",
        video_fps: int = 10,
        video_camera: str = "main",
    ) -> None:
        self.env_name = env_name
        from rlinf_vla.envs import replace_config

        self.env_config = replace_config(
            env_config,
            num_envs=1,
            group_size=1,
            auto_reset=False,
            ignore_terminations=False,
            video_dir=None,
        )
        self.videos = videos
        self.output_dir = output_dir
        self.video_fps = video_fps
        self.video_camera = video_camera
        num_slots = slots_per_worker[self.rank]
        self.slots = [_Slot() for _ in range(num_slots)]
        self._pool = ThreadPoolExecutor(num_slots) if num_slots > 1 else None

    # ------------------------------------------------------------------------------ calls
    def start(self, assignments: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Reset slot ``i`` to trial ``assignments[i]`` (a :class:`~rlinf_vla.eval.config.Trial`
        as a dict). Returns per slot ``{"obs": Observation [1]}`` (plus ``changes``, what the
        perturbation changed in this episode, for a perturbed trial) or ``{"error": text}``."""
        return self._map(self._start, assignments)

    def step(self, actions: dict[int, torch.Tensor]) -> dict[int, dict[str, Any]]:
        """Execute the chunk ``actions[i]`` (``float32 [K, A]``) in slot ``i``.

        Returns per slot ``{"done": False, "obs": Observation [1]}`` while its episode runs,
        else ``{"done": True, "success", "steps", "invalid", "error", "video"}``.
        """
        return self._map(self._step, actions)

    def close(self) -> None:
        """Close every slot's env."""
        for slot in self.slots:
            self._drop_env(slot)
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------------------ slots
    def _map(self, fn: Any, items: dict[int, Any]) -> dict[int, dict[str, Any]]:
        if self._pool is None or len(items) <= 1:
            return {i: fn(i, x) for i, x in items.items()}
        futures = {i: self._pool.submit(fn, i, x) for i, x in items.items()}
        return {i: f.result() for i, f in futures.items()}

    def _drop_env(self, slot: _Slot) -> None:
        if slot.env is not None:
            try:
                slot.env.close()
            except Exception:  # a broken env may fail to close; it is dropped either way
                self.logger.warning("closing a broken env failed:\n%s", traceback.format_exc())
            slot.env = None
            slot.env_key = None

    def _env_for(self, slot: _Slot, env_key: tuple) -> Any:
        from rlinf_vla.envs import for_device, make_env, replace_config

        if slot.env is None or slot.env_key != env_key:
            self._drop_env(slot)
            config = replace_config(self.env_config, **dict(env_key))
            slot.env = make_env(self.env_name, for_device(config, self.device))
            slot.env_key = env_key
        return slot.env

    def _start(self, i: int, trial: dict[str, Any]) -> dict[str, Any]:
        slot = self.slots[i]
        slot.trial = trial
        slot.success = False
        slot.frames, slot.flags = [], []
        try:
            env = self._env_for(slot, tuple(tuple(kv) for kv in trial["env_key"]))
            obs = env.reset(torch.tensor([trial["reset_id"]]))
            details = env.episode_details(0) if trial.get("perturbation") else None
        except Exception as e:
            self._drop_env(slot)
            slot.trial = None
            return {"error": _error_text(e)}
        slot.instruction = obs.instruction[0]
        self._record(slot, obs)
        if details is None:
            return {"obs": obs}
        # The variant's BDDL changes, and for a new layout where the objects stand.
        layout = ("placement_seed", "placements", "fixture_placements")
        extra = {k: details[k] for k in layout if k in details}
        return {"obs": obs, "changes": {**details["changes"], **extra}}

    def _step(self, i: int, actions: torch.Tensor) -> dict[str, Any]:
        slot = self.slots[i]
        assert slot.trial is not None, f"slot {i} has no trial"
        env = slot.env
        chunk = torch.as_tensor(actions, dtype=torch.float32)[None]  # [1, K, A]
        try:
            if self.videos == "none":
                result = env.chunk_step(chunk)
                slot.success |= bool(result.success[0])
            else:  # one step at a time, so that every frame is rendered and recorded
                for k in range(chunk.shape[1]):
                    result = env.chunk_step(chunk[:, k : k + 1])
                    slot.success |= bool(result.success[0])
                    if not bool(result.info["done"][0]):
                        self._record(slot, result.obs)
                    elif result.final_obs is not None:
                        self._record(slot, result.final_obs)
                    if bool(result.info["done"][0]):
                        break
        except Exception as e:
            self._drop_env(slot)
            return self._finish(slot, success=False, steps=None, invalid=True, error=e)
        if not bool(result.info["done"][0]):
            return {"done": False, "obs": result.obs}
        invalid = bool(result.info["invalid"][0])
        steps = int(result.info["elapsed_steps"][0])
        return self._finish(slot, slot.success and not invalid, steps, invalid, None)

    def _finish(
        self,
        slot: _Slot,
        success: bool,
        steps: int | None,
        invalid: bool,
        error: BaseException | None,
    ) -> dict[str, Any]:
        trial = slot.trial
        assert trial is not None
        slot.trial = None
        outcome = "error" if invalid else ("success" if success else "failure")
        video = None
        if self.videos == "all" or (self.videos == "failures" and outcome != "success"):
            video = self._write_video(slot, trial, outcome)
        slot.frames, slot.flags = [], []
        if error is not None:
            message = _error_text(error)
        elif invalid:
            message = "the simulator crashed during the episode (restarted)"
        else:
            message = None
        return {
            "done": True,
            "success": success,
            "steps": steps,
            "invalid": invalid,
            "error": message,
            "video": video,
        }

    # ------------------------------------------------------------------------------ videos
    def _record(self, slot: _Slot, obs: Observation) -> None:
        if self.videos == "none":
            return
        slot.frames.append(obs.images[self.video_camera][0].cpu().numpy())
        slot.flags.append(slot.success)

    def _write_video(self, slot: _Slot, trial: dict[str, Any], outcome: str) -> str | None:
        from rlinf_vla.envs.video import annotate, write_mp4

        if not slot.frames:
            return None
        rel = video_path(trial, outcome)
        path = os.path.join(self.output_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        frames = [
            annotate(f, slot.instruction, t, ok)
            for t, (f, ok) in enumerate(zip(slot.frames, slot.flags, strict=True))
        ]
        tmp = path[: -len(".mp4")] + ".part.mp4"
        write_mp4(tmp, frames, self.video_fps)
        os.replace(tmp, path)
        return rel
