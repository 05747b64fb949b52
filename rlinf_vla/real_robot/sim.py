"""A simulated Franka Panda in MuJoCo behind the :class:`~rlinf_vla.real_robot.robot.Robot`
interface, so the whole server + client + safety loop runs without hardware.

The arm and the Franka Hand come from the Panda MJCF files that robosuite ships (its
``models/assets``; read from disk, robosuite itself is not imported); a floor, a red cube, a
front camera ``main`` and the hand camera ``wrist`` are added with ``MjSpec``. Cameras render
offscreen (``MUJOCO_GL=egl`` or ``osmesa``).

Control follows the real arm's convention: :meth:`SimFranka.command` takes an absolute TCP
target, solves differential inverse kinematics (damped least squares on MuJoCo's site
Jacobian) for the joint goal, clips it to the joint limits and the datasheet joint speeds, and
tracks it for one control period with a joint impedance controller (PD + gravity and Coriolis
compensation from ``qfrc_bias``) on the arm's torque motors, interpolating the reference.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlinf_vla.real_robot.kinematics import (
    HAND_TCP,
    PANDA_JOINT_LOWER,
    PANDA_JOINT_UPPER,
    PANDA_MAX_JOINT_VELOCITY,
    matrix_to_rotvec,
)
from rlinf_vla.real_robot.robot import Robot, RobotState
from rlinf_vla.real_robot.validation import require_finite

__all__ = ["SimFranka", "SimFrankaConfig", "panda_assets"]

HOME = (0.0, -0.785, 0.0, -2.356, 0.0, 1.571, 0.785)


@dataclass
class SimFrankaConfig:
    """The ``robot`` section for ``robot=sim``.

    Attributes:
        image_size: square camera resolution (px).
        cameras: which of ``main`` (front view) and ``wrist`` (hand camera) to render.
        control_rate_hz: the control period the arm tracks each command over.
        home: joint configuration of :meth:`SimFranka.reset` (rad).
        cube_pos: initial position of the red cube (m).
        physics_dt: MuJoCo time step (s).
        fast_render: no shadows nor multisampling (about 15x faster on a CPU renderer).
    """

    name: str = "sim"
    image_size: int = 224
    cameras: tuple[str, ...] = ("main", "wrist")
    control_rate_hz: float = 10.0
    home: tuple[float, ...] = HOME
    cube_pos: tuple[float, float, float] = (0.5, 0.0, 0.02)
    physics_dt: float = 0.002
    fast_render: bool = True

    def __post_init__(self) -> None:
        self.cameras = tuple(self.cameras)
        self.home = tuple(float(x) for x in self.home)
        require_finite(self, "robot")
        unknown = sorted(set(self.cameras) - {"main", "wrist"})
        if unknown or not self.cameras:
            raise ValueError(f"robot.cameras {list(self.cameras)}: known cameras are main, wrist")
        if not 16 <= self.image_size <= 1024:
            raise ValueError(f"robot.image_size must be in 16..1024, got {self.image_size}")
        if len(self.home) != 7:
            raise ValueError("robot.home needs 7 joint positions")
        if self.control_rate_hz <= 0 or self.physics_dt <= 0:
            raise ValueError("robot.control_rate_hz and robot.physics_dt must be > 0")


def panda_assets() -> Path:
    """robosuite's MJCF asset folder (``robots/panda``, ``grippers``), located without import."""
    spec = importlib.util.find_spec("robosuite")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the simulated Franka needs the Panda MJCF assets of robosuite "
            "(pip install 'rlinf-vla[libero]' or pip install robosuite==1.4.0)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "models" / "assets"
    if not (path / "robots" / "panda" / "robot.xml").is_file():
        raise FileNotFoundError(f"no Panda model under {path}")
    return path


def _look_at(pos: np.ndarray, target: np.ndarray) -> tuple[float, ...]:
    """MuJoCo ``xyaxes`` of a camera at ``pos`` looking at ``target`` (z up)."""
    fwd = target - pos
    fwd /= np.linalg.norm(fwd)
    x = np.cross(fwd, [0.0, 0.0, 1.0])
    x /= np.linalg.norm(x)
    y = np.cross(x, fwd)
    return (*x, *y)


def build_model(cfg: SimFrankaConfig):  # -> mujoco.MjModel
    import mujoco

    assets = panda_assets()
    arm = mujoco.MjSpec.from_file(str(assets / "robots" / "panda" / "robot.xml"))
    hand = mujoco.MjSpec.from_file(str(assets / "grippers" / "panda_gripper.xml"))
    for spec in (arm, hand):  # the files state angles in radians without saying so
        spec.compiler.degree = False
    arm.option.timestep = cfg.physics_dt
    right_hand = arm.body("right_hand")
    right_hand.add_frame().attach_body(hand.body("right_gripper"), "gripper_", "")
    right_hand.add_site(name="tcp", pos=[0.0, 0.0, HAND_TCP], size=[0.005, 0.005, 0.005])
    arm.camera("eye_in_hand").name = "wrist"
    world = arm.worldbody
    world.add_light(pos=[0.5, -0.5, 2.0], dir=[0.0, 0.3, -1.0], diffuse=[0.8, 0.8, 0.8])
    world.add_light(pos=[1.5, 0.5, 1.5], dir=[-1.0, -0.3, -1.0], diffuse=[0.4, 0.4, 0.4])
    world.add_geom(
        type=mujoco.mjtGeom.mjGEOM_PLANE, size=[2.0, 2.0, 0.05], rgba=[0.55, 0.5, 0.45, 1.0]
    )
    cube = world.add_body(name="cube", pos=list(cfg.cube_pos))
    cube.add_freejoint()
    cube.add_geom(
        type=mujoco.mjtGeom.mjGEOM_BOX,
        size=[0.02, 0.02, 0.02],
        rgba=[0.85, 0.1, 0.1, 1.0],
        mass=0.05,
    )
    cam_pos = np.array([1.25, 0.0, 0.75])
    world.add_camera(
        name="main", pos=cam_pos, xyaxes=_look_at(cam_pos, np.array([0.45, 0.0, 0.15])), fovy=50
    )
    model = arm.compile()
    model.site_rgba[:, 3] = 0.0  # robosuite's visual helper sites would show in the cameras
    # Software rendering: shadows and multisampling cost ~15x; off by default.
    model.vis.quality.shadowsize = 0 if cfg.fast_render else 4096
    model.vis.quality.offsamples = 0 if cfg.fast_render else 4
    return model


class SimFranka(Robot):
    """The MuJoCo Panda (see the module docstring)."""

    #: Computed-torque gains on the tracking error (1/s^2, 1/s): critically damped, 60 rad/s.
    KP = np.full(7, 3600.0)
    KD = np.full(7, 120.0)

    def __init__(self, cfg: SimFrankaConfig) -> None:
        os.environ.setdefault("MUJOCO_GL", "egl")
        import mujoco

        self._mj = mujoco
        self.cfg = cfg
        self.camera_names = tuple(cfg.cameras)
        self.model = build_model(cfg)
        self.data = mujoco.MjData(self.model)
        self._scratch = mujoco.MjData(self.model)
        m = self.model
        self._qadr = np.array([m.jnt_qposadr[m.joint(f"joint{i}").id] for i in range(1, 8)])
        self._vadr = np.array([m.jnt_dofadr[m.joint(f"joint{i}").id] for i in range(1, 8)])
        self._arm_act = np.array([m.actuator(f"torq_j{i}").id for i in range(1, 8)])
        self._torque_limit = m.actuator_ctrlrange[self._arm_act, 1].copy()
        self._grip_act = [
            m.actuator("gripper_gripper_finger_joint1").id,
            m.actuator("gripper_gripper_finger_joint2").id,
        ]
        self._finger_q = [m.jnt_qposadr[m.joint(f"gripper_finger_joint{i}").id] for i in (1, 2)]
        self._tcp = m.site("tcp").id
        self._cube_q = m.jnt_qposadr[m.body("cube").jntadr[0]]
        self._renderer = mujoco.Renderer(m, cfg.image_size, cfg.image_size)
        self._substeps = max(1, round(1.0 / cfg.control_rate_hz / cfg.physics_dt))
        self._q_ref = np.array(cfg.home)
        self._gripper_closed = False

    # ------------------------------------------------------------------ state
    @property
    def joint_positions(self) -> np.ndarray:
        return self.data.qpos[self._qadr].copy()

    @property
    def cube_position(self) -> np.ndarray:
        return self.data.qpos[self._cube_q : self._cube_q + 3].copy()

    def read(self) -> RobotState:
        images = {}
        for cam in self.camera_names:
            self._renderer.update_scene(self.data, camera=cam)
            images[cam] = self._renderer.render().copy()
        fingers = self.data.qpos[self._finger_q]
        return RobotState(
            joint_positions=self.joint_positions,
            ee_pos=self.data.site_xpos[self._tcp].copy(),
            ee_rot=self.data.site_xmat[self._tcp].reshape(3, 3).copy(),
            gripper_width=float(fingers[0] - fingers[1]),
            images=images,
        )

    def reset(self) -> RobotState:
        mj = self._mj
        mj.mj_resetData(self.model, self.data)
        self.data.qpos[self._qadr] = self.cfg.home
        self.data.qpos[self._finger_q] = [0.04, -0.04]
        self.data.qpos[self._cube_q : self._cube_q + 3] = self.cfg.cube_pos
        self.data.qpos[self._cube_q + 3 : self._cube_q + 7] = [1.0, 0.0, 0.0, 0.0]
        self._q_ref = np.array(self.cfg.home)
        self._gripper_closed = False
        mj.mj_forward(self.model, self.data)
        self._track(self._q_ref, steps=self._substeps)  # settle
        return self.read()

    # ------------------------------------------------------------------ control
    def solve_ik(
        self, target_pos: np.ndarray, target_rot: np.ndarray, q0: np.ndarray, iters: int = 10
    ) -> np.ndarray:
        """Joint positions ``[7]`` reaching the TCP target, by damped least squares from ``q0``."""
        mj, m, d = self._mj, self.model, self._scratch
        d.qpos[:] = self.data.qpos
        q = np.asarray(q0, dtype=np.float64).copy()
        jacp, jacr = np.zeros((3, m.nv)), np.zeros((3, m.nv))
        for _ in range(iters):
            d.qpos[self._qadr] = q
            mj.mj_kinematics(m, d)
            mj.mj_comPos(m, d)
            pos = d.site_xpos[self._tcp]
            rot = d.site_xmat[self._tcp].reshape(3, 3)
            err = np.concatenate([target_pos - pos, matrix_to_rotvec(target_rot @ rot.T)])
            if np.linalg.norm(err) < 1e-5:
                break
            mj.mj_jacSite(m, d, jacp, jacr, self._tcp)
            jac = np.vstack([jacp[:, self._vadr], jacr[:, self._vadr]])
            q = q + jac.T @ np.linalg.solve(jac @ jac.T + 1e-4 * np.eye(6), err)
            q = np.clip(q, PANDA_JOINT_LOWER, PANDA_JOINT_UPPER)
        return q

    def _track(self, q_goal: np.ndarray, steps: int, qd_goal: np.ndarray | None = None) -> None:
        """Move from the *measured* joint state to ``q_goal`` in ``steps`` physics steps.

        The reference is the cubic Hermite from the measured ``(q, qd)`` to ``(q_goal,
        qd_goal)`` (default: rest), tracked by computed-torque control (the arm's own mass
        matrix, gravity, Coriolis and joint damping, plus a stiff PD on the residual), so the
        arm ends the period on the goal: the next command starts from where the arm really is.
        """
        mj, m, d = self._mj, self.model, self.data
        grip = [0.0, 0.0] if self._gripper_closed else [0.04, -0.04]
        d.ctrl[self._grip_act] = grip
        h = m.opt.timestep
        T = steps * h
        q0, v0 = d.qpos[self._qadr].copy(), d.qvel[self._vadr].copy()
        v1 = np.zeros(7) if qd_goal is None else np.asarray(qd_goal, dtype=np.float64)
        delta = np.asarray(q_goal, dtype=np.float64) - q0
        # q(t) = q0 + v0 t + c2 t^2 + c3 t^3 with q(T) = q_goal, qd(T) = v1
        c2 = (3.0 * delta - (2.0 * v0 + v1) * T) / T**2
        c3 = (-2.0 * delta + (v0 + v1) * T) / T**3
        mass = np.zeros((m.nv, m.nv))
        idx = np.ix_(self._vadr, self._vadr)
        for k in range(steps):
            t = (k + 1) * h  # the reference the step is heading for
            q_ref = q0 + v0 * t + c2 * t**2 + c3 * t**3
            qd_ref = v0 + 2.0 * c2 * t + 3.0 * c3 * t**2
            qdd_ref = 2.0 * c2 + 6.0 * c3 * t
            q, qd = d.qpos[self._qadr], d.qvel[self._vadr]
            # mujoco 3.3 (the pinned one) expands the sparse inertia ``d.qM``; from 3.12 on
            # ``mj_fullM`` takes ``d`` (and ``MjData`` has no ``qM``)
            if hasattr(d, "qM"):
                mj.mj_fullM(m, mass, d.qM)
            else:
                mj.mj_fullM(m, d, mass)
            acc = qdd_ref + self.KP * (q_ref - q) + self.KD * (qd_ref - qd)
            tau = mass[idx] @ acc + d.qfrc_bias[self._vadr] - d.qfrc_passive[self._vadr]
            d.ctrl[self._arm_act] = np.clip(tau, -self._torque_limit, self._torque_limit)
            mj.mj_step(m, d)

    def command(
        self,
        target_pos: np.ndarray,
        target_rot: np.ndarray,
        gripper_closed: bool,
        joint_target: np.ndarray | None = None,
    ) -> None:
        """Move to the TCP target over one control period (simulated time).

        With ``joint_target`` (the joint goal the safety layer verified) the arm goes exactly
        there; without, the goal is solved by IK from the measured joints. Either way the step
        is clipped to the joint limits and the datasheet joint speeds.
        """
        dt = self._substeps * self.model.opt.timestep
        q = self.joint_positions
        if joint_target is None:
            q_goal = self.solve_ik(np.asarray(target_pos), np.asarray(target_rot), q)
        else:
            q_goal = np.asarray(joint_target, dtype=np.float64)
        # The cubic's peak speed is 1.5x its mean: keep the peak within the datasheet.
        vmax = PANDA_MAX_JOINT_VELOCITY * dt / 1.5
        q_goal = np.clip(q + np.clip(q_goal - q, -vmax, vmax), PANDA_JOINT_LOWER, PANDA_JOINT_UPPER)
        self._gripper_closed = bool(gripper_closed)
        self._track(q_goal, self._substeps)
        self._q_ref = q_goal

    def stop(self) -> None:
        """Hold: the reference becomes the measured joint positions."""
        self._q_ref = self.joint_positions

    def close(self) -> None:
        renderer, self._renderer = getattr(self, "_renderer", None), None
        if renderer is not None:
            renderer.close()
