"""Check a LeRobotDataset folder with LeRobot's own reader against ours (rlinf_vla.data).

Opens DATASET with ``lerobot.datasets.lerobot_dataset.LeRobotDataset`` and with
:func:`rlinf_vla.data.open_dataset`, then compares: frame, episode, camera and task lists; every
frame's ``observation.state``, ``action``, ``timestamp``, ``episode_index``, ``frame_index``,
``index`` and ``task_index``; the video frames LeRobot's ``__getitem__`` decodes (first, middle
and last frame of each episode, or all with ``--all-frames``) against ours; and the statistics
both load from ``meta/stats.json``. Exit code 0 when all agree, 1 otherwise.

LeRobot cannot share the project's venv (it needs Python >= 3.12 and pins torch < 2.12; see
shared SETUP.md): run this with a separate venv that has it. ``rlinf_vla`` is imported from
this checkout (the repository root goes on ``sys.path``; ``rlinf_vla.data`` needs only numpy,
pyarrow and imageio-ffmpeg)::

    /root/.pyenv/versions/3.12.1/bin/python -m venv /tmp/lerobot-venv   # any Python >= 3.12
    /tmp/lerobot-venv/bin/pip install "lerobot[dataset]" imageio-ffmpeg
    /tmp/lerobot-venv/bin/python scripts/check_lerobot_dataset.py /path/to/dataset --all-frames

Measured on the 2-core dev machine (2026-11): the install took 118 s (every wheel downloaded
from PyPI, none cached) and 5.4 GB: lerobot 0.6.1, torch 2.11.0 with its CUDA libraries (PyPI's
default Linux build; the CPU index is not reachable here), torchvision 0.26, datasets, av.
LeRobot's default decoder, torchcodec, fails to load without FFmpeg's shared libraries on the
system, hence ``--video-backend pyav`` (the default here). A check of a small dataset takes
about 7 s, mostly imports.

Outcome: LeRobot 0.6.1 opened every dataset :class:`rlinf_vla.data.LeRobotWriter` wrote
(two cameras, three episodes; files rolled over into several chunks; a deploy-recording
export) with no warning; all tabular values were equal, every video frame it decoded was
identical to ours (mean absolute difference 0), its stats equal ours, and a
``torch.utils.data.DataLoader`` over it with ``delta_timestamps`` batched fine. LeRobot's
v2.1 -> v3.0 converter also accepted the hand-built v2.1 folder of the tests, and our reader
gave identical arrays for the v2.1 original and LeRobot's v3.0 conversion.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", type=Path, help="the LeRobotDataset folder")
    parser.add_argument("--repo-id", default="local/check", help="any name; nothing is downloaded")
    parser.add_argument(
        "--video-backend", default="pyav", help="LeRobot's decoder (pyav, torchcodec)"
    )
    parser.add_argument(
        "--all-frames",
        action="store_true",
        help="decode every frame through LeRobot (default: first, middle and last of each episode)",
    )
    parser.add_argument(
        "--max-pixel-error",
        type=float,
        default=2.0,
        help="largest mean absolute difference (0-255) allowed between the two readers' frames",
    )
    args = parser.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from rlinf_vla.data import open_dataset

    try:
        from lerobot.datasets.lerobot_dataset import LeRobotDataset
    except ImportError as e:
        print(f"lerobot is not installed in {sys.executable}: {e}", file=sys.stderr)
        return 1

    problems: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(("ok    " if ok else "FAIL  ") + what)
        if not ok:
            problems.append(what)

    t0 = time.time()
    ours_ds = open_dataset(args.dataset)
    ours = ours_ds.load()
    print(f"our reader: {ours_ds} in {time.time() - t0:.1f} s")

    t0 = time.time()
    theirs = LeRobotDataset(
        repo_id=args.repo_id, root=args.dataset, video_backend=args.video_backend
    )
    print(
        f"LeRobot {theirs.meta.info.codebase_version}: {theirs.num_episodes} episodes, "
        f"{theirs.num_frames} frames, cameras {theirs.meta.camera_keys} "
        f"(opened in {time.time() - t0:.1f} s)"
    )

    n = len(ours["index"])
    check(theirs.num_frames == n, f"frames: LeRobot {theirs.num_frames}, ours {n}")
    check(
        theirs.num_episodes == len(ours_ds.episodes),
        f"episodes: LeRobot {theirs.num_episodes}, ours {len(ours_ds.episodes)}",
    )
    check(
        sorted(theirs.meta.camera_keys) == sorted(ours_ds.cameras),
        f"cameras: LeRobot {theirs.meta.camera_keys}, ours {ours_ds.cameras}",
    )
    their_tasks = [str(t) for t in theirs.meta.tasks.index]
    check(their_tasks == ours["tasks"], f"tasks: LeRobot {their_tasks}, ours {ours['tasks']}")

    # Every frame's tabular values, from LeRobot's parquet view (no video decoding).
    table = theirs.hf_dataset.with_format("numpy")
    for key in (
        "observation.state",
        "action",
        "episode_index",
        "frame_index",
        "index",
        "task_index",
    ):
        if key not in ours:
            continue
        values = np.asarray(table[key]).reshape(ours[key].shape)
        check(np.array_equal(values, ours[key]), f"{key}: all {n} frames equal")
    timestamps = np.asarray(table["timestamp"]).reshape(-1)
    check(np.array_equal(timestamps, ours["timestamp"]), "timestamp: all frames equal")

    # Decoded frames through LeRobot's __getitem__ (its timestamp -> video frame lookup).
    picks: list[int] = []
    start = 0
    for ep in ours_ds.episodes:
        if args.all_frames:
            picks += list(range(start, start + ep.length))
        else:
            picks += sorted({start, start + ep.length // 2, start + ep.length - 1})
        start += ep.length
    t0 = time.time()
    worst = {k: 0.0 for k in ours_ds.cameras}
    for i in picks:
        item = theirs[i]
        task = ours["tasks"][int(ours["task_index"][i])]
        if item["task"] != task:
            check(False, f"frame {i}: task {item['task']!r}, ours {task!r}")
        for key in ours_ds.cameras:
            frame = item[key].numpy()  # float32 [C, H, W] in [0, 1]
            frame = np.rint(frame.transpose(1, 2, 0) * 255).astype(np.int16)
            diff = np.abs(frame - ours["images"][key][i].astype(np.int16))
            worst[key] = max(worst[key], float(diff.mean()))
            if diff.mean() > args.max_pixel_error:
                check(False, f"frame {i} of {key}: mean abs difference {diff.mean():.2f}")
    for key, err in worst.items():
        check(
            err <= args.max_pixel_error,
            f"{key}: {len(picks)} frames decoded by LeRobot ({args.video_backend}) match ours "
            f"(worst mean abs difference {err:.3f} / 255)",
        )
    print(f"decoded {len(picks)} items through LeRobot in {time.time() - t0:.1f} s")

    # The same statistics through both readers (meta/stats.json, as arrays).
    stats = theirs.meta.stats or {}
    for key, ours_stats in (ours_ds.stats or {}).items():
        same = key in stats and all(
            name in stats[key]
            and np.allclose(np.asarray(stats[key][name], np.float64), np.asarray(value, np.float64))
            for name, value in ours_stats.items()
        )
        check(same, f"stats of {key}: LeRobot loads the same {sorted(ours_stats)}")

    print("PASSED" if not problems else f"FAILED: {len(problems)} problem(s)")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
