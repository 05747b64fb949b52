"""Deploy recordings (:mod:`rlinf_vla.real_robot.recording`) -> one LeRobotDataset v3.0.

Each recorded episode folder becomes one episode: every recorded camera as
``observation.images.<camera>``, the proprio the policy saw as ``observation.state``, the action
actually executed from it (after the safety layer, in the policy's units) as ``action``, and the
instruction as the task. Episodes with no steps are skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rlinf_vla.data.lerobot import LeRobotWriter

__all__ = ["export_recordings"]

log = logging.getLogger(__name__)

# The deploy loop's conventions (rlinf_vla.real_robot.robot): proprio float32 [8] and the
# executed action float32 [7].
_STATE_NAMES = ["tcp_x", "tcp_y", "tcp_z", "tcp_rx", "tcp_ry", "tcp_rz", "finger_1", "finger_2"]
_ACTION_NAMES = ["dx", "dy", "dz", "drx", "dry", "drz", "gripper"]


def export_recordings(
    folders: Sequence[str | Path],
    output: str | Path,
    fps: int | None = None,
    *,
    robot_type: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert recorded deploy episodes into one LeRobotDataset v3.0 folder.

    Args:
        folders: episode folders written by :class:`~rlinf_vla.real_robot.recording.EpisodeWriter`,
            in the order their episodes get.
        output: the dataset folder to create.
        fps: the dataset's frame rate; default the recordings' control rate (which must then be
            the same whole number for all of them).
        robot_type: for ``info.json``; default the recorded robot config's ``name``.
        overwrite: replace an existing dataset at ``output``.

    Returns:
        ``output``.

    Raises:
        ValueError: no folder, recordings that disagree (cameras, image sizes, state or action
            size, frame rate), a camera whose frame count differs from the steps, or no steps.
    """
    from rlinf_vla.real_robot.recording import read_episode

    folders = [Path(f) for f in folders]
    if not folders:
        raise ValueError("no recording folder given")
    # Check every recording's metadata before writing anything.
    metas = [read_episode(f, load_images=False) for f in folders]
    rates = {float(m.meta.get("fps", 0)) for m in metas}
    if fps is None:
        if len(rates) != 1 or not next(iter(rates)).is_integer() or next(iter(rates)) <= 0:
            raise ValueError(
                f"the recordings' frame rates {sorted(rates)} are not one whole number: pass fps"
            )
        fps = int(next(iter(rates)))
    cameras = {tuple(m.meta["cameras"]) for m in metas}
    if len(cameras) != 1:
        raise ValueError(f"the recordings have different cameras: {sorted(cameras)}")
    dims = {(m.steps["state"].shape[1:], m.steps["action"].shape[1:]) for m in metas if len(m)}
    if len(dims) > 1:
        raise ValueError(f"the recordings have different state/action sizes: {sorted(dims)}")
    if not dims:
        raise ValueError(f"the recordings {[str(f) for f in folders]} have no steps")
    (state_shape, action_shape) = dims.pop()
    state_dim, action_dim = int(state_shape[0]), int(action_shape[0])
    if robot_type is None:
        robot = metas[0].meta.get("robot")
        robot_type = robot.get("name") if isinstance(robot, dict) else robot

    writer: LeRobotWriter | None = None
    try:
        for folder, m in zip(folders, metas, strict=True):
            if len(m) == 0:
                log.warning("%s: no steps, skipped", folder)
                continue
            episode = read_episode(folder)
            images = episode.images
            for cam, frames in images.items():
                if len(frames) != len(episode):
                    raise ValueError(
                        f"{folder}: camera {cam!r} has {len(frames)} frames for {len(episode)} steps"
                    )
            if writer is None:
                writer = LeRobotWriter(
                    output,
                    fps=fps,
                    cameras={c: tuple(images[c].shape[1:3]) for c in episode.meta["cameras"]},
                    state_dim=state_dim,
                    action_dim=action_dim,
                    robot_type=robot_type,
                    state_names=_STATE_NAMES if state_dim == len(_STATE_NAMES) else None,
                    action_names=_ACTION_NAMES if action_dim == len(_ACTION_NAMES) else None,
                    overwrite=overwrite,
                )
            task = str(episode.meta.get("instruction") or "")
            if not task:
                raise ValueError(f"{folder}: meta.json has no instruction")
            writer.add_episode(
                {c: np.asarray(f, dtype=np.uint8) for c, f in images.items()},
                episode.steps["state"],
                episode.steps["action"],
                task,
            )
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    assert writer is not None  # at least one recording has steps (checked above)
    return writer.close()
