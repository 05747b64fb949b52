"""Robot-learning datasets: LeRobotDataset folders (write v3.0, read v2.1 and v3.0) and the
export of deploy recordings into them.

Needs ``pyarrow`` (parquet) and ``imageio-ffmpeg`` (MP4), imported when used.
"""

from rlinf_vla.data.export import export_recordings
from rlinf_vla.data.lerobot import (
    CODEBASE_VERSION,
    SUPPORTED_VERSIONS,
    Dataset,
    DatasetError,
    EpisodeInfo,
    LeRobotWriter,
    open_dataset,
)

__all__ = [
    "CODEBASE_VERSION",
    "SUPPORTED_VERSIONS",
    "Dataset",
    "DatasetError",
    "EpisodeInfo",
    "LeRobotWriter",
    "export_recordings",
    "open_dataset",
]
