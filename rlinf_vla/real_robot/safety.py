"""The safety layer between the policy and the robot, independent of the backend.

Every check is a pure numpy function; :class:`SafetyFilter` chains them once per control tick,
turning a (possibly absent, stale or absurd) policy action into an absolute target pose that
the backend executes, and logs and counts every intervention. The chain, in order:

1. **e-stop** (:class:`EStop`, from a signal or a key): hold, and the loop ends.
2. **watchdog**: no action, or an action executed more than ``watchdog_s`` after its scheduled
   time (:func:`is_stale`), and the last executed fresh action is older than ``watchdog_s``:
   hold position.
3. **non-finite**: an action with NaN/inf or the wrong size is rejected (hold).
4. **workspace**: the target ``p + dp`` is clamped into the box (:func:`clamp_to_workspace`).
5. **max translation / rotation per step**: ``|dp| <= max_translation_m``,
   ``|dr| <= max_rotation_rad`` (:func:`clamp_norm`).
6. **joint velocity**: the twist is scaled down until the joint step it needs (solved on the
   exact Panda kinematics) stays within ``max_joint_velocity * dt`` and the joint goal within
   the joint limits (:func:`limit_joint_velocity`); the backend executes that joint goal.
7. **gripper debounce**: a gripper toggle needs ``gripper_debounce_steps`` consecutive
   requests and ``gripper_min_interval_s`` since the last one (:func:`debounce_gripper`).

Guarantees (tested adversarially in ``tests/real_robot/test_safety.py``): the commanded step
never exceeds the translation and rotation bounds; when the measured TCP is inside the box the
target is too (steps 5-6 only shrink a step along the segment from an in-box point to an
in-box target, and the box is convex); from outside the box every step moves towards it.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from rlinf_vla.real_robot.kinematics import (
    PANDA_JOINT_LOWER,
    PANDA_JOINT_UPPER,
    matrix_to_rotvec,
    panda_fk,
    panda_jacobian,
    rotvec_to_matrix,
)
from rlinf_vla.real_robot.robot import RobotState
from rlinf_vla.real_robot.validation import require_finite

__all__ = [
    "INTERVENTIONS",
    "EStop",
    "GripperDebounce",
    "Intervention",
    "SafeCommand",
    "SafetyConfig",
    "SafetyFilter",
    "clamp_norm",
    "clamp_to_workspace",
    "debounce_gripper",
    "is_finite_action",
    "is_stale",
    "joint_step_for",
    "limit_joint_velocity",
    "pose_error",
]

log = logging.getLogger(__name__)

#: The intervention kinds, in the order of the chain.
INTERVENTIONS = (
    "estop",
    "watchdog",
    "non_finite",
    "workspace",
    "max_translation",
    "max_rotation",
    "joint_velocity",
    "gripper_debounce",
)


@dataclass
class SafetyConfig:
    """The ``safety`` section of ``rlinf-vla deploy`` (units: m, rad, s).

    Attributes:
        workspace_min / workspace_max: the box (base frame) the TCP target must stay in.
        max_translation_m: largest TCP translation commanded in one control step.
        max_rotation_rad: largest TCP rotation (axis-angle norm) in one control step.
        max_joint_velocity: per-joint speed bound (rad/s) of the commanded step (7 values).
        gripper_threshold: gripper action above it means "close".
        gripper_debounce_steps: consecutive identical requests needed to toggle the gripper.
        gripper_min_interval_s: minimum time between two gripper toggles.
        watchdog_s: hold position when no fresh action arrived within this deadline.
        tcp_offset_m: tool-centre-point distance from the flange (Franka Hand: 0.1034).
        tracking_margin_m / tracking_margin_rad: the arm's tracking error budget. Targets are
            kept this far inside the box, the translation / rotation bounds and each joint's
            step bound, so that the *measured* motion (target plus tracking error) respects
            the configured limits. Measure it on the arm (the simulated Panda: under 1 mm and
            5 mrad at 10 Hz).
    """

    workspace_min: tuple[float, float, float] = (0.25, -0.4, 0.05)
    workspace_max: tuple[float, float, float] = (0.75, 0.4, 0.6)
    max_translation_m: float = 0.02
    max_rotation_rad: float = 0.1
    max_joint_velocity: tuple[float, ...] = (0.6, 0.6, 0.6, 0.6, 0.75, 0.75, 0.75)
    gripper_threshold: float = 0.0
    gripper_debounce_steps: int = 2
    gripper_min_interval_s: float = 0.5
    watchdog_s: float = 0.5
    tcp_offset_m: float = 0.1034
    tracking_margin_m: float = 0.001
    tracking_margin_rad: float = 0.005

    def __post_init__(self) -> None:
        self.workspace_min = tuple(float(x) for x in self.workspace_min)
        self.workspace_max = tuple(float(x) for x in self.workspace_max)
        self.max_joint_velocity = tuple(float(x) for x in self.max_joint_velocity)
        require_finite(self, "safety")
        if len(self.workspace_min) != 3 or len(self.workspace_max) != 3:
            raise ValueError("safety.workspace_min/workspace_max need 3 values (x, y, z)")
        if any(lo >= hi for lo, hi in zip(self.workspace_min, self.workspace_max, strict=True)):
            raise ValueError(
                f"safety.workspace_min {self.workspace_min} must be below workspace_max "
                f"{self.workspace_max} on every axis"
            )
        if len(self.max_joint_velocity) != 7 or min(self.max_joint_velocity) <= 0:
            raise ValueError("safety.max_joint_velocity needs 7 positive values (rad/s)")
        for key in ("max_translation_m", "max_rotation_rad", "watchdog_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"safety.{key} must be > 0, got {getattr(self, key)}")
        if self.max_translation_m > 0.1:
            raise ValueError(
                f"safety.max_translation_m={self.max_translation_m} is above 0.1 m per step; "
                "that is not a safety limit"
            )
        if not 0 <= self.tracking_margin_m < self.max_translation_m:
            raise ValueError(
                f"safety.tracking_margin_m={self.tracking_margin_m} must be in "
                f"[0, max_translation_m={self.max_translation_m})"
            )
        if not 0 <= self.tracking_margin_rad < self.max_rotation_rad:
            raise ValueError(
                f"safety.tracking_margin_rad={self.tracking_margin_rad} must be in "
                f"[0, max_rotation_rad={self.max_rotation_rad})"
            )
        if any(
            hi - lo <= 2 * self.tracking_margin_m
            for lo, hi in zip(self.workspace_min, self.workspace_max, strict=True)
        ):
            raise ValueError("safety: the workspace box is narrower than twice tracking_margin_m")
        if self.tcp_offset_m < 0:
            raise ValueError(f"safety.tcp_offset_m must be >= 0, got {self.tcp_offset_m}")
        if self.gripper_debounce_steps < 1:
            raise ValueError("safety.gripper_debounce_steps must be >= 1")
        if self.gripper_min_interval_s < 0:
            raise ValueError("safety.gripper_min_interval_s must be >= 0")


# ------------------------------------------------------------------------------ pure checks
def is_finite_action(action: Any, action_dim: int = 7) -> str | None:
    """``None`` if ``action`` is a finite float vector ``[action_dim]``, else the reason."""
    a = np.asarray(action)
    if a.shape != (action_dim,):
        return f"action has shape {list(a.shape)}, expected [{action_dim}]"
    if a.dtype.kind not in "fiu":
        return f"action has dtype {a.dtype}"
    if not np.isfinite(a).all():
        return f"action holds NaN/inf: {a.tolist()}"
    return None


def clamp_norm(v: np.ndarray, max_norm: float) -> tuple[np.ndarray, bool]:
    """``v`` scaled down to Euclidean norm ``<= max_norm``; ``(v', clipped)``."""
    n = float(np.linalg.norm(v))
    if n <= max_norm:
        return np.asarray(v, dtype=np.float64), False
    return np.asarray(v, dtype=np.float64) * (max_norm / n), True


def clamp_to_workspace(
    pos: np.ndarray, delta: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, bool]:
    """The step ``delta'`` such that ``pos + delta'`` is ``pos + delta`` clamped into the box
    ``[lo, hi]``; ``(delta', clipped)``. From outside the box the step points into it."""
    target = np.asarray(pos, dtype=np.float64) + np.asarray(delta, dtype=np.float64)
    clamped = np.clip(target, lo, hi)
    return clamped - pos, bool(np.any(clamped != target))


def joint_step_for(
    q: np.ndarray,
    dp: np.ndarray,
    dr: np.ndarray,
    tcp: float = 0.1034,
    iters: int = 8,
    tol: float = 1e-9,
) -> np.ndarray:
    """The joint step ``dq [7]`` that moves the TCP by ``(dp, dr)``, by damped Gauss-Newton on
    the exact kinematics from ``q`` (the minimum-norm solution of the redundant arm, to first
    order). Stops after ``iters`` iterations or once the pose error is below ``tol``."""
    p0, r0 = panda_fk(q, tcp)
    target_p, target_r = p0 + dp, rotvec_to_matrix(dr) @ r0
    qq = np.asarray(q, dtype=np.float64).copy()
    for _ in range(iters):
        p, r = panda_fk(qq, tcp)
        err = np.concatenate([target_p - p, matrix_to_rotvec(target_r @ r.T)])
        if np.linalg.norm(err) < tol:
            break
        jac = panda_jacobian(qq, tcp)
        qq = qq + jac.T @ np.linalg.solve(jac @ jac.T + 1e-6 * np.eye(6), err)
    return qq - q


def pose_error(
    q: np.ndarray, dq: np.ndarray, dp: np.ndarray, dr: np.ndarray, tcp: float = 0.1034
) -> tuple[float, float]:
    """How far ``q + dq`` puts the TCP from the step ``(dp, dr)`` away from ``q``: ``(m, rad)``."""
    p0, r0 = panda_fk(q, tcp)
    p, r = panda_fk(np.asarray(q) + dq, tcp)
    rot = matrix_to_rotvec(rotvec_to_matrix(dr) @ r0 @ r.T)
    return float(np.linalg.norm(p0 + dp - p)), float(np.linalg.norm(rot))


#: Joint goals stay this far inside the joint limits (rad).
JOINT_LIMIT_MARGIN = 0.005

#: A joint step must put the TCP this close to the commanded step (m, rad) to be executed.
IK_TOLERANCE = (1e-6, 1e-5)


def limit_joint_velocity(
    q: np.ndarray,
    dp: np.ndarray,
    dr: np.ndarray,
    dt: float,
    max_qd: np.ndarray,
    tcp: float = 0.1034,
    rounds: int = 12,
    q_min: np.ndarray | None = None,
    q_max: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """Scale the TCP step ``(dp [3], dr [3])`` so the joint step that executes it is bounded.

    The joint step ``dq`` is solved on the exact Panda kinematics to convergence
    (:func:`joint_step_for`) and checked: it must reach the step within :data:`IK_TOLERANCE`
    and satisfy ``|dq_i| <= max_qd_i * dt``. Otherwise the twist is scaled by ``0.98 / over``
    (``over = max_i |dq_i| / (max_qd_i dt)``, halved when the solve did not converge) and
    solved again, because ``dq`` is only linear in the twist to first order. The ``dq``
    returned is the one checked, and the backend executes exactly ``q + dq``
    (:attr:`SafeCommand.joint_target`), so the bound holds on the executed joint step, not
    on a second IK's guess. The goal must also stay within the joint limits ``[q_min,
    q_max]`` (default: Panda's, :data:`JOINT_LIMIT_MARGIN` inside; a joint past them may
    only move back): a backend clipping the goal there would put the TCP elsewhere. Near a singularity ``dq`` grows and ``s`` shrinks: the arm slows
    down instead of whipping; if no scale passes within ``rounds`` the arm holds (``s = 0``).

    Returns:
        ``(dp', dr', s, dq)`` with ``s`` in ``[0, 1]`` and ``dq [7]`` the checked joint step.
    """
    allowed = np.asarray(max_qd, dtype=np.float64) * dt
    dp, dr = np.asarray(dp, dtype=np.float64), np.asarray(dr, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    q_min = PANDA_JOINT_LOWER + JOINT_LIMIT_MARGIN if q_min is None else np.asarray(q_min)
    q_max = PANDA_JOINT_UPPER - JOINT_LIMIT_MARGIN if q_max is None else np.asarray(q_max)
    total = 1.0
    for _ in range(rounds):
        step_p, step_r = dp * total, dr * total
        dq = joint_step_for(q, step_p, step_r, tcp, iters=50, tol=1e-12)
        err_p, err_r = pose_error(q, dq, step_p, step_r, tcp)
        over = float(np.max(np.abs(dq) / allowed))
        if err_p <= IK_TOLERANCE[0] and err_r <= IK_TOLERANCE[1]:
            goal = q + dq
            past = ((goal > q_max) & (dq > 0)) | ((goal < q_min) & (dq < 0))
            fit = 1.0
            if past.any():
                room = np.where(dq > 0, q_max - q, q_min - q)[past] / dq[past]
                fit = float(np.clip(room.min(), 0.0, 1.0))
                if fit == 0.0:
                    break  # a joint at its limit and the step pushes it further: hold
            if over <= 1.0 and fit == 1.0:
                return step_p, step_r, float(total), dq
            total *= 0.98 * min(1.0 / over if over > 1.0 else 1.0, fit)
        else:
            total *= 0.5
    return np.zeros(3), np.zeros(3), 0.0, np.zeros(7)


@dataclass
class GripperDebounce:
    """State of :func:`debounce_gripper`."""

    closed: bool = False
    candidate: bool = False
    count: int = 0
    last_change: float = -np.inf


def debounce_gripper(
    request_closed: bool, state: GripperDebounce, now: float, steps: int, min_interval: float
) -> tuple[GripperDebounce, bool]:
    """Accept a gripper toggle only after ``steps`` consecutive requests for it and at least
    ``min_interval`` s after the previous toggle.

    Returns:
        ``(new_state, suppressed)``: ``new_state.closed`` is the command to send;
        ``suppressed`` is true when a requested toggle was held back.
    """
    if request_closed == state.closed:
        return GripperDebounce(state.closed, state.closed, 0, state.last_change), False
    count = state.count + 1 if state.candidate == request_closed else 1
    if count >= steps and now - state.last_change >= min_interval:
        return GripperDebounce(request_closed, request_closed, 0, now), False
    return GripperDebounce(state.closed, request_closed, count, state.last_change), True


def is_stale(scheduled_at: float, now: float, deadline: float) -> bool:
    """An action scheduled for ``scheduled_at`` is stale once ``now`` is ``deadline`` past it."""
    return now - scheduled_at > deadline


# ------------------------------------------------------------------------------ e-stop
class EStop:
    """An emergency stop: once triggered it stays triggered and calls its callbacks at once
    (the deploy loop registers ``robot.stop``).

    Triggers: :meth:`trigger` from any thread, SIGINT/SIGTERM after :meth:`install_signals`, or
    the Enter key (or ``q``/``s`` + Enter) on a terminal after :meth:`watch_keys`.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        self.reason: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def triggered(self) -> bool:
        return self._event.is_set()

    def on_trigger(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def trigger(self, reason: str = "e-stop") -> None:
        first = not self._event.is_set()
        self._event.set()
        if first:
            self.reason = reason
            log.error("E-STOP: %s", reason)
        for cb in self._callbacks:  # every trigger stops again: stop() must be idempotent
            try:
                cb()
            except Exception:
                log.exception("e-stop callback failed")

    def install_signals(self) -> None:
        """SIGINT / SIGTERM trigger the e-stop (main thread only); restored by :meth:`restore`."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(
                sig, lambda s, _f: self.trigger(f"signal {signal.Signals(s).name}")
            )

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def watch_keys(self, stream: TextIO | None = None) -> threading.Thread | None:
        """Trigger on Enter / ``q`` / ``s`` typed on ``stream`` (default: stdin if a terminal)."""
        stream = stream or sys.stdin
        if stream is sys.stdin and not sys.stdin.isatty():
            return None

        def watch() -> None:
            for line in stream:
                if line.strip().lower() in ("", "q", "s", "stop"):
                    self.trigger("key pressed")
                    return

        thread = threading.Thread(target=watch, name="estop-keys", daemon=True)
        thread.start()
        return thread


# ------------------------------------------------------------------------------ the chain
@dataclass
class Intervention:
    """One safety intervention (a line of ``interventions.jsonl``)."""

    step: int
    time: float
    kind: str
    detail: str


@dataclass
class SafeCommand:
    """What the backend executes for one tick.

    Attributes:
        target_pos: ``[3]`` absolute TCP target (m); target_rot: ``[3, 3]``.
        delta_pos / delta_rot: the step actually commanded (``[3]`` m, ``[3]`` rad axis-angle).
        joint_target: ``[7]`` the joint goal whose step was checked against the joint speed
            bound (the measured joints when holding); backends execute it.
        gripper_closed: the debounced gripper command.
        hold: true when the action was replaced by "hold the measured pose".
        interventions: the kinds that fired this tick.
    """

    target_pos: np.ndarray
    target_rot: np.ndarray
    delta_pos: np.ndarray
    delta_rot: np.ndarray
    joint_target: np.ndarray
    gripper_closed: bool
    hold: bool
    interventions: list[str] = field(default_factory=list)


class SafetyFilter:
    """Apply the chain of the module docstring once per tick; count and log interventions.

    Args:
        config: the limits.
        dt: the control period (s), for the joint-velocity bound.
        estop: the e-stop to obey (a fresh one when ``None``).
    """

    def __init__(self, config: SafetyConfig, dt: float, estop: EStop | None = None) -> None:
        self.config = config
        self.dt = float(dt)
        self.estop = estop or EStop()
        self.counts: Counter[str] = Counter({k: 0 for k in INTERVENTIONS})
        self.log: list[Intervention] = []
        self.gripper = GripperDebounce()
        self.last_fresh: float | None = None
        # Targets stay tracking_margin_m inside the box and the step bounds: the arm's tracking
        # error (measured pose vs target at the end of a tick) is budgeted here, so that the
        # *measured* TCP respects the configured box and step bounds.
        self._lo = np.asarray(config.workspace_min) + config.tracking_margin_m
        self._hi = np.asarray(config.workspace_max) - config.tracking_margin_m
        self._max_dp = config.max_translation_m - config.tracking_margin_m
        self._max_dr = config.max_rotation_rad - config.tracking_margin_rad
        # ... and tracking_margin_rad inside each joint's step bound.
        self._max_qd = np.maximum(
            np.asarray(config.max_joint_velocity) - config.tracking_margin_rad / self.dt,
            0.5 * np.asarray(config.max_joint_velocity),
        )
        self._step = 0
        self.last: list[Intervention] = []  # the interventions of the latest tick

    def _record(self, kinds: list[str], kind: str, detail: str, now: float) -> None:
        kinds.append(kind)
        self.counts[kind] += 1
        self.log.append(Intervention(self._step, now, kind, detail))
        self.last.append(self.log[-1])
        log.warning("safety[%d] %s: %s", self._step, kind, detail)

    def _hold(self, state: RobotState, kinds: list[str]) -> SafeCommand:
        return SafeCommand(
            target_pos=np.asarray(state.ee_pos, dtype=np.float64).copy(),
            target_rot=np.asarray(state.ee_rot, dtype=np.float64).copy(),
            delta_pos=np.zeros(3),
            delta_rot=np.zeros(3),
            joint_target=np.asarray(state.joint_positions, dtype=np.float64).copy(),
            gripper_closed=self.gripper.closed,
            hold=True,
            interventions=kinds,
        )

    def __call__(
        self,
        action: np.ndarray | None,
        state: RobotState,
        now: float,
        scheduled_at: float | None = None,
    ) -> SafeCommand:
        """The safe command for this tick.

        Args:
            action: ``[7]`` ``(dp [3] m, dr [3] rad, gripper)`` already in metric units, or
                ``None`` when no action is available (waiting for the server).
            state: the latest robot reading (measured TCP pose, joints).
            now: ``time.monotonic()`` of this tick.
            scheduled_at: when this action was due (chunk arrival + index x dt).
        """
        cfg = self.config
        kinds: list[str] = []
        self._step += 1
        self.last = []
        if self.last_fresh is None:
            self.last_fresh = now
        if self.estop.triggered:
            self._record(kinds, "estop", self.estop.reason or "e-stop", now)
            return self._hold(state, kinds)
        if (
            action is not None
            and scheduled_at is not None
            and is_stale(scheduled_at, now, cfg.watchdog_s)
        ):
            late = now - scheduled_at
            action = None
            self._record(
                kinds,
                "watchdog",
                f"action {late * 1000:.0f} ms late (deadline {cfg.watchdog_s} s)",
                now,
            )
            return self._hold(state, kinds)
        if action is None:
            if now - self.last_fresh > cfg.watchdog_s:
                self._record(
                    kinds, "watchdog", f"no fresh action for {now - self.last_fresh:.2f} s", now
                )
            return self._hold(state, kinds)
        self.last_fresh = now
        reason = is_finite_action(action)
        if reason is not None:
            self._record(kinds, "non_finite", reason, now)
            return self._hold(state, kinds)
        a = np.asarray(action, dtype=np.float64)
        pos = np.asarray(state.ee_pos, dtype=np.float64)
        dp, clipped = clamp_to_workspace(pos, a[:3], self._lo, self._hi)
        if clipped:
            self._record(
                kinds,
                "workspace",
                f"target {np.round(pos + a[:3], 3).tolist()} outside the box",
                now,
            )
        dp, clipped = clamp_norm(dp, self._max_dp)
        if clipped:
            self._record(kinds, "max_translation", f"|dp|={np.linalg.norm(a[:3]):.4f} m", now)
        dr, clipped = clamp_norm(a[3:6], self._max_dr)
        if clipped:
            self._record(kinds, "max_rotation", f"|dr|={np.linalg.norm(a[3:6]):.4f} rad", now)
        q = np.asarray(state.joint_positions, dtype=np.float64)
        dp, dr, s, dq = limit_joint_velocity(
            q,
            dp,
            dr,
            self.dt,
            self._max_qd,
            cfg.tcp_offset_m,
        )
        if s == 0.0:
            self._record(
                kinds,
                "joint_velocity",
                "no joint step within the speed bound and the joint limits reaches it: hold",
                now,
            )
        elif s < 1.0:
            self._record(
                kinds, "joint_velocity", f"step scaled by {s:.3f} (joint speed / limits)", now
            )
        self.gripper, suppressed = debounce_gripper(
            bool(a[6] > cfg.gripper_threshold),
            self.gripper,
            now,
            cfg.gripper_debounce_steps,
            cfg.gripper_min_interval_s,
        )
        if suppressed:
            self._record(
                kinds,
                "gripper_debounce",
                f"toggle to {'closed' if not self.gripper.closed else 'open'} held back",
                now,
            )
        return SafeCommand(
            target_pos=pos + dp,
            target_rot=rotvec_to_matrix(dr) @ np.asarray(state.ee_rot, dtype=np.float64),
            delta_pos=dp,
            delta_rot=dr,
            joint_target=q + dq,
            gripper_closed=self.gripper.closed,
            hold=False,
            interventions=kinds,
        )

    def summary(self) -> dict[str, int]:
        return dict(self.counts)
