"""The real-Franka adapter, as far as it can be checked without the arm: config validation and
the franky / pyrealsense2 API names it calls (constructed offline, nothing connects)."""

from __future__ import annotations

import numpy as np
import pytest

from rlinf_vla.real_robot.franka import FrankaConfig
from rlinf_vla.real_robot.kinematics import (
    matrix_to_quat_xyzw,
    quat_xyzw_to_matrix,
    rotvec_to_matrix,
)


def test_config_validation():
    cfg = FrankaConfig(cameras={"main": 123456789012, "wrist": "2345"})
    assert cfg.cameras == {"main": "123456789012", "wrist": "2345"}
    with pytest.raises(ValueError, match="serial number"):
        FrankaConfig()
    with pytest.raises(ValueError, match="relative_dynamics_factor"):
        FrankaConfig(cameras={"main": "1"}, relative_dynamics_factor=2.0)


def test_franky_api_used_by_the_adapter():
    franky = pytest.importorskip("franky")
    rot = rotvec_to_matrix([0.3, -0.2, 0.1])
    target = franky.Affine(np.array([0.4, 0.0, 0.4]), matrix_to_quat_xyzw(rot))
    np.testing.assert_allclose(quat_xyzw_to_matrix(np.asarray(target.quaternion)), rot, atol=1e-9)
    np.testing.assert_allclose(target.translation, [0.4, 0.0, 0.4])
    franky.CartesianMotion(target, franky.ReferenceType.Absolute)
    franky.JointMotion([0.0, -0.785, 0.0, -2.356, 0.0, 1.571, 0.785])
    for name in (
        "stop",
        "move",
        "recover_from_errors",
        "set_collision_behavior",
        "current_cartesian_state",
        "current_joint_state",
        "relative_dynamics_factor",
    ):
        assert hasattr(franky.Robot, name), name
    for name in ("grasp_async", "move_async", "move", "width"):
        assert hasattr(franky.Gripper, name), name


def test_realsense_api_used_by_the_adapter():
    try:
        import pyrealsense2 as rs
    except ImportError as e:  # the wheel needs the system's libusb-1.0 (apt install libusb-1.0-0)
        pytest.skip(f"pyrealsense2 not importable here: {e}")
    cfg = rs.config()
    assert callable(cfg.enable_device) and callable(cfg.enable_stream)
    assert rs.stream.color is not None and rs.format.rgb8 is not None
