"""A ``gymnasium.vector.VectorEnv`` view of any registered env, for gymnasium's wrappers and
tools::

    from gymnasium.wrappers.vector import RecordEpisodeStatistics
    from rlinf_vla.envs import make_gym_env

    env = RecordEpisodeStatistics(make_gym_env("toy", num_envs=4))
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(env.action_space.sample())

One action per env per step (``[num_envs, action_dim]``; a chunk of one), numpy arrays in and
out. Observations are ``{"images": {camera: uint8 [B, H, W, 3]}, "state": float32 [B, D],
"instruction": (str, ...)}`` (no ``state`` key for an env without proprioception). Episodes
reset in the same step they end, gymnasium's ``AutoresetMode.SAME_STEP``: the observation
returned is the next episode's first, and ``info["final_obs"]`` / ``info["_final_obs"]`` hold
the last observation of the envs that ended (``info["final_info"]`` their info). Every step's
``info`` has ``success``, ``invalid`` (a crashed simulator, see :mod:`rlinf_vla.envs.base`) and
``reset_id`` per env.

``reset(seed=s)`` starts env ``i`` in the scene of reset id ``s + i`` (the same seed, the same
scenes, as gymnasium's vector envs seed env ``i`` with ``seed + i``); ``reset()`` takes each env's
next id from its cursor. ``options={"reset_ids": [...]}`` gives the ids themselves. The view
resets the env once when it is built, to read the observation's sizes for its spaces.
"""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium
import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

from rlinf_vla.envs.base import VectorEnv
from rlinf_vla.types import Observation

__all__ = ["GymVectorEnv"]

#: The longest instruction the observation space admits (characters).
MAX_INSTRUCTION = 512


class GymVectorEnv(gymnasium.vector.VectorEnv):
    """``env`` (any :class:`~rlinf_vla.envs.base.VectorEnv`) behind gymnasium's vector API.

    Args:
        env: the env; the view owns it (``close()`` closes it).
        action_low, action_high: the bounds of the action space (the envs here take actions
            normalised to ``[-1, 1]``: end-effector deltas and the gripper).
    """

    metadata: ClassVar[dict[str, Any]] = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, env: VectorEnv, action_low: float = -1.0, action_high: float = 1.0):
        self.env = env
        self.num_envs = env.num_envs
        first = env.reset()
        cameras = spaces.Dict(
            {
                name: spaces.Box(0, 255, tuple(image.shape[1:]), np.uint8)
                for name, image in first.images.items()
            }
        )
        single: dict[str, spaces.Space] = {"images": cameras}
        if first.state is not None:
            single["state"] = spaces.Box(-np.inf, np.inf, (first.state.shape[1],), np.float32)
        single["instruction"] = spaces.Text(MAX_INSTRUCTION, charset=_printable(), min_length=0)
        self.single_observation_space = spaces.Dict(single)
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.single_action_space = spaces.Box(
            action_low, action_high, (env.action_dim,), np.float32
        )
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.render_mode = None

    def reset(
        self, *, seed: int | list[int] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed if isinstance(seed, int) else None)
        ids = (options or {}).get("reset_ids")
        if ids is None and seed is not None:
            ids = [seed + i for i in range(self.num_envs)] if isinstance(seed, int) else seed
        obs = self.env.reset(ids)
        every = np.ones(self.num_envs, dtype=bool)
        return _numpy(obs), {"reset_id": self.env.reset_ids.numpy(), "_reset_id": every}

    def step(
        self, actions: Any
    ) -> tuple[dict[str, Any], np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        actions = torch.as_tensor(np.asarray(actions, dtype=np.float32))
        if actions.shape != (self.num_envs, self.env.action_dim):
            raise ValueError(
                f"actions must have shape [num_envs, action_dim] = "
                f"[{self.num_envs}, {self.env.action_dim}], got {list(actions.shape)}"
            )
        out = self.env.chunk_step(actions[:, None])
        terminated = out.terminated[:, 0].numpy()
        truncated = out.truncated[:, 0].numpy()
        infos: dict[str, Any] = {}
        final = None if out.final_obs is None else _numpy(out.final_obs)
        for i in range(self.num_envs):
            env_info = {
                "success": bool(out.success[i]),
                "invalid": bool(out.info["invalid"][i]),
                "reset_id": int(out.info["episode_reset_ids"][i]),
            }
            if final is not None and (terminated[i] or truncated[i]):
                last = _row(final, i)
                infos = self._add_info(infos, {"final_obs": last, "final_info": env_info}, i)
            infos = self._add_info(infos, env_info, i)
        return (
            _numpy(out.obs),
            out.reward[:, 0].double().numpy(),
            terminated,
            truncated,
            infos,
        )

    def close_extras(self, **kwargs: Any) -> None:
        self.env.close()


def _numpy(obs: Observation) -> dict[str, Any]:
    out: dict[str, Any] = {"images": {k: v.cpu().numpy() for k, v in obs.images.items()}}
    if obs.state is not None:
        out["state"] = obs.state.cpu().float().numpy()
    out["instruction"] = tuple(obs.instruction)
    return out


def _row(obs: dict[str, Any], i: int) -> dict[str, Any]:
    row: dict[str, Any] = {"images": {k: v[i] for k, v in obs["images"].items()}}
    if "state" in obs:
        row["state"] = obs["state"][i]
    row["instruction"] = obs["instruction"][i]
    return row


def _printable() -> frozenset[str]:
    import string

    return frozenset(string.printable)
