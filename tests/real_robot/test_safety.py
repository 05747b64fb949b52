"""The safety layer under adversarial actions: whatever the policy sends, the commanded motion
stays inside the limits. Checks are against independent computations (box membership, norms,
finite-difference joint velocities), not against the filter's own bookkeeping."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from rlinf_vla.real_robot.kinematics import (
    matrix_to_quat_xyzw,
    matrix_to_rotvec,
    panda_fk,
    panda_jacobian,
    quat_xyzw_to_matrix,
    rotvec_to_matrix,
)
from rlinf_vla.real_robot.robot import RobotState
from rlinf_vla.real_robot.safety import (
    EStop,
    GripperDebounce,
    SafetyConfig,
    SafetyFilter,
    clamp_norm,
    clamp_to_workspace,
    debounce_gripper,
    is_finite_action,
    is_stale,
    limit_joint_velocity,
)

HOME = np.array([0.0, -0.785, 0.0, -2.356, 0.0, 1.571, 0.785])
DT = 0.1
CFG = SafetyConfig()
LO, HI = np.array(CFG.workspace_min), np.array(CFG.workspace_max)


def state_at(q: np.ndarray) -> RobotState:
    pos, rot = panda_fk(q)
    return RobotState(joint_positions=q, ee_pos=pos, ee_rot=rot, gripper_width=0.08)


def joint_step(q: np.ndarray, dp: np.ndarray, dr: np.ndarray) -> np.ndarray:
    """The joint step reaching the commanded TCP step, by Newton iterations on the FK
    (independent of the filter's linearisation)."""
    p0, r0 = panda_fk(q)
    target_p, target_r = p0 + dp, rotvec_to_matrix(dr) @ r0
    qq = q.copy()
    for _ in range(50):
        p, r = panda_fk(qq)
        err = np.concatenate([target_p - p, matrix_to_rotvec(target_r @ r.T)])
        if np.linalg.norm(err) < 1e-10:
            break
        qq = qq + np.linalg.lstsq(panda_jacobian(qq), err, rcond=None)[0]
    return qq - q


# ------------------------------------------------------------------------------ kinematics
def test_fk_home_pose_matches_the_published_value():
    """Franka's home pose puts the Franka Hand TCP at (0.307, 0, 0.487) m, pointing down."""
    pos, rot = panda_fk(HOME)
    np.testing.assert_allclose(pos, [0.307, 0.0, 0.487], atol=1e-3)
    np.testing.assert_allclose(rot[:, 2], [0, 0, -1], atol=1e-3)  # tool z points down


def test_jacobian_matches_finite_differences():
    rng = np.random.default_rng(0)
    for _ in range(5):
        q = HOME + rng.uniform(-0.5, 0.5, 7)
        jac = panda_jacobian(q)
        p0, r0 = panda_fk(q)
        for i in range(7):
            dq = np.zeros(7)
            dq[i] = 1e-6
            p1, r1 = panda_fk(q + dq)
            np.testing.assert_allclose((p1 - p0) / 1e-6, jac[:3, i], atol=1e-5)
            np.testing.assert_allclose(matrix_to_rotvec(r1 @ r0.T) / 1e-6, jac[3:, i], atol=1e-5)


def test_rotation_conversions_round_trip():
    rng = np.random.default_rng(1)
    for _ in range(50):
        r = rng.normal(size=3)
        r *= rng.uniform(0, np.pi - 1e-3) / np.linalg.norm(r)
        m = rotvec_to_matrix(r)
        np.testing.assert_allclose(m @ m.T, np.eye(3), atol=1e-12)
        np.testing.assert_allclose(matrix_to_rotvec(m), r, atol=1e-8)
        np.testing.assert_allclose(quat_xyzw_to_matrix(matrix_to_quat_xyzw(m)), m, atol=1e-9)
    # 90 deg about z by hand: x -> y.
    np.testing.assert_allclose(
        rotvec_to_matrix([0, 0, np.pi / 2]) @ [1, 0, 0], [0, 1, 0], atol=1e-12
    )
    np.testing.assert_allclose(
        np.linalg.norm(matrix_to_rotvec(rotvec_to_matrix([np.pi, 0, 0]))), np.pi
    )


# ------------------------------------------------------------------------------ pure functions
def test_workspace_clamp_by_hand():
    dp, clipped = clamp_to_workspace(np.array([0.7, 0.0, 0.3]), np.array([0.2, -1.0, 0.0]), LO, HI)
    np.testing.assert_allclose(dp, [0.05, -0.4, 0.0])  # target (0.75, -0.4, 0.3)
    assert clipped
    dp, clipped = clamp_to_workspace(np.array([0.5, 0.0, 0.3]), np.array([0.01, 0.0, 0.0]), LO, HI)
    np.testing.assert_allclose(dp, [0.01, 0, 0])
    assert not clipped


def test_clamp_norm_by_hand():
    v, clipped = clamp_norm(np.array([3.0, 4.0, 0.0]), 0.5)
    np.testing.assert_allclose(v, [0.3, 0.4, 0.0])
    assert clipped
    assert not clamp_norm(np.array([0.1, 0.0, 0.0]), 0.5)[1]


def test_is_finite_action():
    assert is_finite_action(np.zeros(7)) is None
    assert "NaN" in is_finite_action(np.array([0, 0, np.nan, 0, 0, 0, 0]))
    assert "NaN" in is_finite_action(np.array([0, 0, 0, np.inf, 0, 0, 0]))
    assert "shape" in is_finite_action(np.zeros(6))
    assert "shape" in is_finite_action(np.zeros((2, 7)))
    assert is_finite_action(np.array(["a"] * 7)) is not None


def test_joint_velocity_limit_bounds_the_true_joint_step():
    """Near a wrist singularity a small TCP step needs a large joint step: scaled down until the
    joint step it returns (the one the backend executes) is within the bound and reaches the
    scaled TCP step (checked by forward kinematics)."""
    q = HOME.copy()
    q[5] = 0.02  # wrist nearly stretched out: joint 6 close to its singular position
    max_qd = np.array(CFG.max_joint_velocity)
    dp, dr = np.array([0.0, 0.02, 0.0]), np.array([0.0, 0.0, 0.1])
    dp2, dr2, s, dq = limit_joint_velocity(q, dp, dr, DT, max_qd)
    assert 0 < s < 1.0
    np.testing.assert_allclose(dp2, dp * s)
    np.testing.assert_allclose(dr2, dr * s)
    assert np.all(np.abs(dq) <= max_qd * DT), (np.abs(dq) / (max_qd * DT)).max()
    p0, r0 = panda_fk(q)
    p1, r1 = panda_fk(q + dq)
    np.testing.assert_allclose(p1 - p0, dp2, atol=1e-6)
    np.testing.assert_allclose(matrix_to_rotvec(r1 @ r0.T), dr2, atol=1e-5)
    # The unscaled step would have broken the bound.
    assert np.any(np.abs(joint_step(q, dp, dr)) > max_qd * DT)


def test_executed_joint_step_within_the_bound_near_singularities():
    """Seeded random poses near the wrist, elbow and shoulder singularities and random
    max-size TCP steps: the joint step handed to the backend never exceeds the bound (the
    review found 1.15x with the old 8-iteration estimate) and reaches the commanded pose."""
    rng = np.random.default_rng(7)
    cfg = SafetyConfig()
    safety = SafetyFilter(cfg, DT)
    bound = np.array(cfg.max_joint_velocity) * DT
    scaled = 0
    for k in range(150):
        q = HOME + rng.uniform(-0.3, 0.3, 7)
        which = k % 3
        if which == 0:
            q[5] = rng.uniform(-0.05, 0.05)  # wrist stretched (joint 6)
        elif which == 1:
            q[3] = rng.uniform(-0.15, -0.07)  # elbow almost straight (joint 4 upper limit -0.07)
        else:
            q[4] = rng.uniform(-0.05, 0.05)
            q[5] = rng.uniform(-0.05, 0.05)
        st = state_at(q)
        a = np.concatenate([rng.normal(size=6) * 10.0, [0.0]])
        cmd = safety(a, st, now=k * DT)
        dq = cmd.joint_target - q
        assert np.all(np.abs(dq) <= bound + 1e-12), (k, np.abs(dq) / bound)
        p1, r1 = panda_fk(cmd.joint_target)
        assert np.linalg.norm(p1 - cmd.target_pos) < 1e-5
        assert np.linalg.norm(matrix_to_rotvec(r1 @ cmd.target_rot.T)) < 1e-4
        scaled += "joint_velocity" in cmd.interventions
    assert scaled > 10  # the streams did reach the bound


def test_gripper_debounce():
    st = GripperDebounce()
    # A one-tick flicker to "close" is suppressed.
    st, sup = debounce_gripper(True, st, 0.0, steps=2, min_interval=0.5)
    assert sup and not st.closed
    st, sup = debounce_gripper(False, st, 0.1, steps=2, min_interval=0.5)
    assert not sup and not st.closed
    # Two consecutive requests close it.
    st, _ = debounce_gripper(True, st, 0.2, 2, 0.5)
    st, sup = debounce_gripper(True, st, 0.3, 2, 0.5)
    assert st.closed and not sup
    # Opening again 0.2 s later is held back by the minimum interval, allowed after it.
    st, sup = debounce_gripper(False, st, 0.4, 2, 0.5)
    st, sup = debounce_gripper(False, st, 0.5, 2, 0.5)
    assert st.closed and sup
    st, sup = debounce_gripper(False, st, 0.9, 2, 0.5)
    assert not st.closed and not sup


def test_is_stale():
    assert not is_stale(10.0, 10.4, 0.5)
    assert is_stale(10.0, 10.6, 0.5)


# ------------------------------------------------------------------------------ the chain
def _adversarial_actions(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    out = []
    for i in range(n):
        scale = 10.0 ** rng.uniform(-3, 6)  # from millimetres to a million metres
        a = rng.normal(size=7) * scale
        if i % 5 == 0:
            a[:3] = np.sign(rng.normal(size=3)) * 1e9
        out.append(a)
    return out


def test_commanded_motion_stays_inside_the_limits_under_adversarial_actions():
    """Random huge deltas, rollout in closed loop through the exact kinematics: every commanded
    target stays in the box, every step within the translation/rotation/joint-speed bounds."""
    rng = np.random.default_rng(0)
    safety = SafetyFilter(CFG, DT)
    q = HOME.copy()
    max_qd = np.array(CFG.max_joint_velocity)
    for k, action in enumerate(_adversarial_actions(rng, 150)):
        st = state_at(q)
        cmd = safety(action, st, now=k * DT, scheduled_at=k * DT)
        assert not cmd.hold
        assert np.all(cmd.target_pos >= LO - 1e-9) and np.all(cmd.target_pos <= HI + 1e-9)
        assert np.linalg.norm(cmd.target_pos - st.ee_pos) <= CFG.max_translation_m + 1e-9
        rot_step = matrix_to_rotvec(cmd.target_rot @ st.ee_rot.T)
        assert np.linalg.norm(rot_step) <= CFG.max_rotation_rad + 1e-9
        dq = joint_step(q, cmd.target_pos - st.ee_pos, rot_step)
        assert np.all(np.abs(dq) <= max_qd * DT * 1.01)
        q = q + dq  # the arm reaches the commanded target exactly
    assert safety.counts["workspace"] > 0 and safety.counts["max_translation"] > 0
    assert safety.counts["max_rotation"] > 0
    # The trajectory was pushed to the walls of the box and stayed there.
    pos, _ = panda_fk(q)
    assert np.all(pos >= LO - 1e-6) and np.all(pos <= HI + 1e-6)


def test_from_outside_the_box_every_step_moves_towards_it():
    q = HOME.copy()
    st = state_at(q)
    cfg = SafetyConfig(
        workspace_min=(0.4, -0.2, 0.1), workspace_max=(0.6, 0.2, 0.3)
    )  # home x=0.307, z=0.487: outside
    safety = SafetyFilter(cfg, DT)
    lo, hi = np.array(cfg.workspace_min), np.array(cfg.workspace_max)

    def dist(p):
        return np.linalg.norm(p - np.clip(p, lo, hi))

    rng = np.random.default_rng(3)
    for k in range(40):
        st = state_at(q)
        away = np.concatenate(
            [(st.ee_pos - (lo + hi) / 2) * 100, rng.normal(size=4)]
        )  # pushes outwards
        cmd = safety(away, st, now=k * DT)
        assert dist(cmd.target_pos) <= dist(st.ee_pos) + 1e-9
        assert np.linalg.norm(cmd.delta_pos) <= cfg.max_translation_m + 1e-9
        q = q + joint_step(q, cmd.delta_pos, cmd.delta_rot)
    assert dist(panda_fk(q)[0]) < dist(panda_fk(HOME)[0])


@pytest.mark.parametrize(
    "bad",
    [
        np.array([np.nan, 0, 0, 0, 0, 0, 1]),
        np.array([0, 0, 0, 0, np.inf, 0, 1]),
        np.array([0, 0, -np.inf, 0, 0, 0, 1]),
        np.array([0.01, 0, 0, 0, 0, 0, np.nan]),
        np.zeros(3),
        np.zeros(70),
    ],
)
def test_non_finite_or_malformed_actions_hold_position(bad):
    safety = SafetyFilter(CFG, DT)
    st = state_at(HOME)
    cmd = safety(bad, st, now=0.0)
    assert cmd.hold and cmd.interventions == ["non_finite"]
    np.testing.assert_array_equal(cmd.target_pos, st.ee_pos)
    np.testing.assert_array_equal(cmd.target_rot, st.ee_rot)
    assert not np.any(cmd.delta_pos) and not cmd.gripper_closed
    assert safety.counts["non_finite"] == 1 and safety.log[0].kind == "non_finite"


def test_stale_actions_and_silence_trigger_the_watchdog():
    safety = SafetyFilter(CFG, DT)
    st = state_at(HOME)
    good = np.array([0.01, 0, 0, 0, 0, 0, -1.0])
    assert not safety(good, st, now=0.0, scheduled_at=0.0).hold
    # An action executed 0.8 s after it was due (deadline 0.5 s): hold.
    cmd = safety(good, st, now=1.0, scheduled_at=0.2)
    assert cmd.hold and cmd.interventions == ["watchdog"]
    np.testing.assert_array_equal(cmd.target_pos, st.ee_pos)
    # Waiting for the server: holding is normal within the deadline, a watchdog event past it.
    safety2 = SafetyFilter(CFG, DT)
    assert not safety2(good, st, now=10.0).hold
    cmd = safety2(None, st, now=10.3)
    assert cmd.hold and cmd.interventions == []
    cmd = safety2(None, st, now=10.6)
    assert cmd.hold and cmd.interventions == ["watchdog"]
    assert safety2.counts["watchdog"] == 1


def test_estop_holds_at_once_and_for_good():
    estop = EStop()
    stops = []
    estop.on_trigger(lambda: stops.append(1))
    safety = SafetyFilter(CFG, DT, estop)
    st = state_at(HOME)
    move = np.array([0.02, 0, 0, 0, 0, 0, 1.0])
    assert not safety(move, st, now=0.0).hold
    estop.trigger("test")
    assert stops == [1]  # the robot's stop ran inside trigger(), not at the next tick
    for k in range(5):
        cmd = safety(move, st, now=0.1 * (k + 1))
        assert cmd.hold and cmd.interventions == ["estop"]
        np.testing.assert_array_equal(cmd.target_pos, st.ee_pos)
    assert safety.counts["estop"] == 5 and estop.reason == "test"


def test_estop_from_a_signal_and_a_key():
    before = signal.getsignal(signal.SIGTERM)  # another library (e.g. Ray) may have set one
    estop = EStop()
    stops = []
    estop.on_trigger(lambda: stops.append(1))
    estop.install_signals()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert estop.triggered and estop.reason == "signal SIGTERM" and stops == [1]
    finally:
        estop.restore()
    assert signal.getsignal(signal.SIGTERM) == before

    r, w = os.pipe()
    estop2 = EStop()
    with os.fdopen(r) as reader, os.fdopen(w, "w") as writer:
        thread = estop2.watch_keys(reader)
        writer.write("hello\n")
        writer.flush()
        threading.Event().wait(0.1)
        assert not estop2.triggered
        writer.write("\n")
        writer.flush()
        thread.join(2)
    assert estop2.triggered and estop2.reason == "key pressed"


def test_interventions_are_logged_and_counted():
    safety = SafetyFilter(CFG, DT)
    st = state_at(HOME)
    safety(np.array([5.0, 0, 0, 3.0, 0, 0, 1.0]), st, now=0.0)
    kinds = [i.kind for i in safety.log]
    assert kinds[:3] == ["workspace", "max_translation", "max_rotation"]
    assert "gripper_debounce" in kinds  # one "close" request is not enough
    assert sum(safety.counts.values()) == len(safety.log)
    assert all(i.step == 1 for i in safety.log) and safety.last == safety.log


def test_config_rejects_unsafe_values():
    with pytest.raises(ValueError, match="workspace_min"):
        SafetyConfig(workspace_min=(0.8, 0, 0), workspace_max=(0.7, 1, 1))
    with pytest.raises(ValueError, match="max_translation_m"):
        SafetyConfig(max_translation_m=0.5)
    with pytest.raises(ValueError, match="max_joint_velocity"):
        SafetyConfig(max_joint_velocity=(1.0,) * 6)
    with pytest.raises(ValueError, match="watchdog_s"):
        SafetyConfig(watchdog_s=0)


def test_joint_goal_stays_within_the_joint_limits():
    """Joint 7 a hair inside its upper limit and a twist about the flange axis that needs it
    to go further: the checked joint goal never leaves the limits (a backend clipping it
    there would put the TCP elsewhere), and the opposite twist is executed in full."""
    from rlinf_vla.real_robot.kinematics import PANDA_JOINT_LOWER, PANDA_JOINT_UPPER

    q = HOME.copy()
    q[6] = PANDA_JOINT_UPPER[6] - 0.006
    _, rot = panda_fk(q)
    outcomes = []
    for sign in (1.0, -1.0):
        dr = sign * 0.09 * rot[:, 2]
        need = joint_step(q, np.zeros(3), dr)  # independent Newton IK
        safety = SafetyFilter(CFG, DT)
        cmd = safety(np.concatenate([np.zeros(3), dr, [0.0]]), state_at(q), now=0.0)
        assert np.all(cmd.joint_target <= PANDA_JOINT_UPPER) and np.all(
            cmd.joint_target >= PANDA_JOINT_LOWER
        )
        outcomes.append((q[6] + need[6] > PANDA_JOINT_UPPER[6], cmd))
    (past_a, cmd_a), (past_b, cmd_b) = outcomes
    assert past_a != past_b  # one direction needs joint 7 past its limit
    blocked, free = (cmd_a, cmd_b) if past_a else (cmd_b, cmd_a)
    assert (
        np.linalg.norm(blocked.delta_rot) < 0.09 * 0.2 and "joint_velocity" in blocked.interventions
    )
    assert np.linalg.norm(free.delta_rot) > 0.05  # about 0.09 rad, executed
