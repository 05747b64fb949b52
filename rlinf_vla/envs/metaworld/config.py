"""Config of the MetaWorld env: task sets, instructions and settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlinf_vla.envs.base import EnvConfig, EnvSpec, check_field

#: The MT10 tasks, in MetaWorld's order (``metaworld.env_dict.MT10_V3``).
MT10: tuple[str, ...] = (
    "reach-v3",
    "push-v3",
    "pick-place-v3",
    "door-open-v3",
    "drawer-open-v3",
    "drawer-close-v3",
    "button-press-topdown-v3",
    "peg-insert-side-v3",
    "window-open-v3",
    "window-close-v3",
)

#: One instruction per MetaWorld task: what the task's success condition asks for, in the
#: short imperative style of language-conditioned benchmarks. The keys, in MetaWorld's MT50
#: order (``metaworld.env_dict.MT50_V3``), are the 50 tasks.
INSTRUCTIONS: dict[str, str] = {
    "assembly-v3": "pick up the nut and fit it onto the peg",
    "basketball-v3": "pick up the basketball and drop it into the hoop",
    "bin-picking-v3": "pick the cube out of one bin and place it in the other bin",
    "box-close-v3": "pick up the lid and close the box with it",
    "button-press-topdown-v3": "press the button down from above",
    "button-press-topdown-wall-v3": "reach past the wall and press the button down from above",
    "button-press-v3": "push the button in from the front",
    "button-press-wall-v3": "reach past the wall and push the button in",
    "coffee-button-v3": "press the button on the coffee machine",
    "coffee-pull-v3": "pull the mug out from under the coffee machine",
    "coffee-push-v3": "push the mug under the coffee machine",
    "dial-turn-v3": "turn the dial",
    "disassemble-v3": "lift the nut off the peg",
    "door-close-v3": "close the door",
    "door-lock-v3": "turn the lock on the door to lock it",
    "door-open-v3": "open the door",
    "door-unlock-v3": "turn the lock on the door to unlock it",
    "hand-insert-v3": "put the gripper into the hole in the table",
    "drawer-close-v3": "push the drawer closed",
    "drawer-open-v3": "pull the drawer open",
    "faucet-open-v3": "turn the faucet handle to open the faucet",
    "faucet-close-v3": "turn the faucet handle to close the faucet",
    "hammer-v3": "pick up the hammer and hammer the nail in",
    "handle-press-side-v3": "press the handle down from the side",
    "handle-press-v3": "press the handle down",
    "handle-pull-side-v3": "pull the handle up from the side",
    "handle-pull-v3": "pull the handle up",
    "lever-pull-v3": "pull the lever up",
    "pick-place-wall-v3": "pick up the puck, carry it over the wall and place it at the goal",
    "pick-out-of-hole-v3": "pick the puck up out of the hole",
    "pick-place-v3": "pick up the puck and place it at the goal",
    "plate-slide-v3": "slide the plate into the cabinet",
    "plate-slide-side-v3": "slide the plate sideways into the cabinet",
    "plate-slide-back-v3": "slide the plate out of the cabinet back towards the robot",
    "plate-slide-back-side-v3": "slide the plate sideways out of the cabinet",
    "peg-insert-side-v3": "pick up the peg and insert it sideways into the hole",
    "peg-unplug-side-v3": "pull the peg sideways out of the hole",
    "soccer-v3": "push the soccer ball into the goal",
    "stick-push-v3": "pick up the stick and push the thermos to the goal with it",
    "stick-pull-v3": "pick up the stick and pull the thermos to the goal with it",
    "push-v3": "push the puck to the goal",
    "push-wall-v3": "push the puck around the wall to the goal",
    "push-back-v3": "pull the puck back to the goal",
    "reach-v3": "move the gripper to the goal",
    "reach-wall-v3": "move the gripper past the wall to the goal",
    "shelf-place-v3": "pick up the puck and place it on the shelf",
    "sweep-into-v3": "sweep the puck into the hole",
    "sweep-v3": "sweep the puck to the edge of the table",
    "window-open-v3": "slide the window open",
    "window-close-v3": "slide the window closed",
}

#: The MT50 tasks (all of MetaWorld's tasks), in MetaWorld's order.
MT50: tuple[str, ...] = tuple(INSTRUCTIONS)
#: ``task_set`` values.
TASK_SETS: tuple[str, ...] = ("MT1", "MT10", "MT50")
#: Goal / object configurations per task (MetaWorld's ``_N_GOALS``: each task of a benchmark
#: comes with 50); reset ids map onto (task, configuration) with it.
VARIATIONS_PER_TASK = 50
#: MetaWorld's ``max_path_length``: the time limit of every task.
DEFAULT_MAX_STEPS = 500
#: MetaWorld's cameras (``model.cam``), in the order of its scene file.
CAMERAS: tuple[str, ...] = (
    "topview",
    "corner",
    "corner2",
    "corner3",
    "corner4",
    "behindGripper",
    "gripperPOV",
)
STATE_MODES = ("proprio", "full")
REWARD_MODES = ("sparse", "dense", "normalized_dense")
#: The largest value of MetaWorld's shaped reward (v3 tasks: 10 at success).
MAX_REWARD = 10.0
#: ``reset_id_layout`` values: how reset ids enumerate (task, configuration) pairs.
RESET_ID_LAYOUTS = ("by_task", "interleaved")
RENDER_BACKENDS = ("egl", "osmesa")


@dataclass
class MetaWorldEnvConfig(EnvConfig):
    """Settings of :class:`rlinf_vla.envs.metaworld.env.MetaWorldEnv` (plus :class:`EnvConfig`).

    Attributes:
        task_set: ``"MT1"`` (the one task ``task``), ``"MT10"`` or ``"MT50"`` (MetaWorld's
            multi-task benchmarks: 10 or all 50 tasks, in MetaWorld's order).
        task: the task of ``MT1``, a MetaWorld task name such as ``"pick-place-v3"``
            (ignored by MT10 and MT50).
        image_size: side of the camera image.
        camera: which MetaWorld camera is ``images["main"]``: ``"corner2"`` (default, the view
            VLA work on MetaWorld uses), ``"corner"``, ``"corner3"``, ``"corner4"``,
            ``"topview"``, ``"behindGripper"`` or ``"gripperPOV"``.
        fast_render: turn shadows, reflections and multisampling off (about 9x faster CPU
            rendering; the picture loses its shadows and the table its sheen).
        state_mode: ``"proprio"``: ``state`` is the hand position (3) and the gripper opening
            (1, 0 closed .. 1 open), ``[B, 4]``; ``"full"``: MetaWorld's whole 39-D observation
            (hand and gripper, object positions and quaternions, the previous frame of those,
            the goal position): privileged object state.
        reward_mode: ``"sparse"``: 1 at success, else 0; ``"dense"``: MetaWorld's shaped reward
            (0 .. 10); ``"normalized_dense"``: the shaped reward over its maximum (0 .. 1, as
            ManiSkill's mode of that name).
        scene_seed: the 50 goal / object configurations of a task are those of
            ``metaworld.MT1(task, seed=scene_seed).train_tasks``, whatever the task set.
        reset_id_layout: how reset id ``r`` picks (task, configuration) among ``n`` tasks:
            ``"by_task"`` (default): task ``(r // 50) % n``, configuration ``r % 50`` (a
            task's configurations one after another); ``"interleaved"``: task ``r % n``,
            configuration ``(r // n) % 50``, so that any ``k n`` consecutive ids (the
            evaluation blocks of ``train`` and ``sft``) hold ``k`` scenes of every task.
        task_per_env: every episode the env's own cursor starts (training's episodes, a
            ``reset()`` without ids) in env ``i`` of the batch plays task
            ``((env_offset + i) // group_size) % n`` in the configuration its reset id draws
            (:meth:`pin_task`): the envs of a GRPO group share their task, no env rebuilds its
            simulator for another task between episodes (about 1 s each), and with a multiple
            of ``n`` groups every task gets the same share of the episodes. Off (default):
            each episode's reset id draws its task too, as any id does. Explicit reset ids
            (evaluation blocks, ``reset(reset_ids)``) are played as given either way.
        render_backend: MuJoCo offscreen backend, ``"egl"`` or ``"osmesa"``.
        envs_per_process: envs simulated by each worker subprocess, one after another
            (subprocesses run in parallel); more than one saves the memory of the simulator's
            libraries per env.
        worker_timeout_s: seconds a worker may take for one command (a task switch builds its
            simulator) before it is considered hung and restarted.
    """

    num_envs: int = 2
    task_set: str = "MT1"
    task: str = "pick-place-v3"
    image_size: int = 224
    camera: str = "corner2"
    fast_render: bool = False
    state_mode: str = "proprio"
    reward_mode: str = "sparse"
    scene_seed: int = 0
    reset_id_layout: str = "by_task"
    task_per_env: bool = False
    render_backend: str = "egl"
    worker_timeout_s: float = 600.0
    envs_per_process: int = 1

    @property
    def action_dim(self) -> int:
        """4-D: hand xyz delta and the gripper."""
        return 4

    def robot_type(self, env_name: str) -> str:
        """``sawyer``, the arm of every MetaWorld task."""
        return "sawyer"

    @property
    def state_dim(self) -> int:
        return 4 if self.state_mode == "proprio" else 39

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks of the task set, in order (reset ids index them)."""
        if self.task_set == "MT1":
            return (self.task,)
        return MT10 if self.task_set == "MT10" else MT50

    def task_variation(self, reset_id: int) -> tuple[int, int]:
        """(task position in :attr:`tasks`, configuration) of ``reset_id``
        (``reset_id_layout``)."""
        n = len(self.tasks)
        if self.reset_id_layout == "interleaved":
            return reset_id % n, (reset_id // n) % VARIATIONS_PER_TASK
        return (reset_id // VARIATIONS_PER_TASK) % n, reset_id % VARIATIONS_PER_TASK

    def reset_id(self, task_pos: int, variation: int) -> int:
        """The smallest reset id of task position ``task_pos`` and configuration
        ``variation`` (the inverse of :meth:`task_variation`)."""
        if self.reset_id_layout == "interleaved":
            return len(self.tasks) * variation + task_pos
        return VARIATIONS_PER_TASK * task_pos + variation

    def pin_task(self, env_ids: torch.Tensor, reset_ids: torch.Tensor) -> torch.Tensor:
        """``task_per_env``: the reset ids of the configurations ``reset_ids`` draw, in the
        task of each env of ``env_ids`` (``((env_offset + i) // group_size) % n``); the ids
        unchanged when it is off."""
        if not self.task_per_env:
            return reset_ids
        tasks = ((self.env_offset + env_ids) // self.group_size) % len(self.tasks)
        pinned = [
            self.reset_id(int(t), self.task_variation(int(r))[1])
            for t, r in zip(tasks.tolist(), reset_ids.tolist(), strict=True)
        ]
        return torch.tensor(pinned, dtype=torch.long)

    def episode_steps(self) -> int:
        """``max_episode_steps``, else MetaWorld's ``max_path_length`` (500) for every task."""
        return self.max_episode_steps or DEFAULT_MAX_STEPS

    def describe(self) -> str:
        """``MT1 pick-place-v3``, ``MT10`` or ``MT50``."""
        return f"MT1 {self.task}" if self.task_set == "MT1" else self.task_set

    def spec(self) -> EnvSpec:
        """4-D actions; state: hand xyz and gripper opening (or the 39-D observation)."""
        return EnvSpec(self.cameras, 4, self.state_dim)

    def eval_configs(
        self, env_name: str, tasks: list[str] | None, trials_per_task: int
    ) -> list[tuple[str | None, EnvConfig]]:
        """The env itself (``task_set`` and ``task`` select the tasks); each task has
        :data:`VARIATIONS_PER_TASK` configurations, each used once."""
        if trials_per_task > VARIATIONS_PER_TASK:
            raise ValueError(
                f"eval.trials_per_task={trials_per_task}: a MetaWorld task has "
                f"{VARIATIONS_PER_TASK} configurations (at most {VARIATIONS_PER_TASK} trials)"
            )
        if tasks is not None:
            raise ValueError(
                "eval.tasks: MetaWorld tasks are chosen with env.task_set and env.task; leave "
                "it null"
            )
        return [(None, self)]

    @property
    def eval_uses_seed(self) -> bool:
        """The tasks' configurations are the scenes of the trials, whatever ``eval.seed``."""
        return False

    def eval_trials(
        self, env_name: str, tasks: list[str] | None, trials_per_task: int, seed: int
    ) -> list[dict[str, Any]]:
        """Every task of the task set x its configurations ``0 .. trials_per_task - 1`` (at
        most :data:`VARIATIONS_PER_TASK`, see :meth:`eval_configs`; the seed plays no part:
        ``scene_seed`` fixes the configurations). The reset id of task position ``p`` and
        configuration ``s`` is ``50 p + s`` (``n s + p`` with the interleaved layout)."""
        return [
            {
                "suite": self.task_set,
                "task": name,
                "task_index": pos,
                "init_state": s,
                "reset_id": self.reset_id(pos, s),
            }
            for pos, name in enumerate(self.tasks)
            for s in range(trials_per_task)
        ]

    def __post_init__(self) -> None:
        super().__post_init__()
        check_field(self, "task_set", self.task_set in TASK_SETS, f"must be one of {TASK_SETS}")
        check_field(
            self, "task", self.task in INSTRUCTIONS, f"is not a MetaWorld task; known: {MT50}"
        )
        check_field(self, "image_size", 16 <= self.image_size <= 1024, "must lie in [16, 1024]")
        check_field(self, "camera", self.camera in CAMERAS, f"must be one of {CAMERAS}")
        check_field(
            self, "state_mode", self.state_mode in STATE_MODES, f"must be one of {STATE_MODES}"
        )
        check_field(
            self, "reward_mode", self.reward_mode in REWARD_MODES, f"must be one of {REWARD_MODES}"
        )
        self.scene_seed = int(self.scene_seed)
        check_field(
            self,
            "reset_id_layout",
            self.reset_id_layout in RESET_ID_LAYOUTS,
            f"must be one of {RESET_ID_LAYOUTS}",
        )
        check_field(self, "scene_seed", 0 <= self.scene_seed < 2**32, "must lie in [0, 2**32)")
        check_field(
            self,
            "render_backend",
            self.render_backend in RENDER_BACKENDS,
            f"must be one of {RENDER_BACKENDS}",
        )
        check_field(self, "worker_timeout_s", self.worker_timeout_s > 0, "must be > 0")
        check_field(self, "envs_per_process", self.envs_per_process >= 1, "must be >= 1")
