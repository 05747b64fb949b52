"""ManiSkill3 tasks behind the vectorised env contract (CPU subprocesses or one GPU simulation)."""

from __future__ import annotations

import functools
import os
import platform
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlinf_vla.envs.base import StepOutput, VectorEnv, register_env
from rlinf_vla.envs.maniskill.config import ManiSkillEnvConfig, default_instruction
from rlinf_vla.envs.maniskill.meshes import SceneSimplifier
from rlinf_vla.envs.vector import CRASHED, EnvWorkerError, SubprocBatch, SubprocEnvs
from rlinf_vla.types import Observation

_DOWNLOAD_HINT = "python -m mani_skill.utils.download_asset {uid}"


class MissingAssetError(RuntimeError):
    """A ManiSkill task or robot needs assets that are not on disk (no download is attempted)."""


def import_maniskill() -> tuple[Any, Any]:
    """Import gymnasium and ManiSkill (registering its tasks), never prompting for downloads."""
    os.environ["MS_SKIP_ASSET_DOWNLOAD_PROMPT"] = "1"
    try:
        import gymnasium as gym
        import mani_skill.envs
        from mani_skill.utils import download_asset
    except ImportError as e:
        raise ImportError(
            "the maniskill env needs ManiSkill3: pip install 'rlinf-vla[maniskill]'"
        ) from e

    def refuse(message: str) -> bool:
        raise MissingAssetError(
            f"{message.replace(' Would you like to download them now?', '')} "
            f"Nothing is downloaded automatically; fetch them with "
            f"`{_DOWNLOAD_HINT.format(uid='<asset id or env id>')}`."
        )

    download_asset.prompt_yes_no = refuse
    import mani_skill

    return gym, mani_skill


def physx_gpu_library() -> tuple[Path, str]:
    """Where SAPIEN looks for its PhysX GPU library, and the address it downloads it from."""
    import sapien.physx

    version = sapien.physx.version()
    arch = "linux-aarch64-so" if platform.machine() in ("aarch64", "arm64") else "linux-so"
    url = f"https://github.com/sapien-sim/physx-precompiled/releases/download/{version}/{arch}.zip"
    return Path.home() / ".sapien" / "physx" / version / "libPhysXGpu_64.so", url


def enable_physx_gpu() -> None:
    """Load SAPIEN's PhysX GPU library, which SAPIEN downloads once (about 100 MB) on first use.

    Raises:
        MissingAssetError: the library is not on disk and could not be downloaded (an offline
            machine); the message names the file to fetch and where to unzip it.
    """
    import sapien.physx

    if sapien.physx.is_gpu_enabled():
        return
    lib, url = physx_gpu_library()
    try:
        sapien.physx.enable_gpu()
    except Exception as e:
        if lib.exists():
            raise
        raise MissingAssetError(
            f"ManiSkill's GPU simulation needs SAPIEN's PhysX GPU library {lib}, which is not "
            f"on disk and could not be downloaded ({type(e).__name__}). Download {url} and "
            f"unzip it into {lib.parent}, or set env.sim_backend=cpu."
        ) from e


def check_task(task: str) -> Any:
    """The ManiSkill ``EnvSpec`` of ``task``; fails listing the known tasks or missing assets."""
    import_maniskill()
    from mani_skill.utils import assets
    from mani_skill.utils.registration import REGISTERED_ENVS

    if task not in REGISTERED_ENVS:
        raise ValueError(f"unknown ManiSkill task {task!r}; known tasks: {sorted(REGISTERED_ENVS)}")
    spec = REGISTERED_ENVS[task]
    missing: list[str] = []
    for asset_id in spec.asset_download_ids or []:
        ids = (
            assets.expand_data_group_into_individual_data_source_ids(asset_id)
            if asset_id in assets.DATA_GROUPS
            else [asset_id]
        )
        missing += [i for i in ids if not assets.is_data_source_downloaded(i)]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        )
        raise MissingAssetError(
            f"ManiSkill task {task!r} needs asset(s) {shown}, which are not on disk. "
            f"Download them with `{_DOWNLOAD_HINT.format(uid=task)}` "
            f"(needs network access), or pick a task that ships with the wheel."
        )
    return spec


def default_robot(task: str) -> str | None:
    """The robot uid ``task`` builds when ``robot`` is not set: its registered default
    ``robot_uids``, else the default of its constructor's ``robot_uids`` argument; ``None``
    when neither names a single robot (a class that passes a fixed robot to its parent,
    several robots)."""
    import inspect

    import_maniskill()
    from mani_skill.utils.registration import REGISTERED_ENVS

    if task not in REGISTERED_ENVS:
        raise ValueError(f"unknown ManiSkill task {task!r}; known tasks: {sorted(REGISTERED_ENVS)}")
    spec = REGISTERED_ENVS[task]
    uid = (spec.default_kwargs or {}).get("robot_uids")
    if uid is None:
        param = inspect.signature(spec.cls.__init__).parameters.get("robot_uids")
        uid = None if param is None else param.default
    return uid if isinstance(uid, str) else None


def robot_has_camera(task: str, robot: str | None) -> bool:
    """Whether the robot of ``task`` (``robot``, else :func:`default_robot`) carries its own
    camera, which the env shows as ``images["wrist"]`` (see ``_Cameras``): its agent class
    defines sensors. An unknown default robot counts as having none."""
    uid = robot if robot is not None else default_robot(task)
    if uid is None:
        return False
    import_maniskill()
    from mani_skill.agents.base_agent import BaseAgent
    from mani_skill.agents.registration import REGISTERED_AGENTS

    if uid not in REGISTERED_AGENTS:
        raise ValueError(f"unknown ManiSkill robot {uid!r}; known: {sorted(REGISTERED_AGENTS)}")
    return REGISTERED_AGENTS[uid].agent_cls._sensor_configs is not BaseAgent._sensor_configs


def _make_kwargs(cfg: ManiSkillEnvConfig, num_envs: int, gpu: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "num_envs": num_envs,
        "obs_mode": "rgb",
        "control_mode": cfg.control_mode,
        "reward_mode": cfg.reward_mode,
        "sim_backend": "physx_cuda" if gpu else "physx_cpu",
        "render_backend": "gpu" if gpu else "cpu",
        "sensor_configs": {
            "width": cfg.image_size,
            "height": cfg.image_size,
            "shader_pack": cfg.shader,
        },
    }
    if cfg.robot is not None:
        kwargs["robot_uids"] = cfg.robot
    return kwargs


class _ObsModeAs:
    """Temporarily switch a ManiSkill env's observation mode (``"state_dict"`` skips rendering).

    ManiSkill renders every camera in ``step()``/``reset()`` when the obs mode is visual; this
    switch lets a chunk skip the images of the steps nobody looks at. Physics is unaffected.
    """

    def __init__(self, env: Any, mode: str) -> None:
        self.env, self.mode = env, mode

    def __enter__(self) -> None:
        self.saved = self.env._obs_mode
        self.env._obs_mode = self.mode

    def __exit__(self, *exc: object) -> None:
        self.env._obs_mode = self.saved


class _Cameras:
    """Which ManiSkill sensors are the ``main`` and ``wrist`` images."""

    def __init__(self, env: Any, cfg: ManiSkillEnvConfig) -> None:
        sensors = list(env._sensor_configs)
        robot = set(env._agent_sensor_configs)
        scene = [s for s in sensors if s not in robot]
        main = cfg.main_camera or (scene[0] if scene else None)
        if main is None or main not in sensors:
            raise ValueError(
                f"ManiSkillEnvConfig.main_camera: camera {main!r} not in task {cfg.task!r}; "
                f"its cameras: {sensors}"
            )
        self.names = {"main": main}
        wrist = [s for s in sensors if s in robot and s != main]
        if cfg.wrist and wrist:
            self.names["wrist"] = wrist[0]


def _reveal_hidden(env: Any) -> None:
    """Show the goal markers ManiSkill hides from cameras (e.g. PickCube's green goal sphere).

    ManiSkill hides them because its RL baselines get the goal in the state; a VLA only sees the
    images, and the instruction refers to the marker. Tasks refill the list when they rebuild
    their scene, so this runs after every reset.
    """
    for obj in env._hidden_objects:
        obj.show_visual()
    env._hidden_objects = []


def _flip_gripper(env: Any, cfg: ManiSkillEnvConfig) -> bool:
    if cfg.gripper_convention != "close_positive":
        return False
    controllers = getattr(env.agent.controller, "controllers", None)
    return bool(controllers) and "gripper" in list(controllers)[-1]


def _proprio(env: Any) -> torch.Tensor:
    """Robot joint positions followed by the TCP pose (xyz, quaternion wxyz) when it has one."""
    parts = [env.agent.robot.get_qpos()]
    tcp = getattr(env.agent, "tcp", None)
    if tcp is not None:
        parts.append(tcp.pose.raw_pose)
    return torch.cat([p.float() for p in parts], dim=-1)


def _make_expert(env: Any, cfg: ManiSkillEnvConfig) -> Any:
    from rlinf_vla.envs.maniskill.experts import make_expert

    return make_expert(cfg.task, env)


def _expert_to_env(actions: torch.Tensor, cfg: ManiSkillEnvConfig) -> torch.Tensor:
    """Expert actions (gripper +1 close) in the env's gripper convention."""
    if cfg.gripper_convention == "native":  # ManiSkill's own: +1 opens
        actions = actions.clone()
        actions[:, -1] = -actions[:, -1]
    return actions


def _task_state(env: Any) -> torch.Tensor:
    """The task's own state observation (ManiSkill's ``extra`` in ``obs_mode="state"``: object
    and goal poses...), flattened to ``[n, D]``, whatever the env's observation mode."""
    from mani_skill.envs.utils.observations import parse_obs_mode_to_struct
    from mani_skill.utils import common

    saved = env._obs_mode, env.obs_mode_struct
    env._obs_mode, env.obs_mode_struct = "state_dict", parse_obs_mode_to_struct("state_dict")
    try:
        extra = env._get_obs_extra(env.get_info())
    finally:
        env._obs_mode, env.obs_mode_struct = saved
    return common.flatten_state_dict(extra, use_torch=True).float()


def _state(env: Any, cfg: ManiSkillEnvConfig) -> torch.Tensor:
    """``state`` of the observation: :func:`_proprio`, then the task state when privileged."""
    proprio = _proprio(env)
    if cfg.state_mode != "privileged":
        return proprio
    return torch.cat([proprio, _task_state(env).to(proprio.device)], dim=-1)


class ManiSkillCore:
    """One CPU-simulated ManiSkill env, living in a subprocess (see ``rlinf_vla.envs.vector``)."""

    def __init__(self, cfg: ManiSkillEnvConfig) -> None:
        gym, _ = import_maniskill()
        self.cfg = cfg
        self.env = gym.make(cfg.task, **_make_kwargs(cfg, 1, gpu=False)).unwrapped
        self.cameras = _Cameras(self.env, cfg)
        self.flip = _flip_gripper(self.env, cfg)
        self.instruction = cfg.instruction or default_instruction(cfg.task)
        self.simplifier = SceneSimplifier() if cfg.fast_render else None
        self.expert: Any = None  # built on the first expert_action()

    def spec(self) -> dict[str, Any]:
        return {
            "action_dim": int(self.env.single_action_space.shape[-1]),
            "cameras": dict(self.cameras.names),
        }

    def _obs(self, raw: dict) -> dict[str, Any]:
        data = raw["sensor_data"]
        return {
            "images": {k: data[v]["rgb"][0].cpu().numpy() for k, v in self.cameras.names.items()},
            "state": _state(self.env, self.cfg)[0].cpu().numpy(),
            "instruction": self.instruction,
        }

    def reset(self, reset_id: int) -> dict[str, Any]:
        with _ObsModeAs(self.env, "state_dict"):
            self.env.reset(seed=int(reset_id))
        if self.cfg.show_goal:
            _reveal_hidden(self.env)
        if self.simplifier is not None:  # after every reset: a reconfigured scene is new
            self.simplifier.apply(self.env.scene)
        if self.expert is not None:
            self.expert.reset()
        return self._obs(self.env.get_obs(unflattened=True))

    def expert_action(self) -> np.ndarray:
        """The scripted expert's action for the current state, float32 ``[A]`` (env units)."""
        if self.expert is None:
            self.expert = _make_expert(self.env, self.cfg)
        return _expert_to_env(self.expert.act(), self.cfg)[0].numpy()

    def step(self, action: np.ndarray, render: bool) -> tuple[dict | None, float, bool, bool]:
        action = np.array(action, dtype=np.float32)
        if self.flip:
            action[-1] = -action[-1]
        with _ObsModeAs(self.env, "state_dict"):
            _, reward, terminated, _, info = self.env.step(action[None])
        terminated = bool(terminated[0])
        success = bool(info["success"][0]) if "success" in info else False
        obs = self._obs(self.env.get_obs(info, unflattened=True)) if render or terminated else None
        return obs, float(reward[0]), terminated, success

    def close(self) -> None:
        self.env.close()


class _GpuBatch:
    """All envs in one GPU-simulated ManiSkill env (``sim_backend="physx_cuda"``)."""

    def __init__(self, cfg: ManiSkillEnvConfig) -> None:
        gym, _ = import_maniskill()
        enable_physx_gpu()
        self.cfg = cfg
        self.gym = gym
        self.device = torch.device(cfg.device)
        self.instruction = cfg.instruction or default_instruction(cfg.task)
        self._state: dict | None = None
        self._build()

    def _build(self) -> None:
        cfg = self.cfg
        self.env = self.gym.make(cfg.task, **_make_kwargs(cfg, cfg.num_envs, gpu=True)).unwrapped
        self.cameras = _Cameras(self.env, cfg)
        self.flip = _flip_gripper(self.env, cfg)
        self.action_dim = int(self.env.single_action_space.shape[-1])
        self.expert: Any = None  # built on the first expert_actions()

    def _obs(self, raw: dict, rows: torch.Tensor | None = None) -> Observation:
        data = raw["sensor_data"]
        images = {k: data[v]["rgb"] for k, v in self.cameras.names.items()}
        state = _state(self.env, self.cfg)
        if rows is not None:
            idx = rows.to(state.device)
            images = {k: v[idx] for k, v in images.items()}
            state = state[idx]
        n = len(state)
        return Observation(
            images={k: v.to(self.device) for k, v in images.items()},
            state=state.to(self.device),
            instruction=[self.instruction] * n,
        )

    def reset(self, env_ids: torch.Tensor, reset_ids: torch.Tensor) -> Observation:
        # One partial reset per env: ManiSkill seeds a reset batch with its first seed, so only
        # single-env resets make the scene a function of the reset id alone.
        with _ObsModeAs(self.env, "state_dict"):
            for i, rid in zip(env_ids.tolist(), reset_ids.tolist(), strict=True):
                self.env.reset(seed=[int(rid)], options={"env_idx": torch.tensor([i])})
        if self.cfg.show_goal:
            _reveal_hidden(self.env)
        if self.expert is not None:
            self.expert.reset(env_ids)
        raw = self.env.get_obs(unflattened=True)
        return self._obs(raw, env_ids)

    def expert_actions(self) -> torch.Tensor:
        if self.expert is None:
            self.expert = _make_expert(self.env, self.cfg)
        return _expert_to_env(self.expert.act(), self.cfg)

    def step(
        self, actions: torch.Tensor, active: torch.Tensor, need_obs: torch.Tensor
    ) -> StepOutput:
        actions = actions.clone()
        if self.flip:
            actions[:, -1] = -actions[:, -1]
        with _ObsModeAs(self.env, "state_dict"):
            _, reward, terminated, _, info = self.env.step(actions.to(self.env.device))
        success = info.get("success", torch.zeros_like(terminated))
        if bool((need_obs.to(terminated.device) | terminated).any()):
            obs = self._obs(self.env.get_obs(info, unflattened=True))
        else:
            obs = Observation(images={}, state=None, instruction=[self.instruction] * len(reward))
        return StepOutput(
            obs=obs,
            reward=reward.float().cpu(),
            terminated=terminated.bool().cpu(),
            success=success.bool().cpu(),
        )

    def offload(self) -> None:
        state = self.env.get_state_dict()
        self._state = _to_device(state, torch.device("cpu"))
        self.env.close()
        del self.env
        torch.cuda.empty_cache()

    def onload(self) -> None:
        self._build()
        self.env.set_state_dict(_to_device(self._state, self.env.device))
        self._state = None

    def close(self) -> None:
        if hasattr(self, "env"):
            self.env.close()


def _to_device(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, dict):
        return {k: _to_device(v, device) for k, v in tree.items()}
    return tree.to(device) if isinstance(tree, torch.Tensor) else tree


@register_env("maniskill")
class ManiSkillEnv(VectorEnv):
    """ManiSkill3 tabletop tasks (PickCube, PushCube, StackCube, PegInsertionSide, ...).

    Task sheet (shared by every task; the task's own docstring in ManiSkill gives its
    randomisation and success condition):

    - **Description.** ``task`` is any ManiSkill env id whose assets are on disk; the
      instruction comes from :data:`~rlinf_vla.envs.maniskill.config.INSTRUCTIONS` (e.g.
      PickCube: "pick up the red cube and move it to the green target").
    - **Randomisation.** ManiSkill's own, seeded by the reset id: the same id gives the same
      scene. The CPU and GPU backends draw different scenes for the same id (different random
      generators), each deterministic.
    - **Success.** ManiSkill's ``info["success"]``; it terminates the episode. The default
      reward is sparse (1.0 on success); ``reward_mode="dense"`` gives the task's shaped reward.
      Time limit: the task's registered ``max_episode_steps`` (PickCube: 50) unless configured.
    - **Observation.** Goal markers ManiSkill hides from cameras (PickCube's green goal) are shown
      (``show_goal``). ``images["main"]``: the task's first camera (``base_camera`` for the
      tabletop tasks), ``images["wrist"]``: the robot's hand camera when it has one (robot
      ``panda_wristcam``), both uint8 ``[B, S, S, 3]`` with ``S = image_size``; ``state``:
      float32 joint positions followed by the TCP pose (xyz + quaternion wxyz), ``[B, 16]`` for
      the Panda.
    - **Action.** ``pd_ee_delta_pose``: float32 ``[7]`` in ``[-1, 1]``: xyz delta (x0.1 m, root
      frame), rotation delta as XYZ Euler angles of ``-0.1 * a[3:6]`` rad (ManiSkill scales the
      rotation by its lower bound, -0.1, so ``+a`` turns the negative way; clipped to norm 1;
      applied in the root frame on the left of the TCP's orientation), gripper (+1 close, -1
      open by default). Other controllers via ``control_mode`` (their action size becomes
      ``action_dim``).
    - **Expert.** :meth:`expert_actions` gives a scripted expert's action from privileged state
      for PickCube, PushCube and StackCube (``pd_ee_delta_pose`` only; see
      :mod:`rlinf_vla.envs.maniskill.experts`).
    - **Backends.** GPU: ``num_envs`` envs in one process. CPU: one env per subprocess
      (ManiSkill's CPU simulator holds one env); crashed workers are restarted and their episode
      reported invalid. Missing assets fail at construction, naming the asset and the download
      command; nothing is downloaded and nothing prompts.
    - **Rendering.** Cameras are rendered only for the steps whose observation is used (the last
      step of a chunk, the step an episode ends, recorded envs), so longer chunks are cheaper.
    """

    config_cls = ManiSkillEnvConfig

    def __init__(self, config: ManiSkillEnvConfig) -> None:
        self.cfg = config
        spec = check_task(config.task)
        backend = config.sim_backend
        if backend == "auto":
            backend = "gpu" if torch.cuda.is_available() else "cpu"
            if backend == "gpu":
                try:
                    enable_physx_gpu()
                except MissingAssetError as e:
                    warnings.warn(f"{e} Using the CPU simulator.", stacklevel=2)
                    backend = "cpu"
        self.backend = backend
        self._gpu: _GpuBatch | None = None
        self._cpu: SubprocBatch | None = None
        if backend == "gpu":
            self._gpu = _GpuBatch(config)
            self._action_dim = self._gpu.action_dim
            self.cameras = dict(self._gpu.cameras.names)
        else:
            factories = [functools.partial(ManiSkillCore, config)] * config.num_envs
            self._cpu = SubprocBatch(
                SubprocEnvs(
                    factories,
                    name="maniskill",
                    env_vars={"MS_SKIP_ASSET_DOWNLOAD_PROMPT": "1"},
                    timeout_s=config.worker_timeout_s,
                    per_process=config.envs_per_subprocess(),
                )
            )
            try:
                info = self._cpu.envs.call("spec", {0: ()})[0]
            except BaseException:
                self._cpu.envs.close()
                raise
            self._action_dim = int(info["action_dim"])
            self.cameras = info["cameras"]
        super().__init__(config, int(spec.max_episode_steps or 100))

    @property
    def action_dim(self) -> int:
        return self._action_dim

    @property
    def workers(self) -> SubprocEnvs | None:
        """The subprocess pool of the CPU backend (``None`` on GPU)."""
        return None if self._cpu is None else self._cpu.envs

    def expert_actions(self) -> torch.Tensor:
        """The scripted expert's action for each env's current state, float32 ``[B, A]``.

        Experts (:mod:`rlinf_vla.envs.maniskill.experts`) read object, goal and TCP poses from
        the simulator and act in ``control_mode="pd_ee_delta_pose"``; the gripper entry follows
        ``gripper_convention``. Tasks without an expert, and other control modes, fail naming
        what is supported.
        """
        from rlinf_vla.envs.maniskill.experts import check_expert

        self._check_usable()
        check_expert(self.cfg.task, self.cfg.control_mode)
        if self._gpu is not None:
            return self._gpu.expert_actions().float().cpu()
        assert self._cpu is not None
        results = self._cpu.envs.call("expert_action", {i: () for i in range(self.num_envs)})
        crashed = [i for i, r in results.items() if r is CRASHED]
        if crashed:
            raise EnvWorkerError(
                f"maniskill env(s) {crashed} crashed computing the expert action; they were "
                f"restarted and lost their episode: call reset()"
            )
        return torch.from_numpy(np.stack([results[i] for i in range(self.num_envs)])).float()

    def _reset_envs(self, env_ids: torch.Tensor, reset_ids: torch.Tensor) -> Observation:
        if self._gpu is not None:
            return self._gpu.reset(env_ids, reset_ids)
        assert self._cpu is not None
        return self._cpu.reset(env_ids, reset_ids)

    def _step_envs(
        self, actions: torch.Tensor, active: torch.Tensor, need_obs: torch.Tensor
    ) -> StepOutput:
        if self._gpu is not None:
            return self._gpu.step(actions, active, need_obs)
        assert self._cpu is not None
        return self._cpu.step(actions, active, need_obs)

    def _offload(self) -> None:
        if self._gpu is not None:
            self._gpu.offload()

    def _onload(self) -> None:
        if self._gpu is not None:
            self._gpu.onload()

    def _close(self) -> None:
        if self._gpu is not None:
            self._gpu.close()
        if self._cpu is not None:
            self._cpu.envs.close()
