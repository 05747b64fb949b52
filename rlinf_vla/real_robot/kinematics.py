"""Rotations and the Franka Panda / FR3 kinematics in plain numpy.

The arm's kinematics use Franka's published modified Denavit-Hartenberg parameters (Craig's
convention: ``T_i = RotX(alpha_{i-1}) TransX(a_{i-1}) RotZ(q_i) TransZ(d_i)``), then the flange
(``d = 0.107``) and the Franka Hand's tool centre point (``0.1034`` m further along z, rotated by
-45 degrees about z). The safety layer uses the geometric Jacobian to bound joint velocities
without asking the robot backend for anything but joint positions.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "PANDA_JOINT_LOWER",
    "PANDA_JOINT_UPPER",
    "PANDA_MAX_JOINT_VELOCITY",
    "matrix_to_quat_xyzw",
    "matrix_to_rotvec",
    "panda_fk",
    "panda_jacobian",
    "quat_xyzw_to_matrix",
    "rotvec_to_matrix",
]

# (a_{i-1}, d_i, alpha_{i-1}) for joints 1..7, then the flange.
_DH = np.array(
    [
        [0.0, 0.333, 0.0],
        [0.0, 0.0, -np.pi / 2],
        [0.0, 0.316, np.pi / 2],
        [0.0825, 0.0, np.pi / 2],
        [-0.0825, 0.384, -np.pi / 2],
        [0.0, 0.0, np.pi / 2],
        [0.088, 0.0, np.pi / 2],
    ]
)
FLANGE_D = 0.107
HAND_TCP = 0.1034

PANDA_JOINT_LOWER = np.array([-2.8973, -1.7628, -2.8973, -3.0718, -2.8973, -0.0175, -2.8973])
PANDA_JOINT_UPPER = np.array([2.8973, 1.7628, 2.8973, -0.0698, 2.8973, 3.7525, 2.8973])
#: Franka's datasheet joint velocity limits (rad/s).
PANDA_MAX_JOINT_VELOCITY = np.array([2.175, 2.175, 2.175, 2.175, 2.61, 2.61, 2.61])


def rotvec_to_matrix(r: np.ndarray) -> np.ndarray:
    """Axis-angle ``[3]`` (angle = norm, radians) -> rotation matrix ``[3, 3]`` (Rodrigues)."""
    r = np.asarray(r, dtype=np.float64)
    theta = float(np.linalg.norm(r))
    if theta < 1e-12:
        return np.eye(3)
    k = r / theta
    kx = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])
    return np.eye(3) + np.sin(theta) * kx + (1 - np.cos(theta)) * kx @ kx


def matrix_to_rotvec(m: np.ndarray) -> np.ndarray:
    """Rotation matrix ``[3, 3]`` -> axis-angle ``[3]`` with angle in ``[0, pi]``."""
    m = np.asarray(m, dtype=np.float64)
    cos = np.clip((np.trace(m) - 1.0) / 2.0, -1.0, 1.0)
    theta = float(np.arccos(cos))
    if theta < 1e-9:
        return np.zeros(3)
    if np.pi - theta < 1e-4:  # near pi the antisymmetric part vanishes: use the diagonal
        axis = np.sqrt(np.clip((np.diag(m) + 1.0) / 2.0, 0.0, None))
        i = int(np.argmax(axis))
        axis[(i + 1) % 3] *= np.sign(m[i, (i + 1) % 3] + m[(i + 1) % 3, i]) or 1.0
        axis[(i + 2) % 3] *= np.sign(m[i, (i + 2) % 3] + m[(i + 2) % 3, i]) or 1.0
        return axis / np.linalg.norm(axis) * theta
    w = np.array([m[2, 1] - m[1, 2], m[0, 2] - m[2, 0], m[1, 0] - m[0, 1]])
    return w / (2.0 * np.sin(theta)) * theta


def _link(a: float, d: float, alpha: float, q: float) -> np.ndarray:
    ca, sa, cq, sq = np.cos(alpha), np.sin(alpha), np.cos(q), np.sin(q)
    return np.array(
        [
            [cq, -sq, 0.0, a],
            [sq * ca, cq * ca, -sa, -d * sa],
            [sq * sa, cq * sa, ca, d * ca],
            [0.0, 0.0, 0.0, 1.0],
        ]
    )


def _frames(q: np.ndarray, tcp: float) -> tuple[list[np.ndarray], np.ndarray]:
    q = np.asarray(q, dtype=np.float64)
    if q.shape != (7,):
        raise ValueError(f"joint positions must have shape [7], got {list(q.shape)}")
    t = np.eye(4)
    joints = []
    for (a, d, alpha), qi in zip(_DH, q, strict=True):
        t = t @ _link(a, d, alpha, qi)
        joints.append(t.copy())
    t = t @ _link(0.0, FLANGE_D, 0.0, 0.0)
    hand = _link(0.0, tcp, 0.0, -np.pi / 4)
    return joints, t @ hand


def panda_fk(q: np.ndarray, tcp: float = HAND_TCP) -> tuple[np.ndarray, np.ndarray]:
    """Tool-centre-point pose in the base frame: position ``[3]`` (m), rotation ``[3, 3]``.

    Args:
        q: joint positions ``[7]`` (rad).
        tcp: distance of the tool centre point from the flange along its z axis (m).
    """
    _, ee = _frames(q, tcp)
    return ee[:3, 3].copy(), ee[:3, :3].copy()


def panda_jacobian(q: np.ndarray, tcp: float = HAND_TCP) -> np.ndarray:
    """Geometric Jacobian ``[6, 7]`` of the tool centre point: rows ``(v_x, v_y, v_z, w_x, w_y,
    w_z)`` in the base frame, so ``twist = J @ qdot``."""
    joints, ee = _frames(q, tcp)
    p = ee[:3, 3]
    jac = np.zeros((6, 7))
    for i, t in enumerate(joints):
        z, o = t[:3, 2], t[:3, 3]
        jac[:3, i] = np.cross(z, p - o)
        jac[3:, i] = z
    return jac


def matrix_to_quat_xyzw(m: np.ndarray) -> np.ndarray:
    """Rotation matrix ``[3, 3]`` -> unit quaternion ``[x, y, z, w]`` (``w >= 0``)."""
    r = matrix_to_rotvec(m)
    theta = float(np.linalg.norm(r))
    if theta < 1e-12:
        return np.array([0.0, 0.0, 0.0, 1.0])
    axis = r / theta
    return np.concatenate([axis * np.sin(theta / 2.0), [np.cos(theta / 2.0)]])


def quat_xyzw_to_matrix(q: np.ndarray) -> np.ndarray:
    """Quaternion ``[x, y, z, w]`` (any norm > 0) -> rotation matrix ``[3, 3]``."""
    x, y, z, w = np.asarray(q, dtype=np.float64) / np.linalg.norm(q)
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
            [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
            [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
        ]
    )
