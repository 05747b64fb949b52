"""Scripted experts for ManiSkill3 tasks: one ``pd_ee_delta_pose`` action per env from privileged
state (object, goal and TCP poses read from the simulator), batch-shaped torch code.

An expert decides from the current state only (closed-loop feedback on pose errors, no phase
timers), so it recovers from disturbances: a cube knocked out of the hand is approached and
grasped again. Its actions are in the package's convention (gripper ``+1`` close, ``-1``
open); :class:`~rlinf_vla.envs.maniskill.env.ManiSkillEnv` converts them to the env's own.

>>> expert = make_expert("PickCube-v1", env.unwrapped)   # a ManiSkill env, any num_envs
>>> action = expert.act()                                # float32 [num_envs, 7]

Controller facts (``mani_skill/agents/controllers/pd_ee_pose.py``, Panda): the arm target is the
current TCP pose moved by ``0.1 * a[:3]`` m (root frame) and rotated on the left (root-aligned
frame) by the XYZ Euler angles ``rot_lower * a[3:6]`` where ``rot_lower = -0.1``: ManiSkill scales
the rotation by the *lower* bound, so ``+a`` rotates by ``-0.1 * a`` rad; the rotation vector is
first clipped to norm 1. The experts read these scales from the controller, not from constants.
One control step moves the TCP by about 45 % of the commanded delta (the PD drives lag).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch

__all__ = ["EXPERTS", "Expert", "make_expert", "register_expert"]

#: Expert classes by ManiSkill task id, filled by :func:`register_expert`.
EXPERTS: dict[str, type[Expert]] = {}

#: The only control mode the experts act in.
CONTROL_MODE = "pd_ee_delta_pose"

_X = TypeVar("_X", bound="type[Expert]")

# Gripper commands in the package convention.
_CLOSE, _OPEN = 1.0, -1.0


def register_expert(task: str) -> Callable[[_X], _X]:
    """Class decorator: register an :class:`Expert` subclass for ManiSkill task ``task``."""

    def decorator(cls: _X) -> _X:
        if task in EXPERTS and EXPERTS[task] is not cls:
            raise ValueError(f"task {task!r} already has the expert {EXPERTS[task].__name__}")
        cls.task = task
        EXPERTS[task] = cls
        return cls

    return decorator


def check_expert(task: str, control_mode: str) -> type[Expert]:
    """The expert class of ``task``; fails naming the tasks and control mode experts support."""
    if task not in EXPERTS:
        raise ValueError(
            f"no scripted expert for ManiSkill task {task!r}; tasks with an expert: "
            f"{sorted(EXPERTS)}"
        )
    if control_mode != CONTROL_MODE:
        raise ValueError(
            f"the scripted experts act in control_mode={CONTROL_MODE!r}, the env uses "
            f"control_mode={control_mode!r}"
        )
    return EXPERTS[task]


def make_expert(task: str, env: Any) -> Expert:
    """The expert of ``task`` driving the unwrapped ManiSkill env ``env`` (any ``num_envs``)."""
    return check_expert(task, env.control_mode)(env)


# ---------------------------------------------------------------------- geometry helpers
def _wrap(angle: torch.Tensor, period: float) -> torch.Tensor:
    """``angle`` wrapped into ``[-period / 2, period / 2)``."""
    return torch.remainder(angle + period / 2, period) - period / 2


def _yaw(rot: torch.Tensor) -> torch.Tensor:
    """Heading of the x axis of rotations ``[N, 3, 3]`` in the xy plane: ``[N]`` radians."""
    return torch.atan2(rot[:, 1, 0], rot[:, 0, 0])


def _rot_z(angle: torch.Tensor) -> torch.Tensor:
    c, s = torch.cos(angle), torch.sin(angle)
    z, o = torch.zeros_like(angle), torch.ones_like(angle)
    return torch.stack((c, -s, z, s, c, z, z, z, o), dim=-1).view(-1, 3, 3)


def _top_down(yaw: torch.Tensor) -> torch.Tensor:
    """Gripper pointing down (TCP z axis along -z) with its x axis at heading ``yaw``: [N, 3, 3].

    The Panda's fingers close along the TCP's y axis, i.e. at heading ``yaw - 90 deg``.
    """
    flip = torch.diag(torch.tensor([1.0, -1.0, -1.0], device=yaw.device))
    return _rot_z(yaw) @ flip


# ---------------------------------------------------------------------- base class
class Expert(ABC):
    """A scripted policy for one ManiSkill task, over all envs of one ManiSkill env.

    Subclasses implement :meth:`act_batch`: they read the privileged state of ``self.env`` and
    set TCP targets through :meth:`move_to`. Positions and rotations are in the robot's root
    frame (:meth:`tcp`, :meth:`in_root`). :meth:`reset` clears per-env memory (none by default).
    """

    task: ClassVar[str] = ""
    #: Largest translation per step the experts ask for, in m (IK fails on longer jumps).
    max_step_m: ClassVar[float] = 0.06
    #: Feedback gains: commanded delta = gain * remaining error.
    pos_gain: ClassVar[float] = 1.5
    rot_gain: ClassVar[float] = 1.0
    #: Horizontal TCP distances from the robot's root (m) over which the limit of outward steps
    #: shrinks from ``max_step_m`` to ``edge_step_m``.
    reach_m: ClassVar[tuple[float, float]] = (0.70, 0.78)
    edge_step_m: ClassVar[float] = 0.006

    def __init__(self, env: Any) -> None:
        from mani_skill.agents.controllers.pd_ee_pose import PDEEPoseController

        self.env = env
        self.device = env.device
        arm = env.agent.controller.controllers.get("arm")
        cfg = getattr(arm, "config", None)
        if (
            not isinstance(arm, PDEEPoseController)
            or not cfg.use_delta
            or not cfg.normalize_action
            or cfg.frame != "root_translation:root_aligned_body_rotation"
        ):
            raise ValueError(
                f"{type(self).__name__} needs the arm in {CONTROL_MODE!r} with root-frame "
                f"deltas; got {env.control_mode!r} ({type(arm).__name__})"
            )
        self.arm = arm

        def vec(x: Any) -> torch.Tensor:
            return torch.as_tensor(x, dtype=torch.float32, device=self.device).expand(3)

        low, high = vec(cfg.pos_lower), vec(cfg.pos_upper)
        self._pos_mid, self._pos_half = (high + low) / 2, (high - low) / 2
        self._rot_scale = vec(cfg.rot_lower)  # signed: ManiSkill scales by the lower bound
        self.action_dim = int(env.single_action_space.shape[-1])
        self.num_envs = int(env.num_envs)

    # ------------------------------------------------------------------ interface
    def reset(self, env_idx: torch.Tensor | None = None) -> None:  # noqa: B027 (optional hook)
        """Forget what the expert remembers about envs ``env_idx`` (all when ``None``)."""

    def act(self) -> torch.Tensor:
        """The expert's action for every env's current state: float32 ``[N, A]`` on the CPU."""
        with torch.no_grad():
            return self.act_batch().float().clamp(-1.0, 1.0).cpu()

    @abstractmethod
    def act_batch(self) -> torch.Tensor:
        """float32 ``[N, A]`` on the env's device."""

    # ------------------------------------------------------------------ state helpers
    def in_root(self, pose: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Position ``[N, 3]`` and rotation ``[N, 3, 3]`` of world pose ``pose`` in the root frame."""
        from mani_skill.utils.geometry.rotation_conversions import quaternion_to_matrix

        local = self.arm.root_link.pose.inv() * pose
        return local.p.float(), quaternion_to_matrix(local.q).float()

    def tcp(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The TCP's position and rotation in the root frame."""
        return self.in_root(self.env.agent.tcp.pose)

    def finger_gap(self) -> torch.Tensor:
        """Distance between the Panda's fingers ``[N]`` (0.08 m fully open)."""
        return self.env.agent.robot.get_qpos()[:, -2:].sum(-1).float()

    def grasp_yaw(self, obj_rot: torch.Tensor, tcp_rot: torch.Tensor) -> torch.Tensor:
        """The top-down gripper heading nearest the current one whose fingers close on two faces
        of a box with rotation ``obj_rot`` (faces repeat every 90 deg)."""
        now = _yaw(tcp_rot)
        return now + _wrap(_yaw(obj_rot) - now, math.pi / 2)

    # ------------------------------------------------------------------ action
    def move_to(
        self,
        tcp_p: torch.Tensor,
        tcp_rot: torch.Tensor,
        target_p: torch.Tensor,
        target_rot: torch.Tensor,
        gripper: torch.Tensor,
        max_step_m: torch.Tensor | float | None = None,
    ) -> torch.Tensor:
        """The action ``[N, A]`` moving the TCP from ``tcp_*`` towards ``target_*`` (root frame).

        Translation: ``pos_gain`` times the error, at most ``max_step_m`` per step; rotation:
        ``rot_gain`` times the error as a rotation vector, at most the controller's limit.
        """
        from mani_skill.utils.geometry.rotation_conversions import (
            axis_angle_to_matrix,
            matrix_to_axis_angle,
            matrix_to_euler_angles,
        )

        limit = self.max_step_m if max_step_m is None else max_step_m
        limit = torch.as_tensor(limit, dtype=torch.float32, device=tcp_p.device)
        limit = torch.minimum(limit, self._pos_half.min())
        step = self.pos_gain * (target_p - tcp_p)
        norm = torch.linalg.vector_norm(step, dim=-1, keepdim=True)
        step = step * torch.clamp(limit.reshape(-1, 1) / norm.clamp_min(1e-9), max=1.0)
        # Near the edge of the workspace the controller's IK only converges for short outward
        # steps (it drops the step otherwise, and the arm stalls): shorten them with the reach.
        reach = torch.linalg.vector_norm(tcp_p[:, :2], dim=-1)
        radial = tcp_p[:, :2] / reach[:, None].clamp_min(1e-6)
        edge = torch.clamp((reach - self.reach_m[0]) / (self.reach_m[1] - self.reach_m[0]), 0, 1)
        out_max = self.max_step_m - edge * (self.max_step_m - self.edge_step_m)
        outward = (step[:, :2] * radial).sum(-1)
        excess = torch.clamp(outward - out_max, min=0.0)
        step[:, :2] -= excess[:, None] * radial
        pos_a = (step - self._pos_mid) / self._pos_half

        turn = self.rot_gain * matrix_to_axis_angle(target_rot @ tcp_rot.transpose(1, 2))
        angle = torch.linalg.vector_norm(turn, dim=-1, keepdim=True)
        max_angle = self._rot_scale.abs().min()
        turn = turn * torch.clamp(max_angle / angle.clamp_min(1e-9), max=1.0)
        euler = matrix_to_euler_angles(axis_angle_to_matrix(turn), "XYZ")
        rot_a = euler / self._rot_scale
        rot_a = rot_a / torch.linalg.vector_norm(rot_a, dim=-1, keepdim=True).clamp_min(1.0)

        out = torch.zeros(len(tcp_p), self.action_dim, device=tcp_p.device)
        out[:, :3] = pos_a.clamp(-1.0, 1.0)
        out[:, 3:6] = rot_a
        out[:, -1] = gripper
        return out


# ---------------------------------------------------------------------- pick-and-place
class _PickPlace(Expert):
    """Grasp a cube from above and carry it so that its centre reaches a target point.

    Decided from the state each step:

    - not holding the cube: fly to above the cube with the fingers open and their closing
      direction on two cube faces, descending as the xy error shrinks; once the TCP is at the
      cube's centre and aligned, close the fingers; fingers closed on nothing (a miss) open
      again above the cube;
    - holding it (ManiSkill's ``is_grasping``, or the fingers closed onto the cube around the
      TCP): carry it, moving the TCP by the cube-to-target offset, slowing down near the
      target so that the arm comes to rest there.
    """

    half: ClassVar[float] = 0.02  # cube half size, m
    #: Fingers this far apart or wider are "open" (fully open: 0.08 m, the cube: 0.04 m).
    open_gap: ClassVar[float] = 0.07
    #: Height above the cube the gripper flies at before it descends, m.
    hover: ClassVar[float] = 0.08
    #: Lowest TCP height above the cube's centre while the fingers turn or open, m.
    clear_top: ClassVar[float] = 0.045

    #: Open fingertips closer than this to an obstacle's centre would land on it, m.
    finger_clearance_m: ClassVar[float] = 0.045

    @abstractmethod
    def cube(self) -> Any:
        """The ManiSkill actor to pick."""

    @abstractmethod
    def place_target(self) -> torch.Tensor:
        """Where the cube's centre should go, root frame ``[N, 3]``."""

    def obstacles(self) -> torch.Tensor | None:
        """Centres of boxes the fingers must not land on, root frame ``[N, M, 3]`` (none)."""
        return None

    @staticmethod
    def finger_clearance(
        yaw: torch.Tensor, cube_p: torch.Tensor, obstacles: torch.Tensor
    ) -> torch.Tensor:
        """Smallest xy distance ``[N]`` from the open fingertips (grasping at ``cube_p`` with
        heading ``yaw``) to an obstacle centre."""
        axis = torch.stack((torch.sin(yaw), -torch.cos(yaw)), dim=-1)  # the TCP's y axis
        tips = cube_p[:, None, :2] + 0.045 * torch.stack((axis, -axis), dim=1)  # [N, 2, 2]
        dist = torch.linalg.vector_norm(tips[:, :, None] - obstacles[:, None, :, :2], dim=-1)
        return dist.flatten(1).amin(1)

    def holding(self, tcp_p: torch.Tensor, cube_p: torch.Tensor) -> torch.Tensor:
        """``[N]`` the cube sits between closed fingers."""
        gap = self.finger_gap()
        near = torch.linalg.vector_norm(cube_p - tcp_p, dim=-1) < 0.015
        around = (gap > 2 * self.half - 0.012) & (gap < 2 * self.half + 0.004)
        return self.env.agent.is_grasping(self.cube()).to(near.device) | (near & around)

    def pick(
        self,
        tcp_p: torch.Tensor,
        tcp_rot: torch.Tensor,
        cube_p: torch.Tensor,
        cube_rot: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Approach-and-grasp targets: TCP position, rotation and gripper command ``[N]``."""
        yaw = self.grasp_yaw(cube_rot, tcp_rot)
        obstacles = self.obstacles()
        if obstacles is not None:
            # The other finger axis (90 deg away, turning the shorter way) when the fingers
            # would land on an obstacle and the other axis keeps them further off.
            other = yaw - torch.where(yaw >= _yaw(tcp_rot), 1.0, -1.0) * (math.pi / 2)
            clear, clear_other = (self.finger_clearance(y, cube_p, obstacles) for y in (yaw, other))
            # A margin keeps the choice from flipping back and forth (hysteresis).
            use_other = (clear < self.finger_clearance_m) & (clear_other > clear + 0.008)
            yaw = torch.where(use_other, other, yaw)
        rot = _top_down(yaw)
        xy_err = torch.linalg.vector_norm(cube_p[:, :2] - tcp_p[:, :2], dim=-1)
        yaw_err = _wrap(yaw - _yaw(tcp_rot), 2 * math.pi).abs()
        gap = self.finger_gap()
        # Descend as the xy error shrinks.
        height = torch.clamp(3.0 * (xy_err - 0.004), 0.0, self.hover)
        # Fingers not open (e.g. closed on nothing after a miss), or turning: keep the
        # fingertips clear of the cube's top.
        busy = (gap < self.open_gap) | (yaw_err > math.radians(20))
        height = torch.where(busy, torch.clamp(height, min=self.clear_top), height)
        target = cube_p.clone()
        target[:, 2] = cube_p[:, 2] + height
        at_grasp = (xy_err < 0.01) & ((tcp_p[:, 2] - cube_p[:, 2]).abs() < 0.012)
        at_grasp &= yaw_err < math.radians(12)
        missed = gap < 2 * self.half - 0.012  # closed past the cube: nothing in between
        close = at_grasp & ~missed
        gripper = torch.where(close, _CLOSE, _OPEN)
        return target, rot, gripper

    def act_batch(self) -> torch.Tensor:
        tcp_p, tcp_rot = self.tcp()
        cube_p, cube_rot = self.in_root(self.cube().pose)
        target_p, target_rot, gripper = self.pick(tcp_p, tcp_rot, cube_p, cube_rot)
        pick = self.move_to(tcp_p, tcp_rot, target_p, target_rot, gripper)

        goal = self.place_target()
        carry_p = tcp_p + (goal - cube_p)
        dist = torch.linalg.vector_norm(goal - cube_p, dim=-1)
        # Slow down near the target so the arm is at rest when the cube arrives.
        limit = torch.clamp(dist, 0.01, self.max_step_m)
        carry = self.move_to(
            tcp_p, tcp_rot, carry_p, _top_down(_yaw(tcp_rot)), torch.full_like(dist, _CLOSE), limit
        )
        return torch.where(self.holding(tcp_p, cube_p)[:, None], carry, pick)


@register_expert("PickCube-v1")
class PickCubeExpert(_PickPlace):
    """PickCube: grasp the red cube and hold its centre at the green goal until the arm rests."""

    def cube(self) -> Any:
        return self.env.cube

    def place_target(self) -> torch.Tensor:
        return self.in_root(self.env.goal_site.pose)[0]


@register_expert("StackCube-v1")
class StackCubeExpert(_PickPlace):
    """StackCube: grasp the red cube, put it on the green one, let go and back off upwards.

    The fingers close along the cube axis that keeps them off the green cube when it is near.
    Carrying flies the red cube in above the green one and lowers it to 4 mm above the stacked
    position; when it is there within 4 mm in xy the fingers open and the cube drops into
    place. With the cube released on the stack the gripper rises. Near the edge of the
    workspace the red cube is put up to 12 mm off the green cube's centre towards the robot
    (success allows 33 mm), where the arm still reaches. A red cube more than about 0.8 m
    (horizontally) from the robot's root cannot be reached from above; such scenes fail (2 of
    reset ids 0-299: 264 and 287).
    """

    #: Horizontal distance from the robot's root beyond which the stack point moves inwards, m.
    inward_from_m: ClassVar[float] = 0.77

    def cube(self) -> Any:
        return self.env.cubeA

    def obstacles(self) -> torch.Tensor:
        return self.in_root(self.env.cubeB.pose)[0][:, None]

    def stack_point(self) -> torch.Tensor:
        """Where the red cube's centre rests when stacked, root frame ``[N, 3]``."""
        target = self.in_root(self.env.cubeB.pose)[0].clone()
        reach = torch.linalg.vector_norm(target[:, :2], dim=-1, keepdim=True)
        inward = torch.clamp(reach - self.inward_from_m, 0.0, 0.012)
        target[:, :2] -= inward * target[:, :2] / reach.clamp_min(1e-6)
        target[:, 2] += 2 * self.half
        return target

    def place_target(self) -> torch.Tensor:
        a_p = self.in_root(self.env.cubeA.pose)[0]
        target = self.stack_point()
        # Fly in above the green cube, then lower the red one onto it.
        xy = torch.linalg.vector_norm(target[:, :2] - a_p[:, :2], dim=-1)
        target[:, 2] += 0.004 + torch.clamp(1.5 * (xy - 0.005), 0.0, 0.05)
        return target

    def act_batch(self) -> torch.Tensor:
        act = super().act_batch()
        tcp_p, tcp_rot = self.tcp()
        a_p = self.in_root(self.env.cubeA.pose)[0]
        offset = a_p - self.stack_point()
        xy = torch.linalg.vector_norm(offset[:, :2], dim=-1)
        holding = self.holding(tcp_p, a_p)
        release = holding & (xy < 0.004) & (offset[:, 2].abs() < 0.008)
        act[:, :6] = torch.where(release[:, None], 0.0, act[:, :6])  # hold still, let go
        act[:, -1] = torch.where(release, _OPEN, act[:, -1])
        # Released on the stack: open and rise straight up.
        placed = (xy < 0.02) & (offset[:, 2].abs() < 0.01) & ~holding
        up = tcp_p.clone()
        # Rise once the fingers are open (rising earlier drags the cube along).
        up[:, 2] = torch.where(self.finger_gap() > self.open_gap, a_p[:, 2] + self.hover, up[:, 2])
        rise = self.move_to(
            tcp_p, tcp_rot, up, _top_down(_yaw(tcp_rot)), torch.full_like(xy, _OPEN)
        )
        rise[:, 3:6] *= (self.finger_gap() > self.open_gap)[:, None]  # no turning either
        return torch.where(placed[:, None], rise, act)


# ---------------------------------------------------------------------- pushing
@register_expert("PushCube-v1")
class PushCubeExpert(Expert):
    """PushCube: close the fingers, go behind the cube (the side away from the goal), lower the
    TCP to the cube's centre height and push the cube along the cube-to-goal line until its
    centre reaches the goal centre.

    The push direction and the pre-push point are recomputed every step, so a cube that drifts
    sideways is pushed back onto the line; a TCP that is not behind the cube rises above it and
    comes round again.
    """

    half: ClassVar[float] = 0.02
    #: Distance behind the cube face the TCP starts the push from, m.
    standoff: ClassVar[float] = 0.02

    def act_batch(self) -> torch.Tensor:
        env = self.env
        tcp_p, tcp_rot = self.tcp()
        cube_p = self.in_root(env.obj.pose)[0]
        goal_p = self.in_root(env.goal_region.pose)[0]
        to_goal = goal_p[:, :2] - cube_p[:, :2]
        dist = torch.linalg.vector_norm(to_goal, dim=-1)
        u = to_goal / dist[:, None].clamp_min(1e-6)  # push direction in the xy plane
        rel = tcp_p[:, :2] - cube_p[:, :2]
        along = (rel * u).sum(-1)  # < 0: behind the cube
        across = (rel[:, 0] * u[:, 1] - rel[:, 1] * u[:, 0]).abs()
        behind = (along < -(self.half + 0.005)) & (across < 0.012)
        low = cube_p[:, 2]  # TCP at the cube's centre height

        # Approach: the pre-push point, flying high over the cube when not yet behind it.
        pre = cube_p.clone()
        pre[:, :2] = cube_p[:, :2] - u * (self.half + self.standoff)
        d_pre = torch.linalg.vector_norm(pre[:, :2] - tcp_p[:, :2], dim=-1)
        pre[:, 2] = low + torch.clamp(2.0 * (d_pre - 0.01), 0.0, 0.08)
        # Push: the TCP goes to where the cube's back face is when the cube is at the goal.
        push = cube_p.clone()
        push[:, :2] = goal_p[:, :2] - u * (self.half + 0.005)
        push[:, 2] = low
        # Minus the TCP's sideways offset from the cube-goal line: steer back onto the line.
        side = rel - along[:, None] * u
        push[:, :2] = push[:, :2] - side
        target = torch.where((behind & (tcp_p[:, 2] < low + 0.015))[:, None], push, pre)
        limit = torch.where(behind, torch.clamp(dist, 0.02, 0.04), self.max_step_m)
        return self.move_to(
            tcp_p,
            tcp_rot,
            target,
            _top_down(_yaw(tcp_rot)),
            torch.full_like(dist, _CLOSE),
            limit,
        )
