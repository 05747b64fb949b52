"""The robot interface every backend implements (simulated MuJoCo Panda, real Franka).

Action convention (the policy's): one action is ``float32 [7]`` =
``[dx, dy, dz, drx, dry, drz, gripper]``: a tool-centre-point translation (m) and an
axis-angle rotation (rad), both in the robot's base frame, applied to the *measured* pose, then
the gripper command (``> threshold`` closes). The deploy loop scales raw policy outputs into these
units (``action.translation_scale``...), the safety layer bounds them, and a backend only ever
receives an absolute, already-safe target pose through :meth:`Robot.command`.

Proprioception sent to the policy, ``float32 [8]``: TCP position (3), TCP orientation as
axis-angle (3), the two finger positions (2, each half the gripper width), the LIBERO layout.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from rlinf_vla.real_robot.kinematics import matrix_to_rotvec

__all__ = ["Robot", "RobotState"]


@dataclass
class RobotState:
    """One reading of the robot.

    Attributes:
        joint_positions: ``float64 [7]`` (rad).
        ee_pos: tool-centre-point position ``[3]`` in the base frame (m).
        ee_rot: its orientation, rotation matrix ``[3, 3]``.
        gripper_width: distance between the fingers (m).
        images: camera name -> ``uint8 [H, W, 3]``.
        timestamp: ``time.monotonic()`` when it was read.
    """

    joint_positions: np.ndarray
    ee_pos: np.ndarray
    ee_rot: np.ndarray
    gripper_width: float
    images: dict[str, np.ndarray] = field(default_factory=dict)
    timestamp: float = field(default_factory=time.monotonic)

    def proprio(self) -> np.ndarray:
        """The policy's state vector ``float32 [8]`` (see the module docstring)."""
        half = self.gripper_width / 2.0
        return np.concatenate([self.ee_pos, matrix_to_rotvec(self.ee_rot), [half, -half]]).astype(
            np.float32
        )


class Robot(ABC):
    """A Franka arm with a parallel gripper and cameras.

    Backends are constructed from their config section and must make :meth:`stop` safe to call
    at any moment, from any thread, any number of times (the e-stop calls it).
    """

    #: Camera names this backend provides.
    camera_names: tuple[str, ...] = ()

    @abstractmethod
    def reset(self) -> RobotState:
        """Move to the home configuration, open the gripper; return the state there."""

    @abstractmethod
    def read(self) -> RobotState:
        """Read joints, TCP pose, gripper and every camera."""

    @abstractmethod
    def command(
        self,
        target_pos: np.ndarray,
        target_rot: np.ndarray,
        gripper_closed: bool,
        joint_target: np.ndarray | None = None,
    ) -> None:
        """Start moving the TCP towards ``target_pos [3]`` / ``target_rot [3, 3]`` (base frame)
        and the gripper towards closed/open. Returns without waiting for the motion; the
        deploy loop paces the calls at the control rate.

        ``joint_target [7]``, when given, is the joint configuration reaching that pose whose
        step the safety layer checked against the joint speed bound: a backend moves to it
        (not to another IK solution of the same pose), so the bound holds on what executes."""

    @abstractmethod
    def stop(self) -> None:
        """Stop all motion at once and hold the current pose (e-stop path)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release hardware and renderers."""
