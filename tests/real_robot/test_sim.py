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


def test_safety_bounds_the_simulated_arm_under_adversarial_actions(sim):
    """Huge random deltas through the filter into the physics: the measured TCP stays inside
    the box (tracking tolerance 5 mm) and joints move no faster than the bound allows."""
    cfg = SafetyConfig(workspace_min=(0.3, -0.15, 0.25), workspace_max=(0.5, 0.15, 0.5))
    dt = 1.0 / sim.cfg.control_rate_hz
    safety = SafetyFilter(cfg, dt)
    rng = np.random.default_rng(0)
    st = sim.reset()
    lo, hi = np.array(cfg.workspace_min) - 0.005, np.array(cfg.workspace_max) + 0.005
    for k in range(30):
        action = rng.normal(size=7) * 10.0 ** rng.uniform(0, 4)
        cmd = safety(action, st, now=k * dt)
        q_before = st.joint_positions
        sim.command(cmd.target_pos, cmd.target_rot, cmd.gripper_closed)
        st = sim.read()
        assert np.all(st.ee_pos >= lo) and np.all(st.ee_pos <= hi), st.ee_pos
        speed = np.abs(st.joint_positions - q_before) / dt
        assert np.all(speed <= np.array(cfg.max_joint_velocity) * 1.3 + 0.02), speed
        assert np.all(speed <= PANDA_MAX_JOINT_VELOCITY)
    assert safety.counts["workspace"] > 0
