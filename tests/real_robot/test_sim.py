"""The simulated Franka: kinematics agree with Franka's published model, end-effector delta
control tracks, cameras render, and the safety layer bounds the motion in closed loop."""

from __future__ import annotations

import numpy as np
import pytest

from rlinf_vla.real_robot.kinematics import (
    PANDA_MAX_JOINT_VELOCITY,
    matrix_to_rotvec,
    panda_fk,
    rotvec_to_matrix,
)
from rlinf_vla.real_robot.safety import SafetyConfig, SafetyFilter

pytestmark = pytest.mark.sim


@pytest.fixture(scope="module")
def sim():
    from rlinf_vla.real_robot.sim import SimFranka, SimFrankaConfig

    robot = SimFranka(SimFrankaConfig(image_size=48))
    yield robot
    robot.close()


def test_mujoco_model_matches_the_dh_kinematics(sim):
    """The MJCF arm and our numpy FK (Franka's DH table) agree within a millimetre."""
    sim.reset()
    rng = np.random.default_rng(0)
    for _ in range(5):
        q = np.array(sim.cfg.home) + rng.uniform(-0.4, 0.4, 7)
        sim.data.qpos[sim._qadr] = q
        sim._mj.mj_kinematics(sim.model, sim.data)
        pos, rot = panda_fk(q)
        np.testing.assert_allclose(sim.data.site_xpos[sim._tcp], pos, atol=1e-3)
        assert (
            np.linalg.norm(matrix_to_rotvec(sim.data.site_xmat[sim._tcp].reshape(3, 3) @ rot.T))
            < 2e-3
        )


def test_reset_state_and_cameras(sim):
    st = sim.reset()
    np.testing.assert_allclose(st.joint_positions, sim.cfg.home, atol=2e-3)  # holds against gravity
    np.testing.assert_allclose(st.ee_pos, [0.307, 0.0, 0.487], atol=3e-3)
    assert st.gripper_width == pytest.approx(0.08, abs=2e-3)
    assert set(st.images) == {"main", "wrist"}
    for img in st.images.values():
        assert img.shape == (48, 48, 3) and img.dtype == np.uint8 and img.std() > 5  # not blank
    assert st.proprio().shape == (8,) and st.proprio().dtype == np.float32


def test_end_effector_delta_control_tracks(sim):
    st = sim.reset()
    start = st.ee_pos.copy()
    for _ in range(10):
        st = sim.read()
        sim.command(
            st.ee_pos + np.array([0.01, -0.005, -0.01]),
            rotvec_to_matrix([0, 0, 0.03]) @ st.ee_rot,
            True,
        )
    st = sim.read()
    np.testing.assert_allclose(st.ee_pos - start, [0.1, -0.05, -0.1], atol=0.01)
    assert st.gripper_width < 0.01  # closed on nothing


def _streams(rng: np.random.Generator, n: int) -> dict[str, list[np.ndarray]]:
    """Adversarial action streams (policy output already in metres / radians)."""
    big = [rng.normal(size=7) * 10.0 ** rng.uniform(0, 9) for _ in range(n)]
    alternating = [
        np.concatenate([np.array([0.3, 1.0, -0.6, 2.0, -1.0, 3.0]) * (-1) ** k, [(-1) ** k]])
        for k in range(n)
    ]
    # Out of the box through each face in turn, with random rotations on top.
    faces = [np.eye(3)[i] * sign for i in range(3) for sign in (1.0, -1.0)]
    outward = [
        np.concatenate([faces[(k // 10) % 6] * 5.0, rng.normal(size=3), [1.0]]) for k in range(n)
    ]
    # Towards singularities: reach far forward and up (elbow and shoulder stretch) while
    # twisting the wrist about the flange axis (wrist alignment).
    singular = [
        np.array([1.0, 0.2 * np.sin(k / 3.0), 1.0, 0.0, 0.0, 3.0 * (-1) ** (k // 5), -1.0])
        for k in range(n)
    ]
    # Sustained rotation with a drift: drives the wrist joints into their limits, where a
    # clipped joint goal would leave the TCP elsewhere than the checked target.
    rotating = [
        np.array([0.0, -0.3, -0.2, 0.5, 0.5, 3.0, 0.0]) * np.array([1, 1, 1, 1, 1, 1, 0])
        for _ in range(n)
    ]
    return {
        "max": big,
        "alternating": alternating,
        "outward": outward,
        "singular": singular,
        "rotating": rotating,
    }


@pytest.mark.parametrize("rate", [10.0, 20.0])
def test_measured_motion_respects_the_bounds_under_adversarial_actions(rate):
    """Property test of the simulated Panda behind the safety layer: under seeded adversarial
    streams, every tick the *measured* TCP step is within the translation and rotation bounds,
    the measured TCP stays in the box, and the executed joint step (and the measured one) is
    within the joint speed bound; checked with numpy on the robot's own readings."""
    from rlinf_vla.real_robot.sim import SimFranka, SimFrankaConfig

    robot = SimFranka(SimFrankaConfig(image_size=16, cameras=("main",), control_rate_hz=rate))
    try:
        dt = 1.0 / rate
        boxes = [
            SafetyConfig(),
            SafetyConfig(workspace_min=(0.3, -0.12, 0.3), workspace_max=(0.45, 0.12, 0.5)),
        ]
        for seed, cfg in enumerate(boxes):
            lo, hi = np.array(cfg.workspace_min), np.array(cfg.workspace_max)
            max_qd = np.array(cfg.max_joint_velocity)
            for name, stream in _streams(np.random.default_rng(seed), 50).items():
                safety = SafetyFilter(cfg, dt)
                st = robot.reset()
                # The home TCP is inside both boxes (the property is about staying in).
                assert np.all(st.ee_pos >= lo) and np.all(st.ee_pos <= hi)
                for k, action in enumerate(stream):
                    cmd = safety(action, st, now=k * dt)
                    executed = cmd.joint_target - st.joint_positions
                    assert np.all(np.abs(executed) <= max_qd * dt + 1e-12), (name, k)
                    before = st
                    robot.command(
                        cmd.target_pos, cmd.target_rot, cmd.gripper_closed, cmd.joint_target
                    )
                    st = robot.read()
                    where = (rate, seed, name, k)
                    step = np.linalg.norm(st.ee_pos - before.ee_pos)
                    assert step <= cfg.max_translation_m, (where, step)
                    turn = np.linalg.norm(matrix_to_rotvec(st.ee_rot @ before.ee_rot.T))
                    assert turn <= cfg.max_rotation_rad, (where, turn)
                    assert np.all(st.ee_pos >= lo) and np.all(st.ee_pos <= hi), (where, st.ee_pos)
                    moved = np.abs(st.joint_positions - before.joint_positions)
                    assert np.all(moved <= max_qd * dt), (where, moved / (max_qd * dt))
                    assert np.all(moved / dt <= PANDA_MAX_JOINT_VELOCITY)
                if name == "outward":
                    assert safety.counts["workspace"] > 0
    finally:
        robot.close()
