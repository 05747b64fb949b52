"""The LeRobotDataset format: file layout, names and version constants shared by the writer
and the reader (see :mod:`rlinf_vla.data.lerobot` for the layout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "ACTION",
    "CODEBASE_VERSION",
    "IMAGE_PREFIX",
    "STATE",
    "SUPPORTED_VERSIONS",
    "DatasetError",
]

CODEBASE_VERSION = "v3.0"
SUPPORTED_VERSIONS = ("v2.1", "v3.0")

STATE = "observation.state"
ACTION = "action"
IMAGE_PREFIX = "observation.images."

INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
EPISODES_DIR = "meta/episodes"
_CHUNK_FILE = "chunk-{chunk_index:03d}/file-{file_index:03d}"
EPISODES_PATH = f"{EPISODES_DIR}/{_CHUNK_FILE}.parquet"
DATA_PATH = f"data/{_CHUNK_FILE}.parquet"
VIDEO_PATH = "videos/{video_key}/" + _CHUNK_FILE + ".mp4"
V21_EPISODES_PATH = "meta/episodes.jsonl"
V21_TASKS_PATH = "meta/tasks.jsonl"
V21_EPISODES_STATS_PATH = "meta/episodes_stats.jsonl"

DEFAULT_CHUNKS_SIZE = 1000
DEFAULT_DATA_FILE_SIZE_MB = 100
DEFAULT_VIDEO_FILE_SIZE_MB = 200

# The bookkeeping columns every LeRobot dataset has (LeRobot's DEFAULT_FEATURES).
INDEX_FEATURES: dict[str, str] = {
    "timestamp": "float32",
    "frame_index": "int64",
    "episode_index": "int64",
    "index": "int64",
    "task_index": "int64",
}
NUMERIC_DTYPES = {
    "float16", "float32", "float64", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64", "bool",
}  # fmt: skip
VISUAL_DTYPES = ("video", "image")


class DatasetError(ValueError):
    """A LeRobotDataset folder is malformed or unsupported (the message names the file)."""


def pyarrow_modules() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "LeRobot datasets are parquet files, which need pyarrow: pip install pyarrow"
        ) from e
    return pa, pq


def next_file(chunk: int, file: int, chunks_size: int) -> tuple[int, int]:
    """The file after ``chunk-<chunk>/file-<file>`` (a chunk folder holds ``chunks_size``)."""
    return (chunk + 1, 0) if file + 1 >= chunks_size else (chunk, file + 1)


def is_non_empty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())
