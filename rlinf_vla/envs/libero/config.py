"""Config of the LIBERO env."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlinf_vla.config import EXPECTS
from rlinf_vla.envs.base import EnvConfig, EnvSpec, check_field
from rlinf_vla.envs.libero.perturb import KINDS as PERTURBATION_KINDS
from rlinf_vla.envs.libero.perturb import SUITES as PERTURBED_SUITES

#: The five LIBERO suites, in the order ``libero_130`` concatenates them.
SUITES: tuple[str, ...] = (
    "libero_spatial",
    "libero_object",
    "libero_goal",
    "libero_10",
    "libero_90",
)
#: ``suite`` values: the five suites and ``libero_130`` (all 130 tasks).
SUITE_CHOICES: tuple[str, ...] = (*SUITES, "libero_130")
#: Tasks per suite (``task_ids`` index them), as the LIBERO benchmark defines them.
SUITE_SIZES: dict[str, int] = {
    "libero_spatial": 10,
    "libero_object": 10,
    "libero_goal": 10,
    "libero_10": 10,
    "libero_90": 90,
    "libero_130": 130,
}
_MAX_STEPS_EXPECTS = (
    "a mapping suite -> steps, e.g. env.max_steps={libero_goal:60}; "
    "env.max_episode_steps=60 sets one limit for every task"
)
#: Default time limits per suite (control steps after the settle steps), as in OpenVLA's eval.
DEFAULT_MAX_STEPS: dict[str, int] = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}
#: Official init states per task; reset ids map onto (task, init state) with it.
INIT_STATES_PER_TASK = 50
RENDER_BACKENDS = ("egl", "osmesa")
#: The cameras a LIBERO scene can render, as ``images`` keys (robosuite's names:
#: :data:`rlinf_vla.envs.libero.env.ROBOSUITE_CAMERAS`).
CAMERAS = ("main", "wrist")
#: ``perturbation`` values: LIBERO-PRO's kinds (:data:`rlinf_vla.envs.libero.perturb.KINDS`).
PERTURBATIONS: tuple[str, ...] = tuple(PERTURBATION_KINDS)


@dataclass
class LiberoEnvConfig(EnvConfig):
    """Settings of :class:`rlinf_vla.envs.libero.env.LiberoEnv` (plus :class:`EnvConfig`).

    Attributes:
        suite: ``libero_spatial``, ``libero_object``, ``libero_goal``, ``libero_10``,
            ``libero_90`` or ``libero_130`` (all five, concatenated in that order).
        task_ids: indices of the tasks to use within the suite; ``None`` = all of them.
        cameras: the cameras rendered, as ``images`` keys: ``main`` (agentview) and ``wrist``
            (eye-in-hand), both by default as in LIBERO. ``train`` and ``eval`` keep only the
            ones the policy reads and the video's (:meth:`keep_cameras`): a camera nobody reads
            is not rendered (each costs a render per env and step) nor sent to the policy.
        image_size: side of the agentview and wrist images; default 256, the renders of the
            official OpenVLA / OpenVLA-OFT / openpi evaluations (the policy resizes to its input).
            128 with ``fast_render`` for quick CPU runs.
        settle_steps: zero actions (gripper open) stepped after setting an init state so objects
            settle; not counted in the episode.
        max_steps: time limit per suite, merged over :data:`DEFAULT_MAX_STEPS`; the shared
            ``max_episode_steps``, when set, overrides it for every task.
        fast_render: turn reflections, shadows, skybox and multisampling off (about 4x faster
            CPU rendering; the table loses its mirror image, so images differ slightly from the
            official LIBERO renders).
        render_backend: MuJoCo offscreen backend, ``"egl"`` or ``"osmesa"``.
        scene_seed: how the scene of a reset is seeded. LIBERO re-places its fixtures
            (cabinets, stoves: model body poses that an init state does not hold) with numpy's
            global RNG on every reset. With an int ``s``, the reset to init state ``k`` of a task
            draws what the official evaluation loops draw for episode ``k``: numpy seeded with
            ``s`` when the task's simulator is built (``env.seed(s)``), then ``k`` resets before
            this one. The scene is then a function of (task, init state) only, whatever
            ``task_ids`` selects. The official loops use 0 (OpenVLA, OpenVLA-OFT) and 7
            (openpi). ``None``: seed every reset with its reset id (the scene of a (task, init
            state) then changes with the position of the task in ``task_ids``).
        envs_per_process: envs simulated by each worker subprocess, one after another
            (subprocesses run in parallel); more than one saves the memory of the simulator's
            libraries per env.
        worker_timeout_s: seconds a worker may take for one command (a task switch rebuilds
            its simulator) before it is considered hung and restarted.
        perturbation: ``None`` (the tasks as LIBERO defines them) or a LIBERO-PRO
            out-of-distribution kind (:data:`PERTURBATIONS`: ``ood_object``,
            ``ood_spatial_relation``, ``ood_language``, ``ood_task``, ``ood_environment``;
            libero_spatial, libero_object, libero_goal and libero_10 only). Every task is
            replaced by its variant under ``perturbation_seed``; kinds that change the objects
            or their layout start from scenes LIBERO's samplers place from the perturbed task
            (seeded per init state) instead of the official init states. See
            :mod:`rlinf_vla.envs.libero.perturb`; ``rlinf-vla eval`` sets it per trial from
            ``eval.perturbation``.
        perturbation_seed: the seed the variant of every task (and its scenes) is drawn with.
    """

    num_envs: int = 2
    suite: str = "libero_spatial"
    task_ids: tuple[int, ...] | None = None
    cameras: tuple[str, ...] = CAMERAS
    image_size: int = 256
    settle_steps: int = 10
    max_steps: dict[str, int] = field(default_factory=dict, metadata={EXPECTS: _MAX_STEPS_EXPECTS})
    fast_render: bool = False
    render_backend: str = "egl"
    worker_timeout_s: float = 600.0
    envs_per_process: int = 1
    scene_seed: int | None = 0
    perturbation: str | None = None
    perturbation_seed: int = 0

    @property
    def action_dim(self) -> int:
        """7-D: end-effector delta position and rotation, and the gripper."""
        return 7

    def keep_cameras(self, cameras: Collection[str]) -> LiberoEnvConfig:
        """This config rendering only those of its cameras in ``cameras`` (itself when that
        leaves none: the fit check names the missing ones)."""
        kept = tuple(c for c in self.cameras if c in cameras)
        return dataclasses.replace(self, cameras=kept) if kept else self

    def robot_type(self, env_name: str) -> str:
        """``panda``, the arm of every LIBERO task."""
        return "panda"

    def describe(self) -> str:
        """``libero_goal``, or ``libero_goal tasks [2, 5]``."""
        tasks = f" tasks {list(self.task_ids)}" if self.task_ids is not None else ""
        return f"{self.suite}{tasks}"

    def episode_steps(self) -> int:
        """``max_episode_steps``, else the longest limit (``max_steps``) of the suites whose
        tasks are selected."""
        if self.max_episode_steps is not None:
            return self.max_episode_steps
        if self.suite != "libero_130":
            return self.max_steps[self.suite]
        starts, first = {}, 0
        for suite in SUITES:  # libero_130 concatenates the suites in this order
            starts[suite] = first
            first += SUITE_SIZES[suite]
        ids = range(SUITE_SIZES["libero_130"]) if self.task_ids is None else self.task_ids
        covered = {s for s in SUITES for i in ids if 0 <= i - starts[s] < SUITE_SIZES[s]}
        return max(self.max_steps[s] for s in covered)

    def spec(self) -> EnvSpec:
        """7-D end-effector delta actions; state: eef position, axis-angle, 2 gripper joints."""
        return EnvSpec(self.cameras, 7, 8)

    def eval_configs(
        self, env_name: str, tasks: list[str] | None, trials_per_task: int
    ) -> list[tuple[str | None, EnvConfig]]:
        """The env itself (``suite`` and ``task_ids`` select the tasks); each task has
        :data:`INIT_STATES_PER_TASK` official init states, each used once."""
        if trials_per_task > INIT_STATES_PER_TASK:
            raise ValueError(
                f"eval.trials_per_task={trials_per_task}: a LIBERO task has "
                f"{INIT_STATES_PER_TASK} official init states and each is used once (use at "
                f"most {INIT_STATES_PER_TASK})"
            )
        if tasks is not None:
            raise ValueError(
                "eval.tasks: LIBERO tasks are chosen with env.suite and env.task_ids; leave it null"
            )
        return [(None, self)]

    @property
    def eval_uses_seed(self) -> bool:
        """The official init states are the scenes of the trials, whatever ``eval.seed``."""
        return False

    @classmethod
    def eval_protocols(cls) -> tuple[str, ...]:
        """``official`` (the default: the official LIBERO evaluation loops' episodes, the env
        settings checked; :mod:`rlinf_vla.envs.libero.evaluation`) and ``package``."""
        return ("official", "package")

    def check_protocol(self, protocol: str) -> None:
        """Under ``official``, every setting the official loops fix: image size, rendering,
        settle steps, time limits and scene seed
        (:func:`rlinf_vla.envs.libero.evaluation.check_protocol`)."""
        from rlinf_vla.envs.libero.evaluation import check_protocol

        check_protocol(self, protocol)

    def protocol_record(self, protocol: str) -> dict[str, Any]:
        """The name, the scene seed and the official loop it reproduces, and the settings that
        decide a trial's scene and length
        (:func:`rlinf_vla.envs.libero.evaluation.protocol_record`)."""
        from rlinf_vla.envs.libero.evaluation import protocol_record

        return protocol_record(self, protocol)

    @classmethod
    def eval_perturbations(cls) -> tuple[str, ...]:
        """LIBERO-PRO's kinds (:data:`PERTURBATIONS`)."""
        return PERTURBATIONS

    def plan_perturbations(
        self, env_name: str, kinds: list[str], seed: int, trials: list[dict[str, Any]]
    ) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
        """Each kind on the tasks LIBERO-PRO has a variant of, the others skipped with the
        reason (:func:`rlinf_vla.envs.libero.evaluation.plan_perturbations`)."""
        from rlinf_vla.envs.libero.evaluation import plan_perturbations

        return plan_perturbations(self, kinds, seed, trials)

    def eval_trials(
        self, env_name: str, tasks: list[str] | None, trials_per_task: int, seed: int
    ) -> list[dict[str, Any]]:
        """The selected tasks of ``suite`` x init states ``0 .. trials_per_task - 1`` (the seed
        plays no part: the official init states are the scenes). The reset id of task position
        ``p`` and init state ``s`` is ``50 p + s``, which the env maps back to exactly that (task,
        init state); with ``scene_seed`` set (the default) the scene depends on the task and the
        init state only, not on ``p``."""
        from rlinf_vla.envs.libero.env import suite_tasks

        every = suite_tasks(self.suite)
        ids = self.task_ids if self.task_ids is not None else range(len(every))
        return [
            {
                "suite": t.suite,
                "task": t.name,
                "task_index": t.index,
                "init_state": s,
                "reset_id": INIT_STATES_PER_TASK * pos + s,
            }
            for pos, i in enumerate(ids)
            for t in [every[i]]
            for s in range(trials_per_task)
        ]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.suite not in SUITE_CHOICES:
            raise ValueError(
                f"{type(self).__name__}.suite={self.suite!r} is not a LIBERO suite; known "
                f"suites: {', '.join(SUITE_CHOICES)}"
            )
        if self.task_ids is not None:
            self.task_ids = tuple(int(i) for i in self.task_ids)
            check_field(self, "task_ids", len(self.task_ids) > 0, "must not be empty")
            size = SUITE_SIZES.get(self.suite, 0)
            bad = [i for i in self.task_ids if not 0 <= i < size]
            check_field(
                self,
                "task_ids",
                not bad,
                f"{bad} out of range for suite {self.suite!r} with {size} tasks "
                f"(valid: 0..{size - 1})",
            )
        self.cameras = tuple(self.cameras)
        unknown_cameras = [c for c in self.cameras if c not in CAMERAS]
        check_field(
            self,
            "cameras",
            bool(self.cameras)
            and not unknown_cameras
            and len(set(self.cameras)) == len(self.cameras),
            f"must list some of {list(CAMERAS)}, each once",
        )
        check_field(self, "image_size", 16 <= self.image_size <= 1024, "must lie in [16, 1024]")
        check_field(self, "settle_steps", self.settle_steps >= 0, "must be >= 0")
        check_field(
            self, "max_steps", isinstance(self.max_steps, Mapping), f"must be {_MAX_STEPS_EXPECTS}"
        )
        unknown = sorted(set(self.max_steps) - set(SUITES))
        check_field(
            self, "max_steps", not unknown, f"has unknown suites {unknown}; known: {SUITES}"
        )
        check_field(
            self,
            "max_steps",
            all(int(v) >= 1 for v in self.max_steps.values()),
            "values must be >= 1",
        )
        self.max_steps = {**DEFAULT_MAX_STEPS, **{k: int(v) for k, v in self.max_steps.items()}}
        check_field(
            self,
            "render_backend",
            self.render_backend in RENDER_BACKENDS,
            f"must be one of {RENDER_BACKENDS}",
        )
        check_field(self, "worker_timeout_s", self.worker_timeout_s > 0, "must be > 0")
        check_field(self, "envs_per_process", self.envs_per_process >= 1, "must be >= 1")
        if self.scene_seed is not None:
            self.scene_seed = int(self.scene_seed)
            check_field(
                self,
                "scene_seed",
                0 <= self.scene_seed < 2**32,
                "must lie in [0, 2**32) or be null (seed each reset with its reset id)",
            )
        self._check_perturbation()

    def _check_perturbation(self) -> None:
        check_field(
            self,
            "perturbation",
            self.perturbation is None or self.perturbation in PERTURBATIONS,
            f"is not a known perturbation; known: {', '.join(PERTURBATIONS)} (or null)",
        )
        check_field(self, "perturbation_seed", self.perturbation_seed >= 0, "must be >= 0")
        if self.perturbation is not None:
            check_field(
                self,
                "suite",
                self.suite in (*PERTURBED_SUITES, "libero_130"),
                f"has no {self.perturbation} variants; LIBERO-PRO covers "
                f"{', '.join(PERTURBED_SUITES)} (and their tasks in libero_130)",
            )
