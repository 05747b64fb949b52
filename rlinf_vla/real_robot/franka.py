"""The real Franka arm (Panda or FR3) with Intel RealSense cameras.

A thin adapter from :class:`~rlinf_vla.real_robot.robot.Robot` to two PyPI libraries, imported
only when a :class:`Franka` is built (``pip install 'rlinf-vla[robot]'``):

- ``franky-control`` (module ``franky``): Franka control on top of libfranka. Its wheels bundle
  libfranka 0.21, which speaks to FR3 robots (system image >= 5.x); a Panda on an older system
  image needs franky built from source against the matching libfranka (see docs/deploy.md).
- ``pyrealsense2``: the RealSense colour streams, one per camera serial number.

:meth:`Franka.command` sends the joint goal the safety layer checked (``JointMotion``; an
absolute Cartesian target when none is given) with ``asynchronous=True``: franky replaces the
running motion with the new target, and its Ruckig trajectory generation keeps
velocity, acceleration and jerk within the robot's limits scaled by
``relative_dynamics_factor``. The safety layer runs before this adapter; the robot's own
collision reflexes (``set_collision_behavior``) run after it.

This module cannot be tested without the hardware: CI checks only that it imports, that the
config validates, and that the franky API it calls exists with these names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rlinf_vla.real_robot.kinematics import matrix_to_quat_xyzw, quat_xyzw_to_matrix
from rlinf_vla.real_robot.robot import Robot, RobotState
from rlinf_vla.real_robot.sim import HOME
from rlinf_vla.real_robot.validation import require_finite

__all__ = ["Franka", "FrankaConfig"]


@dataclass
class FrankaConfig:
    """The ``robot`` section for ``robot=franka``.

    Attributes:
        host: the FCI address of the arm's controller (Desk: "Activate FCI" first).
        cameras: camera name -> RealSense serial number (``rs-enumerate-devices -s``).
        camera_width / camera_height / camera_fps: the colour stream mode.
        image_size: frames are centre-cropped to a square and resized to this (px).
        relative_dynamics_factor: fraction of the robot's velocity/acceleration/jerk limits
            franky may use (0.05..1; start low).
        home: joint configuration of :meth:`Franka.reset` (rad).
        gripper_speed: m/s; grasp_force: N; gripper_open_width: m.
        torque_thresholds / force_thresholds: the controller's collision reflex thresholds
            (Nm per joint, N/Nm per Cartesian axis); contact above them stops the arm.
        control_rate_hz: unused by the hardware path; the loop rate comes from the server.
    """

    name: str = "franka"
    host: str = "172.16.0.2"
    cameras: dict[str, str | int] = field(default_factory=lambda: {"main": "", "wrist": ""})
    camera_width: int = 640
    camera_height: int = 480
    camera_fps: int = 30
    image_size: int = 224
    relative_dynamics_factor: float = 0.1
    home: tuple[float, ...] = HOME
    gripper_speed: float = 0.05
    grasp_force: float = 20.0
    gripper_open_width: float = 0.08
    torque_thresholds: tuple[float, ...] = (20.0, 20.0, 18.0, 18.0, 16.0, 14.0, 12.0)
    force_thresholds: tuple[float, ...] = (20.0, 20.0, 20.0, 25.0, 25.0, 25.0)
    control_rate_hz: float = 10.0

    def __post_init__(self) -> None:
        self.cameras = {str(k): str(v) for k, v in self.cameras.items()}
        self.home = tuple(float(x) for x in self.home)
        self.torque_thresholds = tuple(float(x) for x in self.torque_thresholds)
        self.force_thresholds = tuple(float(x) for x in self.force_thresholds)
        require_finite(self, "robot")
        if not 0.01 <= self.relative_dynamics_factor <= 1.0:
            raise ValueError(
                f"robot.relative_dynamics_factor must be in [0.01, 1], got {self.relative_dynamics_factor}"
            )
        if not self.cameras:
            raise ValueError("robot.cameras: name at least one camera (name: serial number)")
        missing = [k for k, v in self.cameras.items() if not v]
        if missing:
            raise ValueError(
                f"robot.cameras: no serial number for {missing}; list them with "
                "`rs-enumerate-devices -s` and set e.g. robot.cameras.main=123456789012"
            )
        if (
            len(self.home) != 7
            or len(self.torque_thresholds) != 7
            or len(self.force_thresholds) != 6
        ):
            raise ValueError("robot.home/torque_thresholds need 7 values, force_thresholds 6")


class _RealSense:
    """One RealSense colour stream."""

    def __init__(self, serial: str, cfg: FrankaConfig) -> None:
        import pyrealsense2 as rs

        self.pipeline = rs.pipeline()
        config = rs.config()
        config.enable_device(serial)
        config.enable_stream(
            rs.stream.color, cfg.camera_width, cfg.camera_height, rs.format.rgb8, cfg.camera_fps
        )
        self.pipeline.start(config)
        self.size = cfg.image_size

    def read(self) -> np.ndarray:
        from PIL import Image

        frames = self.pipeline.wait_for_frames(timeout_ms=1000)
        rgb = np.asanyarray(frames.get_color_frame().get_data())
        h, w = rgb.shape[:2]
        s = min(h, w)
        top, left = (h - s) // 2, (w - s) // 2
        square = Image.fromarray(rgb[top : top + s, left : left + s])
        return np.asarray(square.resize((self.size, self.size), Image.BILINEAR), dtype=np.uint8)

    def close(self) -> None:
        self.pipeline.stop()


class Franka(Robot):
    """The real arm (see the module docstring)."""

    def __init__(self, cfg: FrankaConfig) -> None:
        try:
            import franky
        except ImportError as e:
            raise ImportError(
                "robot=franka needs franky-control and pyrealsense2: pip install 'rlinf-vla[robot]'"
            ) from e
        self._franky = franky
        self.cfg = cfg
        self.camera_names = tuple(cfg.cameras)
        self.robot = franky.Robot(cfg.host)
        self.robot.recover_from_errors()
        self.robot.relative_dynamics_factor = cfg.relative_dynamics_factor
        self.robot.set_collision_behavior(list(cfg.torque_thresholds), list(cfg.force_thresholds))
        self.gripper = franky.Gripper(cfg.host)
        self._cameras = {name: _RealSense(serial, cfg) for name, serial in cfg.cameras.items()}
        self._gripper_closed: bool | None = None

    def read(self) -> RobotState:
        pose = self.robot.current_cartesian_state.pose.end_effector_pose
        return RobotState(
            joint_positions=np.asarray(self.robot.current_joint_state.position, dtype=np.float64),
            ee_pos=np.asarray(pose.translation, dtype=np.float64),
            ee_rot=quat_xyzw_to_matrix(pose.quaternion),
            gripper_width=float(self.gripper.width),
            images={name: cam.read() for name, cam in self._cameras.items()},
        )

    def reset(self) -> RobotState:
        franky = self._franky
        self.robot.recover_from_errors()
        self.robot.move(franky.JointMotion(list(self.cfg.home)))
        self.gripper.move(self.cfg.gripper_open_width, self.cfg.gripper_speed)
        self._gripper_closed = False
        return self.read()

    def command(
        self,
        target_pos: np.ndarray,
        target_rot: np.ndarray,
        gripper_closed: bool,
        joint_target: np.ndarray | None = None,
    ) -> None:
        franky = self._franky
        if joint_target is not None:  # the joint goal the safety layer checked
            motion = franky.JointMotion([float(x) for x in joint_target])
        else:
            target = franky.Affine(
                np.asarray(target_pos, dtype=np.float64), matrix_to_quat_xyzw(target_rot)
            )
            motion = franky.CartesianMotion(target, franky.ReferenceType.Absolute)
        self.robot.move(motion, asynchronous=True)
        if gripper_closed != self._gripper_closed:
            if gripper_closed:
                self.gripper.grasp_async(
                    0.0,
                    self.cfg.gripper_speed,
                    self.cfg.grasp_force,
                    epsilon_outer=self.cfg.gripper_open_width,
                )
            else:
                self.gripper.move_async(self.cfg.gripper_open_width, self.cfg.gripper_speed)
            self._gripper_closed = gripper_closed

    def stop(self) -> None:
        """Stop the running motion (the arm brakes along its path and holds)."""
        self.robot.stop()

    def close(self) -> None:
        for cam in self._cameras.values():
            cam.close()

    def __repr__(self) -> str:
        return f"Franka(host={self.cfg.host!r}, cameras={list(self._cameras)})"
