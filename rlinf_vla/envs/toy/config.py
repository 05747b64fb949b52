"""Config of the toy "move to the coloured shape" env."""

from __future__ import annotations

from dataclasses import dataclass

from rlinf_vla.envs.base import EnvConfig, EnvSpec, check_field

#: Colour names and RGB values the toy env paints objects with.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 90, 230),
    "yellow": (230, 210, 40),
    "purple": (150, 60, 200),
    "orange": (240, 140, 30),
}
#: Shape names, in the order of the shape codes.
SHAPES: tuple[str, ...] = ("square", "circle", "triangle")
#: The arena is split into GRID x GRID cells; each object and the agent start in their own cell.
GRID = 3
#: Time limit without ``max_episode_steps``: the oracle needs at most 12 steps to any target.
DEFAULT_MAX_EPISODE_STEPS = 16


@dataclass
class ToyEnvConfig(EnvConfig):
    """Settings of :class:`rlinf_vla.envs.toy.env.ToyEnv` (plus the shared :class:`EnvConfig`).

    Attributes:
        image_size: side of the square ``main`` camera image in pixels.
        num_objects: coloured shapes in each scene (one is the target), 1..6. With 1 there is
            no distractor: the task is visual reaching only (the instruction still names the
            shape).
        action_dim: size of an action; only the first two entries (x, y velocity in ``[-1, 1]``)
            act, the rest is ignored, so the 7-D VLA convention fits (default 7).
        step_size: distance the agent moves per step at full action, in arena units (arena is
            the unit square).
        success_radius: the task is solved when the agent's centre is this close to the
            target's centre (0.05: on the target's centre; 0.1: the agent dot touches the shape).
        reward_mode: ``"sparse"`` -> reward 1.0 at the success step, 0 otherwise (the default);
            ``"dense"`` -> the same success reward plus a shaping term for progress towards the
            target at every step, ``progress_reward_scale * (d_before - d_after) / step_size``
            (``d``: agent-target distance). The shaping is potential-based (a telescoping sum
            of ``-d``), so it does not change which policies are optimal (undiscounted); it only
            tells the learner which way is closer.
        progress_reward_scale: weight of the dense progress term; a full step straight at the
            target earns this much (default 0.1, so the progress of a whole episode is worth
            less than the success reward).
        agent_start: ``"random"`` -> the agent starts in its own random cell (the default);
            ``"center"`` -> the agent starts at the arena centre (objects then avoid the centre
            cell), an easier setting where the way to the target depends only on where the
            target is drawn.
        state_mode: ``"proprio"`` -> state is the agent position ``[x, y]``; ``"privileged"``
            -> ``[x, y, dx, dy]`` with the offset to the target (for image-free learning tests).
        device: torch device the simulation and the observations live on.
        step_time_s: extra seconds each batched step sleeps, emulating a slower simulator.
        step_time_per_env_s: extra seconds per stepped env each batched step sleeps.
    """

    num_envs: int = 8
    image_size: int = 64
    num_objects: int = 3
    action_dim: int = 7
    step_size: float = 0.06
    success_radius: float = 0.05
    state_mode: str = "proprio"
    reward_mode: str = "sparse"
    progress_reward_scale: float = 0.1
    agent_start: str = "random"
    device: str = "cpu"
    step_time_s: float = 0.0
    step_time_per_env_s: float = 0.0

    def episode_steps(self) -> int:
        return self.max_episode_steps or DEFAULT_MAX_EPISODE_STEPS

    def spec(self) -> EnvSpec:
        """State: the agent position (``proprio``), or with the target's (``privileged``)."""
        return EnvSpec(self.cameras, self.action_dim, 4 if self.state_mode == "privileged" else 2)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_field(self, "image_size", 8 <= self.image_size <= 1024, "must lie in [8, 1024]")
        check_field(
            self,
            "num_objects",
            1 <= self.num_objects <= min(len(COLORS), GRID * GRID - 1),
            f"must lie in [1, {min(len(COLORS), GRID * GRID - 1)}]",
        )
        check_field(self, "action_dim", self.action_dim >= 2, "must be >= 2")
        check_field(self, "step_size", 0 < self.step_size <= 1, "must lie in (0, 1]")
        check_field(self, "success_radius", 0 < self.success_radius < 0.5, "must lie in (0, 0.5)")
        check_field(
            self,
            "state_mode",
            self.state_mode in ("proprio", "privileged"),
            "must be 'proprio' or 'privileged'",
        )
        check_field(
            self,
            "reward_mode",
            self.reward_mode in ("sparse", "dense"),
            "must be 'sparse' or 'dense'",
        )
        check_field(self, "progress_reward_scale", self.progress_reward_scale >= 0, "must be >= 0")
        check_field(
            self,
            "agent_start",
            self.agent_start in ("random", "center"),
            "must be 'random' or 'center'",
        )
        check_field(self, "step_time_s", self.step_time_s >= 0, "must be >= 0")
        check_field(self, "step_time_per_env_s", self.step_time_per_env_s >= 0, "must be >= 0")
