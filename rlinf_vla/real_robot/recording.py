"""Episode recording for supervised fine-tuning: one folder per episode, read back with
:func:`read_episode`.

Layout (format version 1)::

    <output_dir>/<YYYYmmdd-HHMMSS>-<robot>-ep<NNN>/
      meta.json           format, instruction, robot, control rate, policy metadata, safety
                          config, intervention counts, number of steps, camera names, video codec
      steps.npz           one row per control tick t = 0..T-1:
                            timestamp       float64 [T]     s since the episode start (monotonic)
                            state           float32 [T, 8]  proprio sent to the policy (robot.py)
                            joint_positions float32 [T, 7]  rad
                            ee_pos          float32 [T, 3]  measured TCP position (m)
                            ee_rotvec       float32 [T, 3]  measured TCP orientation (axis-angle)
                            gripper_width   float32 [T]     m
                            policy_action   float32 [T, A]  raw policy output for this tick
                                                            (NaN rows: no action, hold)
                            action          float32 [T, 7]  what was executed, in the policy's
                                                            convention and units: (dp, dr)
                                                            divided by action.*_scale, gripper
                                                            +1 closed / -1 open
                            hold            bool    [T]     the safety layer held position
                            interventions   uint16  [T]     bit i set = INTERVENTIONS[i] fired
      interventions.jsonl one JSON object per intervention: step, time, kind, detail
      <camera>.mp4        frame t of every camera is the image the policy saw at tick t
                          (``video: mp4``, H.264 quality 9) or
      <camera>/NNNNNN.png (``video: png``, lossless)

``action`` and ``state`` are what a behaviour-cloning dataset needs: the observation at tick t
(frames + ``state[t]``) and the action actually executed from it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlinf_vla.real_robot.safety import INTERVENTIONS, Intervention

__all__ = ["FORMAT_VERSION", "Episode", "EpisodeWriter", "RecordingError", "read_episode"]

FORMAT_VERSION = 1
_STEP_KEYS = {
    "timestamp": np.float64,
    "state": np.float32,
    "joint_positions": np.float32,
    "ee_pos": np.float32,
    "ee_rotvec": np.float32,
    "gripper_width": np.float32,
    "policy_action": np.float32,
    "action": np.float32,
    "hold": np.bool_,
    "interventions": np.uint16,
}


def intervention_bits(kinds: list[str]) -> int:
    """Bitmask of intervention kinds (bit ``i`` = ``INTERVENTIONS[i]``)."""
    return sum(1 << INTERVENTIONS.index(k) for k in set(kinds))


class EpisodeWriter:
    """Write one episode incrementally (frames stream into the video encoder).

    Args:
        folder: the episode folder (created).
        cameras: camera names to record.
        video: ``mp4`` (small, lossy) or ``png`` (lossless, large).
        fps: the control rate (frame rate of the videos).
        meta: extra fields for ``meta.json``.
    """

    def __init__(
        self,
        folder: str | Path,
        cameras: list[str],
        video: str = "mp4",
        fps: float = 10.0,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if video not in ("mp4", "png"):
            raise ValueError(f"video must be 'mp4' or 'png', got {video!r}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=False)
        self.cameras, self.video, self.fps = list(cameras), video, fps
        self.meta = dict(meta or {})
        self._rows: dict[str, list[Any]] = {k: [] for k in _STEP_KEYS}
        self._writers: dict[str, Any] = {}
        self._interventions = open(self.folder / "interventions.jsonl", "w")  # noqa: SIM115
        self._t0 = time.monotonic()

    def _frame(self, camera: str, image: np.ndarray, t: int) -> None:
        import imageio.v2 as imageio

        if self.video == "png":
            (self.folder / camera).mkdir(exist_ok=True)
            imageio.imwrite(self.folder / camera / f"{t:06d}.png", image)
            return
        if camera not in self._writers:
            self._writers[camera] = imageio.get_writer(
                self.folder / f"{camera}.mp4",
                fps=self.fps,
                codec="libx264",
                quality=9,
                macro_block_size=1,
            )
        self._writers[camera].append_data(image)

    def add(
        self,
        *,
        timestamp: float,
        images: dict[str, np.ndarray],
        state: np.ndarray,
        joint_positions: np.ndarray,
        ee_pos: np.ndarray,
        ee_rotvec: np.ndarray,
        gripper_width: float,
        policy_action: np.ndarray,
        action: np.ndarray,
        hold: bool,
        interventions: list[Intervention],
    ) -> None:
        """Append tick ``t`` (the observation and what was executed from it)."""
        t = len(self._rows["timestamp"])
        for cam in self.cameras:
            self._frame(cam, images[cam], t)
        values = {
            "timestamp": timestamp - self._t0,
            "state": state,
            "joint_positions": joint_positions,
            "ee_pos": ee_pos,
            "ee_rotvec": ee_rotvec,
            "gripper_width": gripper_width,
            "policy_action": policy_action,
            "action": action,
            "hold": hold,
            "interventions": intervention_bits([i.kind for i in interventions]),
        }
        for k, v in values.items():
            self._rows[k].append(np.asarray(v, dtype=_STEP_KEYS[k]))
        for i in interventions:
            row = asdict(i)
            row["time"] = i.time - self._t0
            self._interventions.write(json.dumps(row) + "\n")

    def close(self, **meta: Any) -> Path:
        """Finish the videos, write ``steps.npz`` and ``meta.json``; returns the folder."""
        for w in self._writers.values():
            w.close()
        self._interventions.close()
        arrays = {
            k: np.stack(v) if v else np.zeros((0,), _STEP_KEYS[k]) for k, v in self._rows.items()
        }
        np.savez(self.folder / "steps.npz", **arrays)
        info = {
            "format_version": FORMAT_VERSION,
            "num_steps": len(self._rows["timestamp"]),
            "cameras": self.cameras,
            "video": self.video,
            "fps": self.fps,
            "intervention_kinds": list(INTERVENTIONS),
            **self.meta,
            **meta,
        }
        (self.folder / "meta.json").write_text(json.dumps(info, indent=2, default=_jsonable))
        return self.folder


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.ndarray | np.generic):
        return x.tolist()
    if isinstance(x, tuple | set):
        return list(x)
    return str(x)


@dataclass
class Episode:
    """An episode read back from disk.

    Attributes:
        meta: ``meta.json``.
        steps: the arrays of ``steps.npz`` (see the module docstring), each with ``T`` rows.
        images: camera -> ``uint8 [T, H, W, 3]``.
        interventions: the rows of ``interventions.jsonl``.
    """

    meta: dict[str, Any]
    steps: dict[str, np.ndarray]
    images: dict[str, np.ndarray]
    interventions: list[dict[str, Any]]

    def __len__(self) -> int:
        return int(self.meta["num_steps"])


class RecordingError(ValueError):
    """A recorded episode folder that cannot be read; the message names the folder and what is
    wrong with it."""


#: The arrays every recorded episode's ``steps.npz`` holds.
REQUIRED_STEPS = ("timestamp", "state", "action")


def read_episode(folder: str | Path, load_images: bool = True) -> Episode:
    """Read an episode folder written by :class:`EpisodeWriter`.

    Raises:
        RecordingError: a missing, truncated or malformed file (``meta.json``, ``steps.npz``,
            a camera's video or frames, ``interventions.jsonl``), naming the folder and file.
    """
    folder = Path(folder)
    try:
        return _read_episode(folder, load_images)
    except RecordingError:
        raise
    except Exception as e:  # whatever a damaged file raises (zipfile, numpy, json, ffmpeg)
        raise RecordingError(f"{folder}: {type(e).__name__}: {e}") from None


def _read_episode(folder: Path, load_images: bool) -> Episode:
    import imageio.v2 as imageio

    def bad(what: str) -> RecordingError:
        return RecordingError(f"{folder}: {what}")

    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise bad(f"meta.json cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict):
        raise bad(f"meta.json holds a {type(meta).__name__}, not a map")
    if meta.get("format_version") != FORMAT_VERSION:
        raise bad(f"format version {meta.get('format_version')} (this reader: {FORMAT_VERSION})")
    cameras = meta.get("cameras")
    if not isinstance(cameras, list) or not all(isinstance(c, str) and c for c in cameras):
        raise bad(f"meta.json's cameras must be a list of camera names, got {cameras!r}")
    if meta.get("video") not in ("mp4", "png"):
        raise bad(f"meta.json's video must be mp4 or png, got {meta.get('video')!r}")
    try:
        with np.load(folder / "steps.npz") as f:
            steps = {k: f[k] for k in f.files}
    except Exception as e:
        raise bad(
            f"steps.npz cannot be read, truncated or damaged ({type(e).__name__}: {e})"
        ) from None
    missing = [k for k in REQUIRED_STEPS if k not in steps]
    if missing:
        raise bad(f"steps.npz lacks {missing} (it has {sorted(steps)})")
    n = int(meta.get("num_steps", -1))
    lengths = {k: len(v) for k, v in steps.items() if v.ndim}
    if any(length != n for length in lengths.values()):
        raise bad(f"meta.json says {n} steps, steps.npz has {lengths}")
    images: dict[str, np.ndarray] = {}
    if load_images:
        for cam in cameras:
            try:
                if meta["video"] == "png":
                    files = sorted((folder / cam).glob("*.png"))
                    images[cam] = (
                        np.stack([imageio.imread(p) for p in files])
                        if files
                        else np.zeros((0,), np.uint8)
                    )
                else:
                    with imageio.get_reader(folder / f"{cam}.mp4") as r:
                        images[cam] = np.stack([np.asarray(fr) for fr in r])
            except Exception as e:
                raise bad(
                    f"camera {cam!r}: its frames cannot be decoded ({type(e).__name__}: "
                    f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})"
                ) from None
    lines = (folder / "interventions.jsonl").read_text().splitlines()
    return Episode(meta, steps, images, [json.loads(line) for line in lines if line])
