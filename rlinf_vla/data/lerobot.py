"""LeRobotDataset folders: :class:`LeRobotWriter` writes format v3.0, :func:`open_dataset` reads
v2.1 and v3.0.

Layout of v3.0 (what the writer produces; LeRobot's ``lerobot.datasets`` reads it)::

    meta/info.json        codebase_version "v3.0", robot_type, fps, total_episodes,
                          total_frames, total_tasks, chunks_size, data_files_size_in_mb,
                          video_files_size_in_mb, data_path / video_path templates, features
                          (name -> dtype, shape, names; videos also ``info``: codec, pix_fmt...),
                          splits
    meta/stats.json       feature -> min, max, mean, std, count, q01 q10 q50 q90 q99
    meta/tasks.parquet    one row per task: task_index, task (the pandas index)
    meta/episodes/chunk-000/file-000.parquet
                          one row per episode: episode_index, tasks, length,
                          data/chunk_index, data/file_index, dataset_from_index,
                          dataset_to_index, videos/<key>/{chunk_index, file_index,
                          from_timestamp, to_timestamp}, stats/<feature>/<stat>,
                          meta/episodes/{chunk_index, file_index}
    data/chunk-000/file-000.parquet
                          one row per frame: observation.state, action, timestamp,
                          frame_index, episode_index, index, task_index (several episodes
                          per file, one row group each)
    videos/<key>/chunk-000/file-000.mp4
                          several episodes one after the other; an episode is the range
                          [from_timestamp, to_timestamp) of the file

Files roll over to ``file-001``... when they pass ``data_files_size_in_mb`` /
``video_files_size_in_mb``; a chunk folder holds ``chunks_size`` files.

Layout of v2.1 (read only): ``meta/info.json``, ``meta/episodes.jsonl`` (episode_index, tasks,
length), ``meta/tasks.jsonl`` (task_index, task), ``meta/episodes_stats.jsonl`` (optional
``meta/stats.json``), one parquet file per episode (``data/chunk-000/episode_000000.parquet``)
and one video per episode and camera (``videos/chunk-000/<key>/episode_000000.mp4``).

Images are ``uint8 [H, W, 3]`` RGB. Cameras are the features whose dtype is ``video`` (MP4) or
``image`` (PNG/JPEG bytes inside the parquet rows).

Where the writer differs from LeRobot's own (the files stay what LeRobot reads): videos are
H.264 (``libx264``, ``yuv420p``; LeRobot defaults to AV1), recorded as such in ``info.json``;
statistics are exact over every frame and pixel (LeRobot estimates quantiles and subsamples
images, see :mod:`rlinf_vla.data.stats`); each episode is encoded to its own MP4 and the
episodes of a file are joined without re-encoding when the file is complete.

Usage::

    with LeRobotWriter("out/ds", fps=10, cameras={"main": (224, 224)}, state_dim=8,
                       action_dim=7, robot_type="franka") as writer:
        writer.add_episode({"main": frames}, state, action, "put the cup away")
    data = open_dataset("out/ds").load()  # images, observation.state, action, indices, tasks
"""

from rlinf_vla.data.format import (
    ACTION,
    CODEBASE_VERSION,
    IMAGE_PREFIX,
    STATE,
    SUPPORTED_VERSIONS,
    DatasetError,
)
from rlinf_vla.data.reader import Dataset, EpisodeInfo, open_dataset
from rlinf_vla.data.writer import LeRobotWriter

__all__ = [
    "ACTION",
    "CODEBASE_VERSION",
    "IMAGE_PREFIX",
    "STATE",
    "SUPPORTED_VERSIONS",
    "Dataset",
    "DatasetError",
    "EpisodeInfo",
    "LeRobotWriter",
    "open_dataset",
]
