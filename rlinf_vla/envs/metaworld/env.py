"""MetaWorld (50 Sawyer tasks; MT1, MT10, MT50) behind the vectorised env contract, one
subprocess per env."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import warnings
from typing import Any

import numpy as np
import torch

from rlinf_vla.envs.base import StepOutput, VectorEnv, register_env
from rlinf_vla.envs.metaworld.config import (
    DEFAULT_MAX_STEPS,
    INSTRUCTIONS,
    MAX_REWARD,
    VARIATIONS_PER_TASK,
    MetaWorldEnvConfig,
)
from rlinf_vla.envs.vector import CRASHED, EnvWorkerError, SubprocBatch, SubprocEnvs
from rlinf_vla.types import Observation

_INSTALL_HINT = "pip install 'rlinf-vla[metaworld]' (PyPI metaworld==3.1.1 with mujoco==3.3.0)"


def check_installed() -> None:
    """Fail with the install command when MetaWorld is missing (without importing it)."""
    if importlib.util.find_spec("metaworld") is None:
        raise ImportError(f"the metaworld env needs MetaWorld: {_INSTALL_HINT}")


def _import_metaworld() -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # gymnasium's deprecation notes at import
            import metaworld
    except ImportError as e:
        raise ImportError(f"the metaworld env needs MetaWorld: {_INSTALL_HINT}") from e
    return metaworld


class MetaWorldCore:
    """One MetaWorld simulator in a subprocess (see ``rlinf_vla.envs.vector``).

    Builds the task's env when a reset id selects a task other than the current one (about
    0.5 s, plus 0.5 s for the renderer). The task's 50 configurations come from
    ``metaworld.MT1(task, seed=scene_seed)``, whose generation (50 resets of its own env) costs
    most: they are kept per task, so a switch back to a task only rebuilds its env. One env at a
    time (about 30 MB, and about 130 MB of render context). Renders with its own
    ``mujoco.Renderer`` only when an image is needed, and keeps MetaWorld's full observation for
    the scripted expert.
    """

    def __init__(self, cfg: MetaWorldEnvConfig, tasks: tuple[str, ...]) -> None:
        self.cfg = cfg
        self.tasks = tasks
        self.metaworld = _import_metaworld()
        self.configurations: dict[int, list[Any]] = {}  # task position -> its 50 tasks
        self.env: Any = None
        self.renderer: Any = None
        self.variations: list[Any] = []
        self.task_pos = -1
        self.policy: Any = None
        self.raw: np.ndarray | None = None

    def _build(self, pos: int) -> None:
        import mujoco

        self._close_env()
        name = self.tasks[pos]
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if pos not in self.configurations:
                bench = self.metaworld.MT1(name, seed=self.cfg.scene_seed)
                self.configurations[pos] = list(bench.train_tasks)
            env = self.metaworld.env_dict.ALL_V3_ENVIRONMENTS[name]()
        env.max_path_length = 10**9  # the VectorEnv keeps the time limit
        model = env.model
        if self.cfg.fast_render:  # read when the render context is made: set them before
            model.vis.quality.shadowsize = 0
            model.vis.quality.offsamples = 0
        s = self.cfg.image_size
        model.vis.global_.offwidth = max(model.vis.global_.offwidth, s)
        model.vis.global_.offheight = max(model.vis.global_.offheight, s)
        renderer = mujoco.Renderer(model, s, s)
        if self.cfg.fast_render:
            # The skybox stays: it is MetaWorld's backdrop (without it the background is black).
            for flag in ("mjRND_REFLECTION", "mjRND_SHADOW"):
                renderer.scene.flags[getattr(mujoco.mjtRndFlag, flag)] = 0
        self.env, self.renderer = env, renderer
        self.variations = self.configurations[pos]
        self.task_pos = pos
        self.policy = None

    def _image(self) -> np.ndarray:
        self.renderer.update_scene(self.env.data, camera=self.cfg.camera)
        # MetaWorld's cameras render upside down: turn the image by 180 degrees.
        return np.ascontiguousarray(self.renderer.render()[::-1, ::-1])

    def _obs(self, raw: np.ndarray) -> dict[str, Any]:
        state = raw[:4] if self.cfg.state_mode == "proprio" else raw
        return {
            "images": {"main": self._image()},
            "state": np.asarray(state, dtype=np.float32),
            "instruction": INSTRUCTIONS[self.tasks[self.task_pos]],
        }

    def reset(self, reset_id: int) -> dict[str, Any]:
        pos, variation = self.cfg.task_variation(int(reset_id))
        if pos != self.task_pos:
            self._build(pos)
        self.env.set_task(self.variations[variation])
        raw, _ = self.env.reset()
        self.raw = raw
        return self._obs(raw)

    def step(self, action: np.ndarray, render: bool) -> tuple[dict | None, float, bool, bool]:
        action = np.clip(np.asarray(action, dtype=np.float32), -1.0, 1.0)
        raw, reward, _, _, info = self.env.step(action)
        self.raw = raw
        success = bool(info["success"])
        if self.cfg.reward_mode == "sparse":
            reward = float(success)
        elif self.cfg.reward_mode == "normalized_dense":
            reward = reward / MAX_REWARD
        obs = self._obs(raw) if render or success else None
        return obs, float(reward), success, success

    def expert_action(self) -> np.ndarray:
        """MetaWorld's scripted policy for the task, on the full observation: float32 ``[4]``
        in ``[-1, 1]`` (MetaWorld's gripper sign is the package's: +1 closes)."""
        if self.raw is None:
            raise RuntimeError("call reset() before expert_action()")
        if self.policy is None:
            from metaworld.policies import ENV_POLICY_MAP

            self.policy = ENV_POLICY_MAP[self.tasks[self.task_pos]]()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Constant(s) may be too high": clipped below
            action = self.policy.get_action(self.raw)
        return np.clip(np.asarray(action, dtype=np.float32), -1.0, 1.0)

    def sim_state(self) -> dict[str, Any]:
        """The current scene, for checks: MuJoCo's ``qpos``, ``qvel``, the mocap pose and the
        task's configuration vector."""
        data = self.env.data
        return {
            "qpos": data.qpos.copy(),
            "qvel": data.qvel.copy(),
            "mocap_pos": data.mocap_pos.copy(),
            "rand_vec": np.asarray(self.env._last_rand_vec).copy(),
        }

    def _close_env(self) -> None:
        if self.renderer is not None:
            self.renderer.close()
            self.renderer = None
        if self.env is not None:
            self.env.close()
            self.env = None

    def close(self) -> None:
        self._close_env()


@register_env("metaworld")
class MetaWorldEnv(VectorEnv):
    """MetaWorld: 50 tabletop tasks for a Sawyer arm with a two-finger gripper (MuJoCo).

    Task sheet:

    - **Description.** ``task_set`` selects MT1 (the single task ``task``, e.g.
      ``pick-place-v3``), MT10 (10 tasks: reach, push, pick-place, door-open, drawer-open,
      drawer-close, button-press-topdown, peg-insert-side, window-open, window-close) or MT50
      (all 50). The instruction of each task is in :data:`INSTRUCTIONS` (e.g. "pick up the
      puck and place it at the goal").
    - **Randomisation.** Each task has 50 goal / object configurations, those of
      ``metaworld.MT1(task, seed=scene_seed).train_tasks``. Reset id ``r`` selects task
      ``(r // 50) % n_tasks`` and configuration ``r % 50`` (:meth:`MetaWorldEnvConfig.task_variation`;
      ``reset_id_layout="interleaved"``: task ``r % n_tasks``, configuration
      ``(r // n_tasks) % 50``);
      the same id gives the same scene in any process, whatever ran before.
    - **Success.** MetaWorld's ``info["success"]`` (the task's own distance / angle test); it
      terminates the episode. ``reward_mode="sparse"``: reward 1.0 at success, else 0;
      ``"dense"``: MetaWorld's shaped reward (0 .. 10); ``"normalized_dense"``: that over 10.
      Time limit: MetaWorld's ``max_path_length``, 500 steps (``max_episode_steps``
      overrides it).
    - **Observation.** ``images["main"]``: the ``camera`` view (``corner2`` by default), uint8
      ``[B, S, S, 3]``, turned by 180 degrees (MetaWorld's cameras render upside down);
      ``state``: float32 ``[B, 4]`` = hand position (3) and gripper opening (0 closed .. 1 open)
      with ``state_mode="proprio"``, MetaWorld's full 39-D observation with ``"full"``.
    - **Action.** float32 ``[4]`` in ``[-1, 1]`` (clipped): hand xyz delta (x1 cm: MetaWorld's
      mocap ``action_scale``), gripper (+1 close, -1 open: MetaWorld's sign, the package's
      convention). The hand keeps its orientation.
    - **Expert.** :meth:`expert_actions`: MetaWorld's scripted policy of each task
      (``metaworld.policies``), run in the worker on the full observation.
    - **Processes.** One subprocess per env; a task switch builds the task's simulator (about
      1 s; the first time a worker meets a task, a few seconds more to generate its
      configurations); ``task_per_env`` keeps each env on one task between the episodes its
      cursor starts. A crashed subprocess is restarted and its episode reported invalid.
      Images are rendered only at steps whose observation is used; ``fast_render`` turns
      shadows, reflections and multisampling off.
    """

    config_cls = MetaWorldEnvConfig

    def __init__(self, config: MetaWorldEnvConfig) -> None:
        check_installed()
        self.cfg = config
        self.tasks = config.tasks
        env_vars = {
            "MUJOCO_GL": config.render_backend,
            "PYOPENGL_PLATFORM": config.render_backend,
        }
        factory = functools.partial(MetaWorldCore, config, self.tasks)
        self._batch = SubprocBatch(
            SubprocEnvs(
                [factory] * config.num_envs,
                name="metaworld",
                env_vars=env_vars,
                timeout_s=config.worker_timeout_s,
                per_process=config.envs_per_process,
            )
        )
        super().__init__(config, DEFAULT_MAX_STEPS)

    @property
    def action_dim(self) -> int:
        return 4

    @property
    def num_reset_ids(self) -> int:
        return VARIATIONS_PER_TASK * len(self.tasks)

    @property
    def workers(self) -> SubprocEnvs:
        """The subprocess pool (one MetaWorld simulator per env)."""
        return self._batch.envs

    def next_reset_ids(self, env_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The cursor's ids (:meth:`VectorEnv.next_reset_ids`), each in its env's own task
        with ``task_per_env`` (:meth:`MetaWorldEnvConfig.pin_task`)."""
        if env_ids is None:
            env_ids = torch.arange(self.num_envs)
        return self.cfg.pin_task(env_ids, super().next_reset_ids(env_ids))

    def task_of(self, reset_ids: torch.Tensor | list[int]) -> list[str]:
        """The task each reset id selects."""
        return [self.tasks[self.cfg.task_variation(int(r))[0]] for r in reset_ids]

    def sim_state(self, env_id: int = 0) -> dict[str, Any]:
        """The scene of env ``env_id`` (:meth:`MetaWorldCore.sim_state`)."""
        return self.workers.call("sim_state", {env_id: ()})[env_id]

    def expert_actions(self) -> torch.Tensor:
        """MetaWorld's scripted policy for each env's task and current state, float32
        ``[B, 4]`` in ``[-1, 1]`` (gripper +1 close). The policies read the full observation
        (object and goal positions) in the worker, whatever ``state_mode``."""
        self._check_usable()
        results = self.workers.call("expert_action", {i: () for i in range(self.num_envs)})
        crashed = [i for i, r in results.items() if r is CRASHED]
        if crashed:
            raise EnvWorkerError(
                f"metaworld env(s) {crashed} crashed computing the expert action; they were "
                f"restarted and lost their episode: call reset()"
            )
        return torch.from_numpy(np.stack([results[i] for i in range(self.num_envs)])).float()

    def _reset_envs(self, env_ids: torch.Tensor, reset_ids: torch.Tensor) -> Observation:
        return self._batch.reset(env_ids, reset_ids)

    def _step_envs(
        self, actions: torch.Tensor, active: torch.Tensor, need_obs: torch.Tensor
    ) -> StepOutput:
        return self._batch.step(actions, active, need_obs)

    def _close(self) -> None:
        self._batch.envs.close()
