"""Write a LeRobotDataset v3.0 folder (layout: :mod:`rlinf_vla.data.lerobot`)."""

from __future__ import annotations

import contextlib
import json
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlinf_vla.data.format import (
    ACTION,
    CODEBASE_VERSION,
    DATA_PATH,
    DEFAULT_CHUNKS_SIZE,
    DEFAULT_DATA_FILE_SIZE_MB,
    DEFAULT_VIDEO_FILE_SIZE_MB,
    EPISODES_PATH,
    IMAGE_PREFIX,
    INDEX_FEATURES,
    STATE,
    VIDEO_PATH,
    is_non_empty_dir,
    next_file,
    pyarrow_modules,
)
from rlinf_vla.data.stats import ImageStats, stats_to_json, vector_stats
from rlinf_vla.data.video import H264Encoder, concat_mp4, probe_mp4

__all__ = ["LeRobotWriter"]


@dataclass
class _VideoFile:
    """The video file a camera's episodes currently go to; its episodes are encoded one file
    each and joined (without re-encoding) when the file is complete."""

    chunk: int
    file: int
    episodes: list[Path] = field(default_factory=list)
    frames: int = 0
    bytes: int = 0


class LeRobotWriter:
    """Write episodes into a new LeRobotDataset v3.0 folder.

    Everything goes to a hidden temporary folder beside ``root`` that :meth:`close` renames to
    ``root``: an interrupted write never leaves a half-written dataset at ``root``, and an
    existing dataset is replaced only with ``overwrite=True`` (and only once the new one is
    complete). Used as a context manager, an exception discards the temporary folder.

    Episodes are written as they are added (a parquet row group; one MP4 per camera, joined
    into the camera's current video file when that file is complete), so memory holds one
    episode's frames at a time plus the state and action arrays (for the statistics).

    Features: ``observation.images.<camera>`` (H.264 MP4 videos, ``yuv420p``),
    ``observation.state`` ``float32 [state_dim]``, ``action`` ``float32 [action_dim]``, plus
    LeRobot's ``timestamp, frame_index, episode_index, index, task_index``.

    Args:
        root: the dataset folder to create.
        fps: frames per second (an integer, as LeRobot requires).
        cameras: camera name -> ``(height, width)`` (even sizes, for ``yuv420p``).
        state_dim, action_dim: vector sizes.
        robot_type: recorded in ``info.json``.
        state_names, action_names: a name per dimension (default ``state_0``...).
        overwrite: replace an existing non-empty folder at ``root`` (at :meth:`close`).
        crf, preset, gop: H.264 settings (see :class:`rlinf_vla.data.video.H264Encoder`).
        chunks_size, data_file_size_mb, video_file_size_mb: LeRobot's file layout settings.
    """

    def __init__(
        self,
        root: str | Path,
        fps: int,
        cameras: dict[str, tuple[int, int]],
        state_dim: int,
        action_dim: int,
        robot_type: str | None = None,
        state_names: Sequence[str] | None = None,
        action_names: Sequence[str] | None = None,
        *,
        overwrite: bool = False,
        crf: int = 12,
        preset: str = "fast",
        gop: int = 2,
        chunks_size: int = DEFAULT_CHUNKS_SIZE,
        data_file_size_mb: float = DEFAULT_DATA_FILE_SIZE_MB,
        video_file_size_mb: float = DEFAULT_VIDEO_FILE_SIZE_MB,
    ) -> None:
        pa, pq = pyarrow_modules()
        if isinstance(fps, bool) or not float(fps).is_integer() or fps <= 0:
            raise ValueError(f"fps must be a positive integer (LeRobot's info.json), got {fps!r}")
        for name, size in cameras.items():
            if not name or "/" in name:
                raise ValueError(f"camera name {name!r}: must be non-empty, without '/'")
            if len(size) != 2 or min(size) <= 0 or size[0] % 2 or size[1] % 2:
                raise ValueError(
                    f"camera {name!r}: size must be (height, width), positive and even "
                    f"(H.264 yuv420p), got {tuple(size)}"
                )
        if state_dim < 1 or action_dim < 1:
            raise ValueError(
                f"state_dim and action_dim must be >= 1, got {state_dim}, {action_dim}"
            )
        for what, names, dim in (
            ("state", state_names, state_dim),
            ("action", action_names, action_dim),
        ):
            if names is not None and len(names) != dim:
                raise ValueError(f"{what}_names has {len(names)} names for {dim} dimensions")
        if min(chunks_size, data_file_size_mb, video_file_size_mb) <= 0:
            raise ValueError("chunks_size, data_file_size_mb and video_file_size_mb must be > 0")
        self.root = Path(root)
        if is_non_empty_dir(self.root) and not overwrite:
            raise FileExistsError(
                f"{self.root} exists and is not empty (overwrite=True replaces it)"
            )
        if self.root.exists() and not self.root.is_dir():
            raise FileExistsError(f"{self.root} exists and is not a folder")
        self.fps = int(fps)
        self.cameras = {name: (int(h), int(w)) for name, (h, w) in cameras.items()}
        self.state_dim, self.action_dim = int(state_dim), int(action_dim)
        self.robot_type = robot_type
        self.state_names = (
            list(state_names) if state_names else [f"state_{i}" for i in range(state_dim)]
        )
        self.action_names = (
            list(action_names) if action_names else [f"action_{i}" for i in range(action_dim)]
        )
        self.overwrite = overwrite
        self.video_settings = {"crf": crf, "preset": preset, "gop": gop}
        self.chunks_size = chunks_size
        self.data_file_size_mb = data_file_size_mb
        self.video_file_size_mb = video_file_size_mb

        self.tmp = self.root.parent / f".{self.root.name}.writing-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir(parents=True)
        self._schema = pa.schema(
            [
                (STATE, pa.list_(pa.float32(), self.state_dim)),
                (ACTION, pa.list_(pa.float32(), self.action_dim)),
                ("timestamp", pa.float32()),
                ("frame_index", pa.int64()),
                ("episode_index", pa.int64()),
                ("index", pa.int64()),
                ("task_index", pa.int64()),
            ]
        )
        self._pq = pq
        self._data_writer: Any = None
        self._data_file = (0, 0)
        self._data_bytes = 0
        self._videos = {self.camera_feature(c): _VideoFile(0, 0) for c in self.cameras}
        self._episodes: list[dict[str, Any]] = []
        self._tasks: dict[str, int] = {}
        self._columns: dict[str, list[np.ndarray]] = {
            k: [] for k in (STATE, ACTION, *INDEX_FEATURES)
        }
        self._image_stats = {self.camera_feature(c): ImageStats() for c in self.cameras}
        self._total_frames = 0
        self._state = "open"

    @staticmethod
    def camera_feature(camera: str) -> str:
        """The feature name of a camera."""
        return IMAGE_PREFIX + camera

    @property
    def num_episodes(self) -> int:
        return len(self._episodes)

    def __enter__(self) -> LeRobotWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"the writer of {self.root} is {self._state}")

    def _validate(
        self,
        images: dict[str, np.ndarray],
        state: np.ndarray,
        action: np.ndarray,
        task: str,
    ) -> tuple[np.ndarray, np.ndarray]:
        ep = self.num_episodes
        state = np.asarray(state)
        action = np.asarray(action)
        if state.ndim != 2 or state.shape[1] != self.state_dim or len(state) == 0:
            raise ValueError(
                f"episode {ep}: state must be [T >= 1, {self.state_dim}], got {list(state.shape)}"
            )
        t = len(state)
        if action.shape != (t, self.action_dim):
            raise ValueError(
                f"episode {ep}: action must be [{t}, {self.action_dim}], got {list(action.shape)}"
            )
        for what, x in (("state", state), ("action", action)):
            if not np.issubdtype(x.dtype, np.number) or not np.isfinite(x).all():
                raise ValueError(f"episode {ep}: {what} must be finite numbers")
        if set(images) != set(self.cameras):
            raise ValueError(
                f"episode {ep}: images for cameras {sorted(images)}, the dataset has {sorted(self.cameras)}"
            )
        for cam, (h, w) in self.cameras.items():
            frames = images[cam]
            if (
                not isinstance(frames, np.ndarray)
                or frames.dtype != np.uint8
                or frames.shape != (t, h, w, 3)
            ):
                got = (
                    f"{frames.dtype} {list(frames.shape)}"
                    if isinstance(frames, np.ndarray)
                    else type(frames).__name__
                )
                raise ValueError(
                    f"episode {ep}: camera {cam!r} must be uint8 [{t}, {h}, {w}, 3], got {got}"
                )
        if not isinstance(task, str) or not task:
            raise ValueError(f"episode {ep}: task must be a non-empty string")
        return state.astype(np.float32), action.astype(np.float32)

    def add_episode(
        self,
        images: dict[str, np.ndarray],
        state: np.ndarray,
        action: np.ndarray,
        task: str,
    ) -> int:
        """Append one episode of ``T`` frames; returns its episode index.

        Args:
            images: camera -> ``uint8 [T, H, W, 3]`` (every camera of the dataset).
            state: ``[T, state_dim]`` (stored as float32).
            action: ``[T, action_dim]``, the action taken at each frame.
            task: the instruction.
        """
        self._check_open()
        state, action = self._validate(images, state, action, task)
        try:
            return self._write_episode(images, state, action, task)
        except BaseException:
            self._state = "failed (call abort())"
            raise

    def _write_episode(
        self, images: dict[str, np.ndarray], state: np.ndarray, action: np.ndarray, task: str
    ) -> int:
        pa, _ = pyarrow_modules()
        ep, t, start = self.num_episodes, len(state), self._total_frames
        task_index = self._tasks.setdefault(task, len(self._tasks))
        frame_index = np.arange(t, dtype=np.int64)
        columns = {
            STATE: state,
            ACTION: action,
            "timestamp": (frame_index / self.fps).astype(np.float32),
            "frame_index": frame_index,
            "episode_index": np.full(t, ep, dtype=np.int64),
            "index": np.arange(start, start + t, dtype=np.int64),
            "task_index": np.full(t, task_index, dtype=np.int64),
        }
        table = pa.table(
            [
                pa.FixedSizeListArray.from_arrays(pa.array(state.ravel()), self.state_dim),
                pa.FixedSizeListArray.from_arrays(pa.array(action.ravel()), self.action_dim),
                *(pa.array(columns[k]) for k in INDEX_FEATURES),
            ],
            schema=self._schema,
        )
        limit = self.data_file_size_mb * 1024**2
        if self._data_writer is not None and self._data_bytes + table.nbytes > limit:
            self._data_writer.close()
            self._data_writer = None
            self._data_file = next_file(*self._data_file, self.chunks_size)
        if self._data_writer is None:
            path = self.tmp / DATA_PATH.format(
                chunk_index=self._data_file[0], file_index=self._data_file[1]
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            self._data_writer = self._pq.ParquetWriter(
                str(path), self._schema, compression="snappy"
            )
            self._data_bytes = 0
        self._data_writer.write_table(table)  # one row group per episode
        self._data_bytes += table.nbytes

        row: dict[str, Any] = {
            "episode_index": ep,
            "tasks": [task],
            "length": t,
            "data/chunk_index": self._data_file[0],
            "data/file_index": self._data_file[1],
            "dataset_from_index": start,
            "dataset_to_index": start + t,
        }
        ep_stats: dict[str, dict[str, np.ndarray]] = {}
        for cam in self.cameras:
            key = self.camera_feature(cam)
            video, offset = self._add_video(key, ep, images[cam])
            row[f"videos/{key}/chunk_index"] = video.chunk
            row[f"videos/{key}/file_index"] = video.file
            row[f"videos/{key}/from_timestamp"] = offset / self.fps
            row[f"videos/{key}/to_timestamp"] = (offset + t) / self.fps
            img_stats = ImageStats()
            img_stats.update(images[cam])
            self._image_stats[key].merge(img_stats)
            ep_stats[key] = img_stats.result()
        for k, v in columns.items():
            ep_stats[k] = vector_stats(v)
            self._columns[k].append(v)
        for feature, feature_stats in ep_stats.items():
            for stat, value in feature_stats.items():
                row[f"stats/{feature}/{stat}"] = np.asarray(value).tolist()
        row["meta/episodes/chunk_index"] = 0
        row["meta/episodes/file_index"] = 0
        self._episodes.append(row)
        self._total_frames += t
        return ep

    def _add_video(self, key: str, episode: int, frames: np.ndarray) -> tuple[_VideoFile, int]:
        """Encode an episode's frames of camera ``key``; returns the file it goes to and its
        first frame there. A file takes episodes until the next would pass
        ``video_file_size_mb`` (LeRobot's rule)."""
        h, w = frames.shape[1:3]
        path = self.tmp / ".episodes" / f"{key}-{episode:06d}.mp4"
        path.parent.mkdir(exist_ok=True)
        s = self.video_settings
        encoder = H264Encoder(path, h, w, self.fps, crf=s["crf"], preset=s["preset"], gop=s["gop"])
        try:
            encoder.write(frames)
        finally:
            encoder.close()
        size = path.stat().st_size
        video = self._videos[key]
        if video.episodes and video.bytes + size >= self.video_file_size_mb * 1024**2:
            self._finish_video(key)
            video = self._videos[key] = _VideoFile(
                *next_file(video.chunk, video.file, self.chunks_size)
            )
        offset = video.frames
        video.episodes.append(path)
        video.frames += len(frames)
        video.bytes += size
        return video, offset

    def _finish_video(self, key: str) -> None:
        """Join the episodes of ``key``'s current file into it and check its frame count."""
        video = self._videos[key]
        if not video.episodes:
            return
        path = self.tmp / VIDEO_PATH.format(
            video_key=key, chunk_index=video.chunk, file_index=video.file
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        if len(video.episodes) == 1:
            video.episodes[0].rename(path)
        else:
            concat_mp4(video.episodes, path)
            for p in video.episodes:
                p.unlink()
        frames = probe_mp4(path).frames
        if frames != video.frames:
            raise RuntimeError(f"{path}: FFmpeg wrote {frames} frames of {video.frames}")
        video.episodes = []

    def _features(self) -> dict[str, dict[str, Any]]:
        features: dict[str, dict[str, Any]] = {}
        s = self.video_settings
        for cam, (h, w) in self.cameras.items():
            features[self.camera_feature(cam)] = {
                "dtype": "video",
                "shape": [h, w, 3],
                "names": ["height", "width", "channels"],
                "info": {
                    "video.height": h,
                    "video.width": w,
                    "video.codec": "h264",
                    "video.pix_fmt": "yuv420p",
                    "video.fps": self.fps,
                    "video.channels": 3,
                    "video.g": s["gop"],
                    "video.crf": s["crf"],
                    "video.preset": s["preset"],
                    "has_audio": False,
                    "is_depth_map": False,
                },
            }
        features[STATE] = {"dtype": "float32", "shape": [self.state_dim], "names": self.state_names}
        features[ACTION] = {
            "dtype": "float32",
            "shape": [self.action_dim],
            "names": self.action_names,
        }
        for name, dtype in INDEX_FEATURES.items():
            features[name] = {"dtype": dtype, "shape": [1], "names": None}
        return features

    def close(self) -> Path:
        """Finish the files, write the metadata and move the dataset to ``root``; returns it."""
        self._check_open()
        if not self._episodes:
            self.abort()
            raise ValueError(f"{self.root}: no episode was added, nothing written")
        pa, pq = pyarrow_modules()
        try:
            for key in self._videos:
                self._finish_video(key)
            shutil.rmtree(self.tmp / ".episodes", ignore_errors=True)
            if self._data_writer is not None:
                self._data_writer.close()
                self._data_writer = None
            meta = self.tmp / "meta"
            meta.mkdir(exist_ok=True)
            n_eps, n_frames = len(self._episodes), self._total_frames
            info = {
                "codebase_version": CODEBASE_VERSION,
                "robot_type": self.robot_type,
                "total_episodes": n_eps,
                "total_frames": n_frames,
                "total_tasks": len(self._tasks),
                "chunks_size": self.chunks_size,
                "data_files_size_in_mb": self.data_file_size_mb,
                "video_files_size_in_mb": self.video_file_size_mb,
                "fps": self.fps,
                "splits": {"train": f"0:{n_eps}"},
                "data_path": DATA_PATH,
                "video_path": VIDEO_PATH if self.cameras else None,
                "features": self._features(),
            }
            (meta / "info.json").write_text(json.dumps(info, indent=4))
            stats = {k: vector_stats(np.concatenate(v)) for k, v in self._columns.items()}
            stats.update({k: s.result() for k, s in self._image_stats.items()})
            (meta / "stats.json").write_text(json.dumps(stats_to_json(stats), indent=4))
            _write_tasks(meta / "tasks.parquet", list(self._tasks))
            episodes_path = self.tmp / EPISODES_PATH.format(chunk_index=0, file_index=0)
            episodes_path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(
                pa.Table.from_pylist(self._episodes), str(episodes_path), compression="snappy"
            )
            self._install()
        except BaseException:
            self._state = "failed (call abort())"
            raise
        self._state = "closed"
        return self.root

    def _install(self) -> None:
        """Rename the finished temporary folder to ``root`` (replacing it if allowed)."""
        old = None
        if self.root.exists():
            if is_non_empty_dir(self.root):
                if not self.overwrite:
                    raise FileExistsError(
                        f"{self.root} appeared while writing; the finished dataset is in {self.tmp}"
                    )
                old = self.root.parent / f".{self.root.name}.replaced-{uuid.uuid4().hex[:8]}"
                self.root.rename(old)
            else:
                self.root.rmdir()
        self.tmp.rename(self.root)
        if old is not None:
            shutil.rmtree(old)

    def abort(self) -> None:
        """Discard everything written (the temporary folder); ``root`` is left untouched."""
        if self._state == "closed":
            return
        if self._data_writer is not None:
            with contextlib.suppress(Exception):
                self._data_writer.close()
            self._data_writer = None
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._state = "aborted"


def _write_tasks(path: Path, tasks: list[str]) -> None:
    """``meta/tasks.parquet``: LeRobot writes it from a pandas frame indexed by the task string,
    so the schema carries pandas' metadata naming ``task`` as the index (``pd.read_parquet``
    restores it; LeRobot looks tasks up by that index)."""
    pa, pq = pyarrow_modules()
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [
            {
                "name": None,
                "field_name": None,
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": {"encoding": "UTF-8"},
            }
        ],
        "columns": [
            {
                "name": "task_index",
                "field_name": "task_index",
                "pandas_type": "int64",
                "numpy_type": "int64",
                "metadata": None,
            },
            {
                "name": "task",
                "field_name": "task",
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": None,
            },
        ],
        "attributes": {},
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.0",
    }
    schema = pa.schema([("task_index", pa.int64()), ("task", pa.string())]).with_metadata(
        {"pandas": json.dumps(pandas_meta)}
    )
    table = pa.table(
        [pa.array(range(len(tasks)), pa.int64()), pa.array(tasks, pa.string())], schema=schema
    )
    pq.write_table(table, str(path))
