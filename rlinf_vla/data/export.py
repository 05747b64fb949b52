"""Deploy recordings (:mod:`rlinf_vla.real_robot.recording`) -> one LeRobotDataset v3.0.

Each recorded episode folder becomes one episode: every recorded camera as
``observation.images.<camera>``, the proprio the policy saw as ``observation.state``, the action
actually executed from it (after the safety layer, in the policy's units) as ``action``, and the
instruction as the task. Episodes with no steps are skipped, and so is a recording that cannot
be read (a truncated ``steps.npz``, a malformed ``meta.json``, a video that does not decode):
its reason goes to ``on_skip`` and the others are exported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
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
    on_skip: Callable[[Path, str], None] | None = None,
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
        on_skip: called with each recording left out and why (default: a logged warning).

    Returns:
        ``output``.

    Raises:
        ValueError: no folder, recordings that disagree (cameras, image sizes, state or action
            size, frame rate), no steps, or none that could be read.
    """
    from rlinf_vla.real_robot.recording import RecordingError, read_episode

    skip = on_skip or (lambda folder, reason: log.warning("%s skipped: %s", folder, reason))
    folders = [Path(f) for f in folders]
    if not folders:
        raise ValueError("no recording folder given")
    # Check every recording's metadata before writing anything; one that cannot be read is
    # skipped with its reason.
    readable = []
    reasons = []
    for folder in folders:
        try:
            readable.append((folder, read_episode(folder, load_images=False)))
        except RecordingError as e:
            skip(folder, str(e))
            reasons.append(str(e))
    if not readable:
        raise ValueError("no recording could be read: " + "; ".join(reasons))
    metas = [m for _, m in readable]
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
        exported = 0
        for folder, m in readable:
            if len(m) == 0:
                skip(folder, "no steps")
                continue
            try:
                episode = read_episode(folder)
            except RecordingError as e:  # its images do not decode
                skip(folder, str(e))
                continue
            images = episode.images
            short = {c: len(f) for c, f in images.items() if len(f) != len(episode)}
            if short:
                skip(folder, f"camera frames {short} for {len(episode)} steps")
                continue
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
                skip(folder, "meta.json has no instruction (the dataset's task)")
                continue
            writer.add_episode(
                {c: np.asarray(f, dtype=np.uint8) for c, f in images.items()},
                episode.steps["state"],
                episode.steps["action"],
                task,
            )
            exported += 1
        if not exported:
            raise ValueError("no recording could be exported (each was skipped, see above)")
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    assert writer is not None
    return writer.close()
