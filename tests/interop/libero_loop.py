"""The episode loop of openpi's LIBERO example client (``examples/libero/main.py`` in
Physical-Intelligence/openpi), written out for the interop tests; it runs in .venv-openpi with
openpi-client and in the main env with the native client, so both drive the same episodes.

Per episode, as openpi's example does: reset to an official init state, step
:data:`SETTLE_STEPS` no-op actions (gripper open) while the objects fall into place, then
until :data:`MAX_STEPS` of the suite (or ``max_steps``) policy steps have run: when the plan is
empty, send one observation (both cameras turned by 180 degrees and resized with padding,
the 8-d state, the prompt), keep the first ``replan_steps`` actions of the chunk, and execute
one action per step; ``done`` from LIBERO ends the episode as a success. Unlike the example,
an exception is not logged and swallowed: it fails the run.

Only numpy and the standard library are imported here: the client-specific parts (image
resizing, the policy call) are passed in.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import numpy as np

#: openpi's example: the no-op of the settle steps, the cameras' side, the resize, the replan
#: interval, the number of settle steps and the env seed.
DUMMY_ACTION = [0.0] * 6 + [-1.0]
RESOLUTION = 256
RESIZE = 224
REPLAN_STEPS = 5
SETTLE_STEPS = 10
SEED = 7
#: Policy steps per episode by suite (a bit above each suite's longest demonstration).
MAX_STEPS = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}

#: ``(image [H, W, 3], size) -> uint8 [size, size, 3]``: resize keeping the aspect, pad.
Resize = Callable[[np.ndarray, int], np.ndarray]
#: ``(image, wrist_image, state, prompt) -> actions [K, 7]``: one policy query.
Infer = Callable[[np.ndarray, np.ndarray, np.ndarray, str], np.ndarray]


def quat_to_axis_angle(quat: np.ndarray) -> np.ndarray:
    """Axis-angle (3) of a unit quaternion in robosuite's xyzw order."""
    w = min(max(float(quat[3]), -1.0), 1.0)
    den = math.sqrt(1.0 - w * w)
    if den == 0.0:  # no rotation
        return np.zeros(3)
    return np.asarray(quat[:3], dtype=np.float64) * 2.0 * math.acos(w) / den


def upright(image: np.ndarray) -> np.ndarray:
    """LIBERO renders its cameras upside down: turn by 180 degrees."""
    return np.ascontiguousarray(image[::-1, ::-1])


def run_episode(
    sim: Any,
    init_state: int,
    prompt: str,
    resize: Resize,
    infer: Infer,
    max_steps: int,
    replan_steps: int = REPLAN_STEPS,
    settle_steps: int = SETTLE_STEPS,
    size: int = RESIZE,
) -> dict[str, Any]:
    """One episode on ``sim`` (a :class:`~tests.interop.libero_sim.LiberoSim`).

    Returns ``success`` (LIBERO's ``done`` after the last executed action), ``steps`` (policy
    steps executed), and for checks: per query the ``images``, ``wrist_images``, ``states``
    sent and the ``chunks`` received; per executed step the ``actions`` and MuJoCo's
    ``sim_states`` after it.
    """
    obs = sim.reset(init_state)
    plan: collections.deque = collections.deque()
    sent: dict[str, list] = {"images": [], "wrist_images": [], "states": [], "chunks": []}
    executed: dict[str, list] = {"actions": [], "sim_states": []}
    done = False
    t = 0
    while t < max_steps + settle_steps:
        if t < settle_steps:
            obs, _, done, _ = sim.step(DUMMY_ACTION)
            t += 1
            continue
        if not plan:
            img = resize(upright(obs["agentview_image"]), size)
            wrist = resize(upright(obs["robot0_eye_in_hand_image"]), size)
            state = np.concatenate(
                (
                    obs["robot0_eef_pos"],
                    quat_to_axis_angle(obs["robot0_eef_quat"]),
                    obs["robot0_gripper_qpos"],
                )
            )
            chunk = np.asarray(infer(img, wrist, state, prompt))
            if len(chunk) < replan_steps:
                raise ValueError(
                    f"replanning every {replan_steps} steps needs chunks of at least that "
                    f"many actions; the policy returned {len(chunk)}"
                )
            plan.extend(chunk[:replan_steps])
            for key, value in zip(sent, (img, wrist, state, chunk), strict=True):
                sent[key].append(value)
        action = plan.popleft()
        obs, _, done, sim_state = sim.step(action.tolist())
        executed["actions"].append(np.asarray(action.tolist()))
        executed["sim_states"].append(np.asarray(sim_state))
        if done:
            break
        t += 1
    record = {k: np.stack(v) for k, v in {**sent, **executed}.items()}
    return {"success": bool(done), "steps": len(executed["actions"]), **record}
