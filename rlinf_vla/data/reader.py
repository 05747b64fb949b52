"""Read a LeRobotDataset folder, format v2.1 or v3.0 (layout: :mod:`rlinf_vla.data.lerobot`)."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlinf_vla.data.format import (
    DEFAULT_CHUNKS_SIZE,
    EPISODES_DIR,
    INDEX_FEATURES,
    INFO_PATH,
    NUMERIC_DTYPES,
    STATS_PATH,
    SUPPORTED_VERSIONS,
    TASKS_PATH,
    V21_EPISODES_PATH,
    V21_EPISODES_STATS_PATH,
    V21_TASKS_PATH,
    VISUAL_DTYPES,
    DatasetError,
    pyarrow_modules,
)
from rlinf_vla.data.stats import aggregate_stats, stats_from_json
from rlinf_vla.data.video import VideoProbe, decode_frames, probe_mp4

__all__ = ["Dataset", "EpisodeInfo", "open_dataset"]


@dataclass(frozen=True)
class EpisodeInfo:
    """One episode of a dataset.

    Attributes:
        index: its ``episode_index``.
        length: number of frames.
        tasks: its task strings (LeRobot allows several; usually one).
    """

    index: int
    length: int
    tasks: tuple[str, ...]

    @property
    def task(self) -> str:
        """The (first) task."""
        return self.tasks[0] if self.tasks else ""


@dataclass
class _Location:
    """Where an episode's frames are: rows of a data file, ranges of video files."""

    data_file: str
    from_index: int  # global frame index of the first frame
    videos: dict[str, tuple[str, float, float]] = field(
        default_factory=dict
    )  # key -> (file, from, to)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: not valid JSON ({e})") from e


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DatasetError(f"{path}: missing (a v2.1 dataset lists its metadata there)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{n}: not valid JSON ({e})") from e
    return rows


def _image_size(key: str, feature: dict[str, Any]) -> tuple[int, int]:
    """``(height, width)`` of a camera feature (shape ``[H, W, C]``, or ``[C, H, W]`` when its
    names say so)."""
    info = feature.get("info") or {}
    if "video.height" in info and "video.width" in info:
        return int(info["video.height"]), int(info["video.width"])
    shape, names = list(feature.get("shape") or []), feature.get("names")
    if len(shape) != 3:
        raise DatasetError(f"feature {key!r}: shape {shape} is not an image shape")
    if isinstance(names, list) and names and names[0] in ("channel", "channels"):
        return int(shape[1]), int(shape[2])
    return int(shape[0]), int(shape[1])


class Dataset:
    """A LeRobotDataset folder (v2.1 or v3.0), opened by :func:`open_dataset`.

    The metadata is read and checked when it is opened; :meth:`load` reads the frames.

    Attributes:
        path: the folder.
        version: ``codebase_version`` (``v2.1`` or ``v3.0``).
        info: ``meta/info.json``.
        fps: frames per second.
        robot_type: from ``info.json`` (may be ``None``).
        features: feature name -> its ``info.json`` entry (``dtype``, ``shape``, ``names``...).
        cameras: the camera features (``video`` or ``image`` dtype).
        episodes: in ``episode_index`` order.
        tasks: task strings; ``tasks[task_index]``.
        stats: ``meta/stats.json`` as arrays (v2.1 without it: merged from
            ``episodes_stats.jsonl``), or ``None``.
    """

    def __init__(
        self,
        path: Path,
        info: dict[str, Any],
        episodes: list[EpisodeInfo],
        locations: list[_Location],
        tasks: list[str],
        stats: dict[str, dict[str, np.ndarray]] | None,
    ) -> None:
        self.path = path
        self.info = info
        self.version: str = info["codebase_version"]
        self.fps = info["fps"]
        self.robot_type: str | None = info.get("robot_type")
        self.features: dict[str, dict[str, Any]] = info["features"]
        self.cameras = [k for k, f in self.features.items() if f.get("dtype") in VISUAL_DTYPES]
        self.episodes = episodes
        self.tasks = tasks
        self.stats = stats
        self._locations = locations
        self._by_index = {e.index: i for i, e in enumerate(episodes)}

    @property
    def num_frames(self) -> int:
        return sum(e.length for e in self.episodes)

    def __repr__(self) -> str:
        return (
            f"Dataset({str(self.path)!r}, {self.version}, fps={self.fps}, "
            f"episodes={len(self.episodes)}, frames={self.num_frames}, cameras={self.cameras})"
        )

    def load(self, episodes: Sequence[int] | None = None) -> dict[str, Any]:
        """Read the frames of ``episodes`` (episode indices; default all, in order) into memory.

        Returns:
            ``images``: camera feature -> ``uint8 [N, H, W, 3]``; every other numeric feature
            as an array of its dtype, ``[N]`` for shape ``[1]``, else ``[N, *shape]``
            (``observation.state``, ``action``, ``timestamp``, ``frame_index``,
            ``episode_index``, ``index``, ``task_index``...); ``tasks``: the task strings
            (indexed by ``task_index``). Rows follow the episodes' order.
        """
        order = self._select(episodes)
        columns = self._load_columns(order)
        images = {key: self._load_camera(key, order, columns) for key in self.cameras}
        out: dict[str, Any] = {"images": images}
        out.update({k: v for k, v in columns.items() if k not in images})
        out["tasks"] = list(self.tasks)
        return out

    def load_tabular(self, episodes: Sequence[int] | None = None) -> dict[str, Any]:
        """What :meth:`load` returns without the images (nothing is decoded): the numeric
        features and ``tasks``, for checks that need the values but not the pictures."""
        columns = self._load_columns(self._select(episodes), images=False)
        return {**columns, "tasks": list(self.tasks)}

    def _select(self, episodes: Sequence[int] | None) -> list[int]:
        if episodes is None:
            return list(range(len(self.episodes)))
        order = []
        for e in episodes:
            if int(e) not in self._by_index:
                raise KeyError(f"{self.path}: no episode {e} (episodes: {len(self.episodes)})")
            order.append(self._by_index[int(e)])
        if len(set(order)) != len(order):
            raise ValueError(f"episodes {list(episodes)} repeat an episode")
        return order

    # -- tabular data ----------------------------------------------------------------------

    def _tabular_features(self) -> list[str]:
        return [
            k
            for k, f in self.features.items()
            if f.get("dtype") in NUMERIC_DTYPES or f.get("dtype") == "string"
        ]

    def _load_columns(self, order: list[int], images: bool = True) -> dict[str, Any]:
        """Columns of the selected episodes, concatenated in ``order``; ``image`` features as
        decoded frames (unless ``images`` is false)."""
        _, pq = pyarrow_modules()
        names = self._tabular_features()
        image_keys = [k for k in self.cameras if self.features[k]["dtype"] == "image" and images]
        parts: dict[str, list[Any]] = {k: [] for k in names + image_keys}
        cache: tuple[str, Any, np.ndarray] | None = None
        for i in order:
            ep, loc = self.episodes[i], self._locations[i]
            if cache is None or cache[0] != loc.data_file:
                table = pq.read_table(self.path / loc.data_file, columns=names + image_keys)
                cache = (loc.data_file, table, table.column("episode_index").to_numpy())
            _, table, ep_col = cache
            rows = np.flatnonzero(ep_col == ep.index)
            if len(rows) != ep.length or (len(rows) and rows[-1] - rows[0] + 1 != len(rows)):
                raise DatasetError(
                    f"{loc.data_file}: {len(rows)} rows of episode {ep.index} "
                    f"(contiguous: {bool(len(rows)) and rows[-1] - rows[0] + 1 == len(rows)}), "
                    f"the episode metadata says {ep.length}"
                )
            piece = table.slice(int(rows[0]), ep.length) if len(rows) else table.slice(0, 0)
            frame_index = piece.column("frame_index").to_numpy() if "frame_index" in names else None
            if frame_index is not None and not np.array_equal(frame_index, np.arange(ep.length)):
                raise DatasetError(
                    f"{loc.data_file}: episode {ep.index}'s frame_index is not 0..{ep.length - 1}"
                )
            for k in names:
                parts[k].append(self._column(piece, k, loc.data_file))
            for k in image_keys:
                parts[k].append(self._decode_images(piece, k, loc.data_file))
        out: dict[str, Any] = {}
        for k, chunks in parts.items():
            if self.features[k]["dtype"] == "string":
                out[k] = [s for c in chunks for s in c]
            else:
                out[k] = np.concatenate(chunks) if chunks else self._empty(k)
        return out

    def _empty(self, key: str) -> np.ndarray:
        f = self.features[key]
        if f["dtype"] in VISUAL_DTYPES:
            return np.zeros((0, *_image_size(key, f), 3), np.uint8)
        shape = [int(s) for s in f.get("shape") or [1]]
        return np.zeros((0,) if shape == [1] else (0, *shape), np.dtype(f["dtype"]))

    def _column(self, table: Any, key: str, file: str) -> Any:
        f = self.features[key]
        col = table.column(key)
        if f["dtype"] == "string":
            return col.to_pylist()
        shape = [int(s) for s in f.get("shape") or [1]]
        n = table.num_rows
        arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
        while hasattr(arr, "flatten") and hasattr(arr.type, "value_type"):
            arr = arr.flatten()  # (fixed-size) list columns: the values, row-major
        values = np.asarray(arr.to_numpy(zero_copy_only=False))
        if values.size != n * math.prod(shape):
            raise DatasetError(
                f"{file}: column {key!r} has {values.size} values for {n} rows of shape {shape}"
            )
        target = (n,) if shape == [1] else (n, *shape)
        return values.reshape(target).astype(np.dtype(f["dtype"]), copy=False)

    def _decode_images(self, table: Any, key: str, file: str) -> np.ndarray:
        from PIL import Image

        h, w = _image_size(key, self.features[key])
        out = np.empty((table.num_rows, h, w, 3), np.uint8)
        for i, cell in enumerate(table.column(key).to_pylist()):
            data = cell.get("bytes") if isinstance(cell, dict) else cell
            if data is None and isinstance(cell, dict) and cell.get("path"):
                data = (self.path / cell["path"]).read_bytes()
            if data is None:
                raise DatasetError(f"{file}: row {i} of image feature {key!r} has no image")
            img = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
            if img.shape != (h, w, 3):
                raise DatasetError(
                    f"{file}: an image of {key!r} is {list(img.shape)}, expected [{h}, {w}, 3]"
                )
            out[i] = img
        return out

    # -- videos ------------------------------------------------------------------------------

    def video_problems(self) -> list[str]:
        """What keeps the video files from giving the frames the episodes need, without
        decoding them whole: each file must decode the last frame any of its episodes reads
        (a truncated or damaged file does not). One seek and a few frames per file, the files
        in parallel; ``[]`` when every file delivers."""
        from concurrent.futures import ThreadPoolExecutor

        last: dict[tuple[str, str], int] = {}
        for i, ep in enumerate(self.episodes):
            for key, (file, from_ts, _) in self._locations[i].videos.items():
                frame = int(np.rint(from_ts * self.fps)) + ep.length - 1
                last[(key, file)] = max(last.get((key, file), -1), frame)

        def problem(item: tuple[tuple[str, str], int]) -> str | None:
            (key, file), frame = item
            if frame < 0:
                return None
            h, w = _image_size(key, self.features[key])
            try:
                got = decode_frames(self.path / file, h, w, frame, 1, self.fps)
            except (OSError, RuntimeError, ValueError) as e:
                return f"{file}: cannot be decoded ({str(e).splitlines()[0]})"
            if len(got) != 1:
                return (
                    f"{file}: frame {frame}, the last its episodes need, does not decode "
                    "(the file is truncated or damaged)"
                )
            return None

        with ThreadPoolExecutor(max_workers=min(8, max(1, len(last)))) as pool:
            return [p for p in pool.map(problem, sorted(last.items())) if p]

    def _load_camera(self, key: str, order: list[int], columns: dict[str, Any]) -> np.ndarray:
        if self.features[key]["dtype"] == "image":
            return columns[key]
        h, w = _image_size(key, self.features[key])
        n = sum(self.episodes[i].length for i in order)
        out = np.empty((n, h, w, 3), np.uint8)
        timestamps = columns.get("timestamp")
        starts = np.cumsum([0] + [self.episodes[i].length for i in order])
        # which frames of which file each selected episode needs
        by_file: dict[str, list[tuple[int, np.ndarray]]] = {}
        for j, i in enumerate(order):
            file, from_ts, _ = self._locations[i].videos[key]
            length = self.episodes[i].length
            ts = (
                timestamps[starts[j] : starts[j + 1]].astype(np.float64)
                if timestamps is not None
                else np.arange(length) / self.fps
            )
            frames = np.rint((from_ts + ts) * self.fps).astype(np.int64)
            if len(frames):
                by_file.setdefault(file, []).append((j, frames))
        for file, wanted in by_file.items():
            first = min(int(f.min()) for _, f in wanted)
            last = max(int(f.max()) for _, f in wanted)
            decoded = decode_frames(self.path / file, h, w, first, last - first + 1, self.fps)
            if len(decoded) != last - first + 1:
                raise DatasetError(
                    f"{file}: decoded {len(decoded)} frames from frame {first}, "
                    f"the episodes need {last - first + 1}"
                )
            for j, frames in wanted:
                out[starts[j] : starts[j + 1]] = decoded[frames - first]
        return out


def open_dataset(path: str | Path) -> Dataset:
    """Open a LeRobotDataset folder (``codebase_version`` v2.1 or v3.0) and check it.

    Checked here, before any frame is read: the metadata files exist and agree (episode count,
    frame count), every data file exists with the columns of the features and the rows its
    episodes need, every video file exists with the frame count and size its episodes need.

    Raises:
        DatasetError: naming the file and what is wrong with it.
    """
    root = Path(path)
    if not root.is_dir():
        raise DatasetError(f"{root}: not a folder")
    info_path = root / INFO_PATH
    if not info_path.is_file():
        raise DatasetError(f"{info_path}: missing; {root} is not a LeRobotDataset folder")
    info = _read_json(info_path)
    if not isinstance(info, dict):
        raise DatasetError(f"{info_path}: not a JSON object")
    version = info.get("codebase_version")
    if version not in SUPPORTED_VERSIONS:
        raise DatasetError(
            f"{info_path}: unsupported codebase_version {version!r} "
            f"(supported: {', '.join(SUPPORTED_VERSIONS)})"
        )
    missing = [k for k in ("fps", "features", "data_path") if k not in info]
    if missing:
        raise DatasetError(f"{info_path}: missing {', '.join(missing)}")
    if not isinstance(info["fps"], int | float) or info["fps"] <= 0:
        raise DatasetError(f"{info_path}: fps must be a positive number, got {info['fps']!r}")
    features = info["features"]
    if not isinstance(features, dict) or not all(
        isinstance(f, dict) and "dtype" in f for f in features.values()
    ):
        raise DatasetError(f"{info_path}: features must map names to objects with a dtype")
    missing = [k for k in INDEX_FEATURES if k not in features]
    if missing:
        raise DatasetError(f"{info_path}: features lack LeRobot's bookkeeping columns {missing}")
    video_keys = [k for k, f in features.items() if f["dtype"] == "video"]
    if video_keys and not info.get("video_path"):
        raise DatasetError(f"{info_path}: video features {video_keys} but no video_path")

    if version == "v3.0":
        episodes, locations, tasks = _read_v30_meta(root, info, video_keys)
        stats_raw = _read_json(root / STATS_PATH) if (root / STATS_PATH).is_file() else None
        stats = stats_from_json(stats_raw) if stats_raw else None
    else:
        episodes, locations, tasks = _read_v21_meta(root, info, video_keys)
        stats = _read_v21_stats(root)

    for what, expected, actual in (
        ("total_episodes", info.get("total_episodes"), len(episodes)),
        ("total_frames", info.get("total_frames"), sum(e.length for e in episodes)),
    ):
        if expected is not None and expected != actual:
            raise DatasetError(
                f"{info_path}: {what} is {expected}, the episode metadata has {actual}"
            )
    known = set(tasks)
    for e in episodes:
        for t in e.tasks:
            if t not in known:
                raise DatasetError(
                    f"{root}: episode {e.index}'s task {t!r} is not in the task list"
                )
    _check_data_files(root, features, episodes, locations)
    _check_video_files(root, info, features, video_keys, episodes, locations)
    return Dataset(root, info, episodes, locations, tasks, stats)


def _read_parquet(path: Path, columns: list[str] | None = None) -> Any:
    _, pq = pyarrow_modules()
    try:
        return pq.read_table(path, columns=columns)
    except Exception as e:
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from e


def _parquet_columns(path: Path) -> list[str]:
    _, pq = pyarrow_modules()
    try:
        return pq.read_schema(path).names
    except Exception as e:
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from e


def _read_v30_meta(
    root: Path, info: dict[str, Any], video_keys: list[str]
) -> tuple[list[EpisodeInfo], list[_Location], list[str]]:
    tasks_path = root / TASKS_PATH
    if not tasks_path.is_file():
        raise DatasetError(f"{tasks_path}: missing")
    table = _read_parquet(tasks_path)
    pandas_meta = json.loads((table.schema.metadata or {}).get(b"pandas", b"{}"))
    index_cols = [c for c in pandas_meta.get("index_columns", []) if isinstance(c, str)]
    task_col = next(
        (c for c in ["task", *index_cols, "__index_level_0__"] if c in table.column_names), None
    )
    if task_col is None or "task_index" not in table.column_names:
        raise DatasetError(
            f"{tasks_path}: needs the columns task_index and task, has {table.column_names}"
        )
    by_index = dict(
        zip(table.column("task_index").to_pylist(), table.column(task_col).to_pylist(), strict=True)
    )
    if sorted(by_index) != list(range(len(by_index))):
        raise DatasetError(f"{tasks_path}: task_index must be 0..{len(by_index) - 1}")
    tasks = [by_index[i] for i in range(len(by_index))]

    files = sorted((root / EPISODES_DIR).glob("*/*.parquet"))
    if not files:
        raise DatasetError(
            f"{root / EPISODES_DIR}: no episodes parquet file (chunk-*/file-*.parquet)"
        )
    needed = [
        "episode_index", "tasks", "length",
        "data/chunk_index", "data/file_index", "dataset_from_index", "dataset_to_index",
    ]  # fmt: skip
    for key in video_keys:
        needed += [
            f"videos/{key}/{c}"
            for c in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")
        ]
    rows: list[dict[str, Any]] = []
    for f in files:
        names = _parquet_columns(f)
        missing = [c for c in needed if c not in names]
        if missing:
            raise DatasetError(f"{f}: missing columns {missing}")
        rows += _read_parquet(f, columns=needed).to_pylist()
    rows.sort(key=lambda r: r["episode_index"])
    if [r["episode_index"] for r in rows] != list(range(len(rows))):
        raise DatasetError(
            f"{root / EPISODES_DIR}: episode_index must be 0..{len(rows) - 1} once each"
        )
    episodes, locations = [], []
    for r in rows:
        ep = EpisodeInfo(int(r["episode_index"]), int(r["length"]), tuple(r["tasks"] or ()))
        if r["dataset_to_index"] - r["dataset_from_index"] != ep.length:
            raise DatasetError(
                f"{root / EPISODES_DIR}: episode {ep.index} has length {ep.length} but "
                f"dataset_from_index..dataset_to_index {r['dataset_from_index']}..{r['dataset_to_index']}"
            )
        data_file = info["data_path"].format(
            chunk_index=r["data/chunk_index"], file_index=r["data/file_index"]
        )
        loc = _Location(data_file, int(r["dataset_from_index"]))
        for key in video_keys:
            file = info["video_path"].format(
                video_key=key,
                chunk_index=r[f"videos/{key}/chunk_index"],
                file_index=r[f"videos/{key}/file_index"],
            )
            loc.videos[key] = (
                file,
                float(r[f"videos/{key}/from_timestamp"]),
                float(r[f"videos/{key}/to_timestamp"]),
            )
        episodes.append(ep)
        locations.append(loc)
    return episodes, locations, tasks


def _read_v21_meta(
    root: Path, info: dict[str, Any], video_keys: list[str]
) -> tuple[list[EpisodeInfo], list[_Location], list[str]]:
    task_rows = _read_jsonl(root / V21_TASKS_PATH)
    try:
        by_index = {int(r["task_index"]): str(r["task"]) for r in task_rows}
    except (KeyError, TypeError, ValueError) as e:
        raise DatasetError(f"{root / V21_TASKS_PATH}: rows need task_index and task ({e})") from e
    if sorted(by_index) != list(range(len(by_index))):
        raise DatasetError(f"{root / V21_TASKS_PATH}: task_index must be 0..{len(by_index) - 1}")
    tasks = [by_index[i] for i in range(len(by_index))]
    ep_rows = _read_jsonl(root / V21_EPISODES_PATH)
    try:
        ep_rows.sort(key=lambda r: int(r["episode_index"]))
        episodes = [
            EpisodeInfo(int(r["episode_index"]), int(r["length"]), tuple(r.get("tasks") or ()))
            for r in ep_rows
        ]
    except (KeyError, TypeError, ValueError) as e:
        raise DatasetError(
            f"{root / V21_EPISODES_PATH}: rows need episode_index and length ({e})"
        ) from e
    if [e.index for e in episodes] != list(range(len(episodes))):
        raise DatasetError(
            f"{root / V21_EPISODES_PATH}: episode_index must be 0..{len(episodes) - 1} once each"
        )
    chunks_size = int(info.get("chunks_size") or DEFAULT_CHUNKS_SIZE)
    locations, start = [], 0
    for e in episodes:
        chunk = e.index // chunks_size
        loc = _Location(info["data_path"].format(episode_chunk=chunk, episode_index=e.index), start)
        for key in video_keys:
            file = info["video_path"].format(
                episode_chunk=chunk, video_key=key, episode_index=e.index
            )
            loc.videos[key] = (file, 0.0, e.length / float(info["fps"]))
        locations.append(loc)
        start += e.length
    return episodes, locations, tasks


def _read_v21_stats(root: Path) -> dict[str, dict[str, np.ndarray]] | None:
    if (root / STATS_PATH).is_file():
        return stats_from_json(_read_json(root / STATS_PATH))
    path = root / V21_EPISODES_STATS_PATH
    if not path.is_file():
        return None
    per_episode = [stats_from_json(r.get("stats") or {}) for r in _read_jsonl(path)]
    return aggregate_stats(per_episode) if per_episode else None


def _check_data_files(
    root: Path,
    features: dict[str, dict[str, Any]],
    episodes: list[EpisodeInfo],
    locations: list[_Location],
) -> None:
    _, pq = pyarrow_modules()
    rows_needed: dict[str, int] = {}
    for e, loc in zip(episodes, locations, strict=True):
        rows_needed[loc.data_file] = rows_needed.get(loc.data_file, 0) + e.length
    columns = [k for k, f in features.items() if f["dtype"] != "video"]
    for file, rows in rows_needed.items():
        path = root / file
        if not path.is_file():
            raise DatasetError(f"{path}: missing (data of {rows} frames)")
        try:
            meta = pq.read_metadata(path)
        except Exception as e:
            raise DatasetError(f"{path}: not a parquet file ({e})") from e
        names = meta.schema.to_arrow_schema().names
        missing = [c for c in columns if c not in names]
        if missing:
            raise DatasetError(f"{path}: missing columns {missing} (features of info.json)")
        if meta.num_rows != rows:
            raise DatasetError(f"{path}: {meta.num_rows} rows, its episodes have {rows} frames")


def _check_video_files(
    root: Path,
    info: dict[str, Any],
    features: dict[str, dict[str, Any]],
    video_keys: list[str],
    episodes: list[EpisodeInfo],
    locations: list[_Location],
) -> None:
    fps = float(info["fps"])
    for key in video_keys:
        h, w = _image_size(key, features[key])
        frames_needed: dict[str, int] = {}
        for e, loc in zip(episodes, locations, strict=True):
            file, from_ts, to_ts = loc.videos[key]
            span = round((to_ts - from_ts) * fps)
            if span != e.length:
                raise DatasetError(
                    f"{root / file}: episode {e.index} spans {to_ts - from_ts:.4f} s "
                    f"({span} frames at {fps:g} fps) of {key}, its data has {e.length} frames"
                )
            frames_needed[file] = max(frames_needed.get(file, 0), round(to_ts * fps))
        for file, needed in frames_needed.items():
            path = root / file
            if not path.is_file():
                raise DatasetError(f"{path}: missing (video {key})")
            try:
                probe: VideoProbe = probe_mp4(path)
            except (ValueError, OSError, IndexError) as e:
                raise DatasetError(f"{path}: unreadable MP4 header ({e})") from e
            if (probe.height, probe.width) != (h, w):
                raise DatasetError(
                    f"{path}: frames are {probe.height}x{probe.width}, feature {key} says {h}x{w}"
                )
            # (frames after the last episode's range would be ignored, as LeRobot ignores them)
            if probe.frames is not None and probe.frames < needed:
                raise DatasetError(
                    f"{path}: {probe.frames} frames, the data of its episodes needs {needed} "
                    "(frame count mismatch between data and video)"
                )
