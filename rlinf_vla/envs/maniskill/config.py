"""Config of the ManiSkill3 env, and the instruction of each task."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from rlinf_vla.envs.base import EnvConfig, EnvSpec, check_field

#: Natural-language instruction per ManiSkill task (colours as the task renders them).
INSTRUCTIONS: dict[str, str] = {
    "PickCube-v1": "pick up the red cube and move it to the green target",
    "PickCubeSO100-v1": "pick up the red cube and move it to the green target",
    "PickCubeWidowXAI-v1": "pick up the red cube and move it to the green target",
    "PushCube-v1": "push the blue cube onto the red and white target",
    "PullCube-v1": "pull the blue cube back onto the red and white target",
    "StackCube-v1": "stack the red cube on top of the green cube",
    "StackPyramid-v1": "stack the red, green and blue cubes into a pyramid",
    "PokeCube-v1": "use the peg to push the red cube onto the target",
    "PlaceSphere-v1": "place the blue sphere into the bin",
    "RollBall-v1": "roll the blue ball onto the target region",
    "LiftPegUpright-v1": "lift the peg and stand it upright",
    "PegInsertionSide-v1": "insert the peg into the hole in the box from the side",
    "PlugCharger-v1": "plug the charger into the wall receptacle",
    "PushT-v1": "push the T-shaped block onto the target outline",
    "PullCubeTool-v1": "use the L-shaped tool to pull the blue cube closer",
    "TwoRobotPickCube-v1": "pick up the cube and move it to the green target",
    "TwoRobotStackCube-v1": "stack the blue cube on top of the green cube",
    "PickSingleYCB-v1": "pick up the object and move it to the green target",
    "OpenCabinetDrawer-v1": "open the drawer of the cabinet",
    "OpenCabinetDoor-v1": "open the door of the cabinet",
    "TurnFaucet-v1": "turn the faucet handle",
}

REWARD_MODES = ("sparse", "dense", "normalized_dense")
SIM_BACKENDS = ("auto", "cpu", "gpu")
GRIPPER_CONVENTIONS = ("close_positive", "native")
STATE_MODES = ("proprio", "privileged")


def registered_tasks() -> frozenset[str] | None:
    """The task ids ManiSkill registers (importing its task modules registers them; no env is
    built), or ``None`` when ManiSkill is not installed."""
    try:
        from rlinf_vla.envs.maniskill.env import import_maniskill

        import_maniskill()
    except ImportError:
        return None
    from mani_skill.utils.registration import REGISTERED_ENVS

    return frozenset(REGISTERED_ENVS)


def default_instruction(task: str) -> str:
    """The instruction of ``task``: from :data:`INSTRUCTIONS`, else derived from its name."""
    if task in INSTRUCTIONS:
        return INSTRUCTIONS[task]
    name = task.rsplit("-v", 1)[0]
    words = "".join(f" {c.lower()}" if c.isupper() else c for c in name).split()
    return "complete the task: " + " ".join(words)


# Panda: 7 arm joints + 1 gripper; end-effector poses are 6-D (xyz + axis-angle), positions 3-D.
_PANDA_ACTION_DIMS = {
    "pd_ee_delta_pose": 7,
    "pd_ee_target_delta_pose": 7,
    "pd_ee_pose": 7,
    "pd_ee_delta_pos": 4,
    "pd_ee_target_delta_pos": 4,
    "pd_joint_delta_pos": 8,
    "pd_joint_target_delta_pos": 8,
    "pd_joint_pos": 8,
    "pd_joint_vel": 8,
}


#: Action size of ManiSkill's controllers for the Panda robots (arm + gripper).
PANDA_ACTION_DIMS: dict[str, int] = {
    "pd_ee_delta_pose": 7,
    "pd_ee_delta_pos": 4,
    "pd_ee_pose": 7,
    "pd_joint_delta_pos": 8,
    "pd_joint_pos": 8,
    "pd_joint_vel": 8,
}


@dataclass
class ManiSkillEnvConfig(EnvConfig):
    """Settings of :class:`rlinf_vla.envs.maniskill.env.ManiSkillEnv` (plus :class:`EnvConfig`).

    Attributes:
        task: ManiSkill env id, e.g. ``"PickCube-v1"``.
        image_size: side of every camera image (default 128, the size of ManiSkill's own sensor
            cameras; a policy resizes to its input, 224 for the OpenVLA family).
        main_camera: sensor uid used as ``images["main"]``; ``None`` = the task's first camera.
        wrist: add the robot's own camera (``images["wrist"]``) when it has one (use
            ``robot="panda_wristcam"`` for a Panda with a hand camera).
        robot: ManiSkill robot uid; ``None`` = the task's default robot.
        control_mode: ManiSkill controller; the default ``"pd_ee_delta_pose"`` takes the 7-D
            end-effector delta used by VLAs: xyz (x0.1 m), rotation (XYZ Euler angles of
            ``-0.1 * a`` rad: ManiSkill scales by its lower bound), gripper.
        gripper_convention: ``"close_positive"`` -> the last action entry is +1 close, -1 open
            (as in LIBERO; ManiSkill's own sign is flipped for you); ``"native"`` -> as given.
        reward_mode: ``"sparse"`` (1 on success), ``"dense"`` or ``"normalized_dense"``.
        sim_backend: ``"gpu"`` runs all envs in one GPU-simulated process, ``"cpu"`` runs one
            CPU-simulated env per subprocess, ``"auto"`` picks GPU when CUDA is available (in
            a worker: when the worker is on a GPU, see :func:`rlinf_vla.envs.for_device`).
        device: torch device of the observations (GPU backend only; CPU is always ``"cpu"``).
        instruction: override the task's instruction.
        show_goal: show the goal markers ManiSkill hides from cameras (PickCube's green goal
            sphere), since a VLA only sees the images and the instruction names the goal.
        shader: ManiSkill shader pack of the cameras (``"minimal"`` is the fastest).
        fast_render: draw decimated copies of the dense visual meshes (the Panda's links: about
            2,000 triangles each instead of up to 21,000) when rendering on the CPU, about 2x faster
            per image and within 1/255 of the full picture on average
            (:mod:`rlinf_vla.envs.maniskill.meshes`; on by default, off in ``rlinf-vla eval``).
            GPU rendering is fast and always draws the full meshes.
        envs_per_process: CPU backend: envs simulated by each subprocess, one after another;
            subprocesses run in parallel. A ManiSkill subprocess holds about 0.7 GB before its
            first env and a few MB for each further one, and starts in several seconds.
            ``None``: ``ceil(num_envs / cores)`` (the cores this process may use), which keeps
            every core busy with the fewest subprocesses (10 envs on 2 cores: 2 subprocesses
            of 5, 2.4 GB and 14 s to start instead of 11.9 GB and 57 s with one each, and
            stepping as fast). With pipeline stages (``placement.stages``) it is resolved for
            the whole batch before the split, since the stages simulate at the same time: 4
            envs in 2 stages on 2 cores get one subprocess of 2 envs per stage. Each env's
            episodes do not depend on it.
        worker_timeout_s: seconds a CPU worker may take for one command before it is
            considered hung and restarted.
        state_mode: ``"proprio"``: ``state`` is the robot's joint positions and TCP pose;
            ``"privileged"``: followed by the task's own state observation (ManiSkill's
            ``extra`` of ``obs_mode="state"``: object and goal poses, e.g. 24 more values for
            PickCube), for policies that learn without reading the scene from the images.
    """

    num_envs: int = 2
    task: str = "PickCube-v1"
    image_size: int = 128
    main_camera: str | None = None
    wrist: bool = True
    robot: str | None = None
    control_mode: str = "pd_ee_delta_pose"
    gripper_convention: str = "close_positive"
    reward_mode: str = "sparse"
    sim_backend: str = "auto"
    device: str = "cpu"
    instruction: str | None = None
    show_goal: bool = True
    shader: str = "minimal"
    fast_render: bool = True
    worker_timeout_s: float = 600.0
    envs_per_process: int | None = None
    state_mode: str = "proprio"

    @property
    def action_dim(self) -> int | None:
        """The action size, known before the env starts for a Panda (the default robot of the
        tabletop tasks) in its standard control modes; ``None`` when only the simulator knows."""
        if self.robot is not None and not self.robot.startswith("panda"):
            return None
        return _PANDA_ACTION_DIMS.get(self.control_mode)

    def envs_per_subprocess(self) -> int:
        """Envs per subprocess of the CPU backend (``envs_per_process``, resolved)."""
        if self.envs_per_process is not None:
            return self.envs_per_process
        return math.ceil(self.num_envs / usable_cpus())

    def for_whole_batch(self) -> ManiSkillEnvConfig:
        """The subprocess packing of the whole batch: pipeline stages, and the env workers of
        one node, simulate at the same time (and beside inference), so their subprocesses
        together, not each part's, fill the cores (4 envs in 2 stages, or 2 env workers, on 2
        cores: one subprocess of 2 envs per part, as the whole batch's 2 subprocesses, not 2
        of 1 env per part)."""
        if self.envs_per_process is not None or self.sim_backend == "gpu":
            return self
        return dataclasses.replace(self, envs_per_process=self.envs_per_subprocess())

    def describe(self) -> str:
        return self.task

    def expert_problem(self, env_name: str) -> str | None:
        """The scripted experts cover some tasks, in ``pd_ee_delta_pose`` only."""
        from rlinf_vla.envs.maniskill.experts import check_expert

        try:
            check_expert(self.task, self.control_mode)
        except ValueError as e:
            return str(e)
        return super().expert_problem(env_name)

    def camera_hint(self) -> str:
        """A Panda with a hand camera adds ``wrist``."""
        return "ManiSkill: env.wrist=true env.robot=panda_wristcam adds a hand camera"

    def robot_type(self, env_name: str) -> str:
        """``robot`` without its camera suffix (``panda_wristcam`` -> ``panda``); ``panda``,
        the robot of the tabletop tasks, when it is not set."""
        return str(self.robot).removesuffix("_wristcam") if self.robot else "panda"

    def episode_steps(self) -> int | None:
        """``max_episode_steps``, else the task's registered time limit (as the env uses it;
        ``None`` without ManiSkill installed)."""
        if self.max_episode_steps is not None:
            return self.max_episode_steps
        try:
            from rlinf_vla.envs.maniskill.env import import_maniskill

            import_maniskill()
        except ImportError:
            return None
        from mani_skill.utils.registration import REGISTERED_ENVS

        spec = REGISTERED_ENVS.get(self.task)
        return None if spec is None else int(spec.max_episode_steps or 100)

    def spec(self) -> EnvSpec:
        """A Panda (the default robots): its controller's action size; state (``proprio``): 9
        joint positions and the TCP pose (xyz + quaternion). Other robots, and the task's own
        state that ``privileged`` appends (its size differs per task): known to the simulator
        only."""
        panda = self.robot is None or str(self.robot).startswith("panda")
        action_dim = PANDA_ACTION_DIMS.get(self.control_mode) if panda else None
        state_dim = 16 if panda and self.state_mode == "proprio" else None
        return EnvSpec(self.cameras, action_dim, state_dim)

    def eval_trials(
        self, env_name: str, tasks: list[str] | None, trials_per_task: int, seed: int
    ) -> list[dict[str, Any]]:
        """``tasks`` (default: ``task``) x seeds ``seed .. seed + trials_per_task - 1``, the
        seed being the reset id; each task runs in its own env (``env_key``)."""
        return [
            {
                "suite": env_name,
                "task": task,
                "task_index": j,
                "init_state": seed + s,
                "reset_id": seed + s,
                "env_key": (("task", task),),
            }
            for j, task in enumerate(tasks or [self.task])
            for s in range(trials_per_task)
        ]

    def eval_configs(
        self, env_name: str, tasks: list[str] | None, trials_per_task: int
    ) -> list[tuple[str | None, EnvConfig]]:
        """One config per task of ``tasks`` (default: ``task``), each with the task's own
        default robot (some carry a hand camera); every task must be registered and have its
        assets on disk (nothing is downloaded). Imports ManiSkill."""
        from rlinf_vla.envs.maniskill.env import MissingAssetError, check_task

        configs: list[tuple[str | None, EnvConfig]] = []
        for task in tasks or [self.task]:
            try:
                task_cfg = dataclasses.replace(self, task=task)
                task_cfg.spec()
            except ValueError as e:  # an unknown task or robot
                raise ValueError(f"eval.tasks / env.task: {e}") from None
            configs.append((task, task_cfg))
        for task, _ in configs:
            try:
                check_task(task)
            except (ValueError, MissingAssetError) as e:
                raise ValueError(f"eval.tasks / env.task: {e}") from None
        return configs

    @property
    def cameras(self) -> tuple[str, ...]:
        """``main``, plus ``wrist`` when asked for (``wrist``) and the robot carries a camera:
        ``robot``, or with ``robot=None`` the task's default robot as ManiSkill registers it
        (StackCube, PegInsertionSide and PlugCharger use ``panda_wristcam``). Imports ManiSkill
        when ``wrist`` is set."""
        if not self.wrist:
            return ("main",)
        from rlinf_vla.envs.maniskill.env import robot_has_camera

        return ("main", "wrist") if robot_has_camera(self.task, self.robot) else ("main",)

    def __post_init__(self) -> None:
        super().__post_init__()
        # The tasks listed here exist; another name is looked up in ManiSkill's registry.
        known = None if self.task in INSTRUCTIONS else registered_tasks()
        check_field(
            self,
            "task",
            known is None or self.task in known,
            f"is not a ManiSkill task; known tasks: {', '.join(sorted(known or ()))}",
        )
        check_field(self, "image_size", 16 <= self.image_size <= 1024, "must lie in [16, 1024]")
        check_field(
            self, "reward_mode", self.reward_mode in REWARD_MODES, f"must be one of {REWARD_MODES}"
        )
        check_field(
            self, "sim_backend", self.sim_backend in SIM_BACKENDS, f"must be one of {SIM_BACKENDS}"
        )
        check_field(
            self,
            "gripper_convention",
            self.gripper_convention in GRIPPER_CONVENTIONS,
            f"must be one of {GRIPPER_CONVENTIONS}",
        )
        check_field(self, "worker_timeout_s", self.worker_timeout_s > 0, "must be > 0")
        check_field(
            self,
            "envs_per_process",
            self.envs_per_process is None or self.envs_per_process >= 1,
            "must be >= 1 or null (as many as keep every core busy)",
        )
        check_field(
            self, "state_mode", self.state_mode in STATE_MODES, f"must be one of {STATE_MODES}"
        )


def usable_cpus() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return os.cpu_count() or 1
