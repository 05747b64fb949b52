"""LeRobotDataset folders: what the writer writes (v3.0) is what the reader gives back, in the
layout LeRobot's source defines; v2.1 folders built here by hand read too; malformed folders
fail on open naming the file; deploy recordings export.

The layout facts asserted here are written out from LeRobot's source (``lerobot.datasets``:
``utils.py`` path templates and defaults, ``dataset_metadata.py`` / ``dataset_writer.py``
episode columns, ``compute_stats.py`` stat names and shapes, ``constants.py``
DEFAULT_FEATURES), not taken from this package's constants.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("imageio_ffmpeg")

from rlinf_vla.data import (  # noqa: E402
    DatasetError,
    LeRobotWriter,
    export_recordings,
    open_dataset,
)

FPS = 10
CAMERAS = {"main": (48, 64), "wrist": (32, 32)}
LENGTHS = [6, 11, 4]
TASKS = ["pick the cube", "open the drawer", "pick the cube"]
STEP = 9  # channel 0 of frame t is 20 + STEP * t (+ the episode's offset): it encodes t


def smooth_frames(t: int, h: int, w: int, offset: int = 0) -> np.ndarray:
    """``uint8 [t, h, w, 3]``: smooth images (video codecs keep them well); channel 0 is flat
    at ``20 + offset + STEP * i`` so a decoded frame tells which frame it is."""
    yy, xx = np.mgrid[0:h, 0:w]
    frames = np.empty((t, h, w, 3), np.uint8)
    for i in range(t):
        frames[i, ..., 0] = 20 + offset + STEP * i
        frames[i, ..., 1] = 40 + (150 * yy) // h
        frames[i, ..., 2] = 200 - (120 * xx) // w
    return frames


def make_episodes(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    episodes = []
    for e, (t, task) in enumerate(zip(LENGTHS, TASKS, strict=True)):
        episodes.append(
            {
                "images": {
                    cam: smooth_frames(t, h, w, offset=3 * e) for cam, (h, w) in CAMERAS.items()
                },
                "state": rng.normal(size=(t, 8)).astype(np.float32),
                "action": rng.uniform(-1, 1, size=(t, 7)).astype(np.float32),
                "task": task,
            }
        )
    return episodes


def write(root: Path, episodes: list[dict], **kwargs) -> Path:
    writer = LeRobotWriter(root, FPS, CAMERAS, 8, 7, robot_type="panda", **kwargs)
    for ep in episodes:
        writer.add_episode(ep["images"], ep["state"], ep["action"], ep["task"])
    return writer.close()


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, list[dict]]:
    episodes = make_episodes()
    return write(tmp_path_factory.mktemp("lerobot") / "ds", episodes), episodes


def _frame_ids(frames: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return np.rint((frames[..., 0].mean(axis=(1, 2)) - 20 - offsets) / STEP).astype(int)


# -- round trip ------------------------------------------------------------------------------


def test_round_trip(written):
    root, episodes = written
    ds = open_dataset(root)
    assert ds.version == "v3.0" and ds.fps == FPS and ds.robot_type == "panda"
    assert ds.cameras == ["observation.images.main", "observation.images.wrist"]
    assert ds.tasks == ["pick the cube", "open the drawer"]
    assert [(e.index, e.length, e.task) for e in ds.episodes] == [
        (0, 6, "pick the cube"),
        (1, 11, "open the drawer"),
        (2, 4, "pick the cube"),
    ]
    assert ds.features["observation.state"]["shape"] == [8]

    d = ds.load()
    n = sum(LENGTHS)
    np.testing.assert_array_equal(
        d["observation.state"], np.concatenate([e["state"] for e in episodes])
    )
    np.testing.assert_array_equal(d["action"], np.concatenate([e["action"] for e in episodes]))
    assert d["observation.state"].dtype == np.float32 and d["action"].dtype == np.float32
    np.testing.assert_array_equal(d["episode_index"], np.repeat([0, 1, 2], LENGTHS))
    np.testing.assert_array_equal(d["frame_index"], np.concatenate([np.arange(t) for t in LENGTHS]))
    np.testing.assert_array_equal(d["index"], np.arange(n))
    np.testing.assert_array_equal(d["task_index"], np.repeat([0, 1, 0], LENGTHS))
    np.testing.assert_array_equal(d["timestamp"], (d["frame_index"] / FPS).astype(np.float32))
    assert d["tasks"] == ["pick the cube", "open the drawer"]

    offsets = 3 * d["episode_index"]
    for cam, (h, w) in CAMERAS.items():
        got = d["images"][f"observation.images.{cam}"]
        want = np.concatenate([e["images"][cam] for e in episodes])
        assert got.shape == (n, h, w, 3) and got.dtype == np.uint8
        assert np.abs(got.astype(int) - want).mean() < 3.0, cam  # H.264 + 4:2:0, in 0..255
        # every frame is the right one (order within and across the concatenated episodes)
        np.testing.assert_array_equal(_frame_ids(got, offsets), d["frame_index"])


def test_load_some_episodes_in_the_order_asked(written):
    root, _ = written
    ds = open_dataset(root)
    full = ds.load()
    part = ds.load([2, 0])
    rows = np.concatenate([np.arange(17, 21), np.arange(0, 6)])
    for key in ("observation.state", "action", "episode_index", "frame_index", "index"):
        np.testing.assert_array_equal(part[key], full[key][rows])
    for key, frames in part["images"].items():
        np.testing.assert_array_equal(
            frames, full["images"][key][rows]
        )  # same decoder, same frames
    with pytest.raises(KeyError, match="no episode 7"):
        ds.load([7])


# -- stats -----------------------------------------------------------------------------------

QS = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}  # LeRobot's


def _numpy_stats(x: np.ndarray) -> dict[str, np.ndarray]:
    x = x.astype(np.float64)
    out = {"min": x.min(0), "max": x.max(0), "mean": x.mean(0), "std": x.std(0)}
    out.update({k: np.quantile(x, q, axis=0) for k, q in QS.items()})
    return out


def test_stats_equal_numpy(written):
    root, episodes = written
    stats = json.loads((root / "meta/stats.json").read_text())
    n = sum(LENGTHS)
    for key in ("observation.state", "action"):
        want = _numpy_stats(np.concatenate([e[key.split(".")[-1]] for e in episodes]))
        assert set(stats[key]) == {"min", "max", "mean", "std", "count", *QS}
        assert stats[key]["count"] == [n]
        for stat, value in want.items():
            np.testing.assert_allclose(
                stats[key][stat], value, rtol=1e-6, atol=1e-7, err_msg=f"{key} {stat}"
            )
    for cam in CAMERAS:
        key = f"observation.images.{cam}"
        pixels = np.concatenate([e["images"][cam] for e in episodes]).reshape(-1, 3) / 255.0
        want = _numpy_stats(pixels)
        assert stats[key]["count"] == [n]
        for stat, value in want.items():
            got = np.asarray(stats[key][stat])
            assert got.shape == (3, 1, 1), (key, stat)  # per channel, LeRobot's image layout
            np.testing.assert_allclose(
                got.ravel(), value, rtol=1e-9, atol=1e-12, err_msg=f"{key} {stat}"
            )
    np.testing.assert_allclose(stats["frame_index"]["max"], [10])
    np.testing.assert_allclose(stats["index"]["mean"], [(n - 1) / 2])

    # per-episode stats in the episodes table
    table = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    ep1 = episodes[1]
    for stat, value in _numpy_stats(ep1["action"]).items():
        np.testing.assert_allclose(table[1][f"stats/action/{stat}"], value, rtol=1e-6, atol=1e-7)
    assert table[1]["stats/action/count"] == [11]
    img = _numpy_stats(ep1["images"]["wrist"].reshape(-1, 3) / 255.0)
    np.testing.assert_allclose(
        np.asarray(table[1]["stats/observation.images.wrist/mean"]).ravel(), img["mean"]
    )

    ds = open_dataset(root)
    np.testing.assert_allclose(ds.stats["action"]["q99"], stats["action"]["q99"])


# -- the v3.0 layout, as LeRobot's source defines it -----------------------------------------


def test_v30_files_follow_lerobot(written):
    root, _ = written
    info = json.loads((root / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0"
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert (
        info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    )
    assert (info["chunks_size"], info["data_files_size_in_mb"], info["video_files_size_in_mb"]) == (
        1000,
        100,
        200,
    )
    assert (info["fps"], info["robot_type"]) == (10, "panda")
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (3, 21, 2)
    assert info["splits"] == {"train": "0:3"}
    # LeRobot's DatasetInfo fields, nothing else (it warns about unknown ones)
    assert set(info) <= {
        "codebase_version", "fps", "features", "total_episodes", "total_frames", "total_tasks",
        "chunks_size", "data_files_size_in_mb", "video_files_size_in_mb", "data_path",
        "video_path", "robot_type", "splits", "tools",
    }  # fmt: skip
    f = info["features"]
    assert set(f) == {
        "observation.images.main", "observation.images.wrist", "observation.state", "action",
        "timestamp", "frame_index", "episode_index", "index", "task_index",
    }  # fmt: skip
    main = f["observation.images.main"]
    assert (main["dtype"], main["shape"], main["names"]) == (
        "video",
        [48, 64, 3],
        ["height", "width", "channels"],
    )
    assert main["info"]["video.codec"] == "h264" and main["info"]["video.pix_fmt"] == "yuv420p"
    assert (main["info"]["video.height"], main["info"]["video.width"]) == (48, 64)
    assert main["info"]["video.fps"] == 10 and main["info"]["has_audio"] is False
    assert (f["observation.state"]["dtype"], f["observation.state"]["shape"]) == ("float32", [8])
    assert (f["action"]["dtype"], f["action"]["shape"]) == ("float32", [7])
    assert len(f["action"]["names"]) == 7
    assert f["timestamp"] == {"dtype": "float32", "shape": [1], "names": None}
    for k in ("frame_index", "episode_index", "index", "task_index"):
        assert f[k] == {"dtype": "int64", "shape": [1], "names": None}

    # tasks.parquet: task_index, with the task string as the pandas index
    tasks = pq.read_table(root / "meta/tasks.parquet")
    assert tasks.column("task_index").to_pylist() == [0, 1]
    assert tasks.column("task").to_pylist() == ["pick the cube", "open the drawer"]
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["task"]

    eps = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [e["episode_index"] for e in eps] == [0, 1, 2]
    assert [e["tasks"] for e in eps] == [[t] for t in TASKS]
    assert [e["length"] for e in eps] == LENGTHS
    assert [(e["dataset_from_index"], e["dataset_to_index"]) for e in eps] == [
        (0, 6),
        (6, 17),
        (17, 21),
    ]
    assert all(e["data/chunk_index"] == 0 and e["data/file_index"] == 0 for e in eps)
    assert all(
        e["meta/episodes/chunk_index"] == 0 and e["meta/episodes/file_index"] == 0 for e in eps
    )
    for cam in CAMERAS:
        v = f"videos/observation.images.{cam}/"
        assert [(e[v + "chunk_index"], e[v + "file_index"]) for e in eps] == [(0, 0)] * 3
        assert [(e[v + "from_timestamp"], e[v + "to_timestamp"]) for e in eps] == [
            pytest.approx((0.0, 0.6)),
            pytest.approx((0.6, 1.7)),
            pytest.approx((1.7, 2.1)),
        ]
        assert (root / f"videos/observation.images.{cam}/chunk-000/file-000.mp4").is_file()
    stat_cols = {k for k in eps[0] if k.startswith("stats/")}
    for feat in ("observation.state", "action", "observation.images.main", "timestamp", "index"):
        assert {
            f"stats/{feat}/{s}" for s in ("min", "max", "mean", "std", "count", *QS)
        } <= stat_cols

    data = pq.read_table(root / "data/chunk-000/file-000.parquet")
    assert data.column_names == [
        "observation.state", "action", "timestamp", "frame_index", "episode_index", "index",
        "task_index",
    ]  # fmt: skip
    assert data.schema.field("observation.state").type == pa.list_(pa.float32(), 8)
    assert data.schema.field("timestamp").type == pa.float32()
    assert data.schema.field("index").type == pa.int64()
    assert pq.ParquetFile(root / "data/chunk-000/file-000.parquet").num_row_groups == 3
    assert not [p.name for p in root.parent.iterdir() if p.name.startswith(".")]  # no temp left


def test_files_roll_over_and_read_back(tmp_path):
    episodes = make_episodes(seed=1)
    # tiny limits: every episode starts a new data and video file; two files per chunk folder
    root = write(
        tmp_path / "ds", episodes, chunks_size=2, data_file_size_mb=1e-6, video_file_size_mb=1e-6
    )
    assert sorted(str(p.relative_to(root)) for p in root.glob("data/*/*.parquet")) == [
        "data/chunk-000/file-000.parquet",
        "data/chunk-000/file-001.parquet",
        "data/chunk-001/file-000.parquet",
    ]
    assert len(list(root.glob("videos/observation.images.main/*/*.mp4"))) == 3
    eps = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [(e["data/chunk_index"], e["data/file_index"]) for e in eps] == [(0, 0), (0, 1), (1, 0)]
    assert [e["videos/observation.images.main/from_timestamp"] for e in eps] == [0.0] * 3
    d = open_dataset(root).load()
    np.testing.assert_array_equal(d["action"], np.concatenate([e["action"] for e in episodes]))
    frames = d["images"]["observation.images.main"]
    np.testing.assert_array_equal(_frame_ids(frames, 3 * d["episode_index"]), d["frame_index"])


# -- writer safety ---------------------------------------------------------------------------


def test_writer_refuses_and_cleans_up(tmp_path):
    ep = make_episodes()[0]
    root = tmp_path / "ds"
    root.mkdir()
    (root / "keep.txt").write_text("old")
    with pytest.raises(FileExistsError, match="overwrite"):
        LeRobotWriter(root, FPS, CAMERAS, 8, 7)

    # overwrite: the old content stays until the new dataset is complete
    writer = LeRobotWriter(root, FPS, CAMERAS, 8, 7, overwrite=True)
    writer.add_episode(ep["images"], ep["state"], ep["action"], ep["task"])
    assert (root / "keep.txt").exists() and not (root / "meta").exists()
    # a bad episode is refused before anything is written; the writer goes on
    with pytest.raises(ValueError, match="finite"):
        writer.add_episode(ep["images"], ep["state"] * np.nan, ep["action"], "x")
    with pytest.raises(ValueError, match="camera 'main'"):
        writer.add_episode(
            {**ep["images"], "main": ep["images"]["main"][:, :40]}, ep["state"], ep["action"], "x"
        )
    with pytest.raises(ValueError, match="cameras"):
        writer.add_episode({"main": ep["images"]["main"]}, ep["state"], ep["action"], "x")
    with pytest.raises(ValueError, match="action"):
        writer.add_episode(ep["images"], ep["state"], ep["action"][:-1], "x")
    writer.close()
    assert not (root / "keep.txt").exists() and open_dataset(root).num_frames == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]

    # an exception inside `with` discards everything
    with (
        pytest.raises(RuntimeError, match="boom"),
        LeRobotWriter(tmp_path / "new", FPS, CAMERAS, 8, 7) as w,
    ):
        w.add_episode(ep["images"], ep["state"], ep["action"], ep["task"])
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]

    with pytest.raises(ValueError, match="no episode"):
        LeRobotWriter(tmp_path / "empty", FPS, CAMERAS, 8, 7).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    with pytest.raises(ValueError, match="even"):
        LeRobotWriter(tmp_path / "odd", FPS, {"main": (31, 32)}, 8, 7)
    with pytest.raises(ValueError, match="fps"):
        LeRobotWriter(tmp_path / "fps", 7.5, CAMERAS, 8, 7)


# -- v2.1 ------------------------------------------------------------------------------------


def _png(img: np.ndarray) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def test_reads_a_hand_built_v21_folder(tmp_path):
    """Written here with pyarrow and imageio only, in v2.1's layout: per-episode parquet and
    MP4 files, JSON-lines metadata, a video camera and an image camera (PNG in the rows)."""
    import imageio.v2 as imageio

    root = tmp_path / "v21"
    rng = np.random.default_rng(3)
    lengths, h, w = [5, 8], 32, 48
    info = {
        "codebase_version": "v2.1",
        "robot_type": "aloha",
        "total_episodes": 2,
        "total_frames": 13,
        "total_tasks": 2,
        "total_videos": 2,
        "total_chunks": 1,
        "chunks_size": 1000,
        "fps": 10,
        "splits": {"train": "0:2"},
        "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
        "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4",
        "features": {
            "observation.images.top": {
                "dtype": "video",
                "shape": [h, w, 3],
                "names": ["height", "width", "channels"],
                "info": {
                    "video.fps": 10.0,
                    "video.height": h,
                    "video.width": w,
                    "video.channels": 3,
                    "video.codec": "h264",
                    "video.pix_fmt": "yuv420p",
                    "video.is_depth_map": False,
                    "has_audio": False,
                },
            },
            "observation.images.wrist": {
                "dtype": "image",
                "shape": [16, 16, 3],
                "names": ["height", "width", "channel"],
            },
            "observation.state": {"dtype": "float32", "shape": [4], "names": ["a", "b", "c", "d"]},
            "action": {"dtype": "float32", "shape": [2], "names": ["x", "y"]},
            "timestamp": {"dtype": "float32", "shape": [1], "names": None},
            "frame_index": {"dtype": "int64", "shape": [1], "names": None},
            "episode_index": {"dtype": "int64", "shape": [1], "names": None},
            "index": {"dtype": "int64", "shape": [1], "names": None},
            "task_index": {"dtype": "int64", "shape": [1], "names": None},
        },
    }
    (root / "meta").mkdir(parents=True)
    (root / "meta/info.json").write_text(json.dumps(info))
    (root / "meta/tasks.jsonl").write_text(
        '{"task_index": 0, "task": "fold"}\n{"task_index": 1, "task": "unfold"}\n'
    )
    (root / "meta/episodes.jsonl").write_text(
        '{"episode_index": 0, "tasks": ["fold"], "length": 5}\n'
        '{"episode_index": 1, "tasks": ["unfold"], "length": 8}\n'
    )
    states, tops, wrists, stats_lines, start = [], [], [], [], 0
    for e, t in enumerate(lengths):
        state = rng.normal(size=(t, 4)).astype(np.float32)
        action = rng.normal(size=(t, 2)).astype(np.float32)
        top = smooth_frames(t, h, w, offset=5 * e)
        wrist = rng.integers(0, 256, size=(t, 16, 16, 3), dtype=np.uint8)
        table = pa.table(
            {
                "observation.images.wrist": pa.array(
                    [
                        {"bytes": _png(im), "path": f"frame_{i:06d}.png"}
                        for i, im in enumerate(wrist)
                    ],
                    pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
                ),
                "observation.state": pa.array(list(state), pa.list_(pa.float32())),
                "action": pa.array(list(action), pa.list_(pa.float32())),
                "timestamp": pa.array(np.arange(t, dtype=np.float32) / 10),
                "frame_index": pa.array(np.arange(t)),
                "episode_index": pa.array(np.full(t, e)),
                "index": pa.array(np.arange(start, start + t)),
                "task_index": pa.array(np.full(t, e)),
            }
        )
        path = root / f"data/chunk-000/episode_{e:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        video = root / f"videos/chunk-000/observation.images.top/episode_{e:06d}.mp4"
        video.parent.mkdir(parents=True, exist_ok=True)
        with imageio.get_writer(
            video, fps=10, codec="libx264", quality=9, macro_block_size=1
        ) as vw:
            for frame in top:
                vw.append_data(frame)
        s = state.astype(np.float64)
        stats = {
            "observation.state": {
                "min": s.min(0).tolist(),
                "max": s.max(0).tolist(),
                "mean": s.mean(0).tolist(),
                "std": s.std(0).tolist(),
                "count": [t],
            }
        }
        stats_lines.append(json.dumps({"episode_index": e, "stats": stats}))
        states.append(state)
        tops.append(top)
        wrists.append(wrist)
        start += t
    (root / "meta/episodes_stats.jsonl").write_text("\n".join(stats_lines) + "\n")

    ds = open_dataset(root)
    assert ds.version == "v2.1" and ds.fps == 10 and ds.robot_type == "aloha"
    assert ds.cameras == ["observation.images.top", "observation.images.wrist"]
    assert [(e.index, e.length, e.task) for e in ds.episodes] == [(0, 5, "fold"), (1, 8, "unfold")]
    d = ds.load()
    np.testing.assert_array_equal(d["observation.state"], np.concatenate(states))
    assert d["action"].shape == (13, 2) and d["task_index"].tolist() == [0] * 5 + [1] * 8
    np.testing.assert_array_equal(d["images"]["observation.images.wrist"], np.concatenate(wrists))
    top = d["images"]["observation.images.top"]
    assert np.abs(top.astype(int) - np.concatenate(tops)).mean() < 3.0
    np.testing.assert_array_equal(_frame_ids(top, 5 * d["episode_index"]), d["frame_index"])
    # no stats.json: merged from episodes_stats.jsonl
    all_states = np.concatenate(states).astype(np.float64)
    np.testing.assert_allclose(ds.stats["observation.state"]["mean"], all_states.mean(0), rtol=1e-6)
    np.testing.assert_allclose(ds.stats["observation.state"]["std"], all_states.std(0), rtol=1e-6)
    np.testing.assert_allclose(ds.stats["observation.state"]["min"], all_states.min(0))
    assert ds.stats["observation.state"]["count"].tolist() == [13]
    part = ds.load([1])
    np.testing.assert_array_equal(part["observation.state"], states[1])


# -- malformed folders -----------------------------------------------------------------------


def _shorter_video(path: Path) -> None:
    import imageio.v2 as imageio

    with imageio.get_writer(path, fps=FPS, codec="libx264", macro_block_size=1) as vw:
        for frame in smooth_frames(20, 48, 64):
            vw.append_data(frame)


def _fewer_rows(path: Path) -> None:
    table = pq.read_table(path)
    pq.write_table(table.slice(0, table.num_rows - 1), path)


def _edit_info(**changes):
    def edit(root: Path) -> None:
        info = json.loads((root / "meta/info.json").read_text())
        info.update(changes)
        (root / "meta/info.json").write_text(json.dumps(info))

    return edit


BREAKAGES = {
    "no info.json": (lambda r: (r / "meta/info.json").unlink(), r"meta/info\.json: missing"),
    "bad json": (
        lambda r: (r / "meta/info.json").write_text("{"),
        r"meta/info\.json: not valid JSON",
    ),
    "old version": (
        _edit_info(codebase_version="v2.0"),
        r"unsupported codebase_version 'v2\.0' \(supported: v2\.1, v3\.0\)",
    ),
    "total_frames": (_edit_info(total_frames=99), "total_frames is 99"),
    "no tasks": (lambda r: (r / "meta/tasks.parquet").unlink(), r"meta/tasks\.parquet: missing"),
    "bad tasks": (
        lambda r: (r / "meta/tasks.parquet").write_bytes(b"not parquet"),
        r"meta/tasks\.parquet: not a readable parquet file",
    ),
    "no episodes": (
        lambda r: shutil.rmtree(r / "meta/episodes"),
        r"meta/episodes: no episodes parquet file",
    ),
    "no data": (
        lambda r: (r / "data/chunk-000/file-000.parquet").unlink(),
        r"data/chunk-000/file-000\.parquet: missing",
    ),
    "short data": (
        lambda r: _fewer_rows(r / "data/chunk-000/file-000.parquet"),
        r"file-000\.parquet: 20 rows, its episodes have 21 frames",
    ),
    "no video": (
        lambda r: (r / "videos/observation.images.wrist/chunk-000/file-000.mp4").unlink(),
        r"observation\.images\.wrist/chunk-000/file-000\.mp4: missing",
    ),
    "short video": (
        lambda r: _shorter_video(r / "videos/observation.images.main/chunk-000/file-000.mp4"),
        r"file-000\.mp4: 20 frames, the data of its episodes needs 21 "
        r"\(frame count mismatch between data and video\)",
    ),
    "not a video": (
        lambda r: (r / "videos/observation.images.main/chunk-000/file-000.mp4").write_bytes(
            b"x" * 64
        ),
        r"file-000\.mp4: unreadable MP4 header",
    ),
}


@pytest.mark.parametrize("case", list(BREAKAGES))
def test_malformed_folders_fail_on_open(written, tmp_path, case):
    root = shutil.copytree(written[0], tmp_path / "ds")
    breakage, message = BREAKAGES[case]
    breakage(root)
    with pytest.raises(DatasetError, match=message):
        open_dataset(root)


def test_not_a_dataset(tmp_path):
    with pytest.raises(DatasetError, match="not a folder"):
        open_dataset(tmp_path / "nothing")
    with pytest.raises(DatasetError, match="not a LeRobotDataset folder"):
        open_dataset(tmp_path)


# -- deploy recordings -----------------------------------------------------------------------


def _record(folder: Path, steps: int, instruction: str, seed: int, video: str = "mp4"):
    from rlinf_vla.real_robot.recording import EpisodeWriter

    rng = np.random.default_rng(seed)
    writer = EpisodeWriter(
        folder, ["main", "wrist"], video=video, fps=10.0,
        meta={"instruction": instruction, "robot": {"name": "sim_panda"}},
    )  # fmt: skip
    main, wrist = smooth_frames(steps, 32, 48, offset=seed), smooth_frames(steps, 16, 16)
    for t in range(steps):
        writer.add(
            timestamp=writer._t0 + 0.1 * t,
            images={"main": main[t], "wrist": wrist[t]},
            state=rng.normal(size=8).astype(np.float32),
            joint_positions=rng.normal(size=7),
            ee_pos=rng.normal(size=3),
            ee_rotvec=rng.normal(size=3),
            gripper_width=0.04,
            policy_action=rng.normal(size=7),
            action=rng.normal(size=7),
            hold=False,
            interventions=[],
        )
    return writer.close()


def test_export_recordings(tmp_path):
    from rlinf_vla.real_robot.recording import read_episode

    folders = [
        _record(tmp_path / "rec/a", 7, "put the cup away", seed=1),
        _record(tmp_path / "rec/b", 5, "wipe the table", seed=2, video="png"),
        _record(tmp_path / "rec/empty", 0, "nothing", seed=3),  # no steps: skipped
    ]
    root = export_recordings(folders, tmp_path / "out", fps=None)
    ds = open_dataset(root)
    assert ds.fps == 10 and ds.robot_type == "sim_panda"
    assert ds.tasks == ["put the cup away", "wipe the table"]
    assert ds.features["observation.state"]["names"][0] == "tcp_x"
    assert ds.features["action"]["names"][-1] == "gripper"
    d = ds.load()
    recs = [read_episode(f) for f in folders[:2]]
    np.testing.assert_array_equal(
        d["observation.state"], np.concatenate([r.steps["state"] for r in recs])
    )
    np.testing.assert_array_equal(d["action"], np.concatenate([r.steps["action"] for r in recs]))
    for cam in ("main", "wrist"):
        want = np.concatenate([r.images[cam] for r in recs])
        assert np.abs(d["images"][f"observation.images.{cam}"].astype(int) - want).mean() < 3.0

    with pytest.raises(FileExistsError):
        export_recordings(folders[:1], root)
    other = tmp_path / "rec/c"
    from rlinf_vla.real_robot.recording import EpisodeWriter

    EpisodeWriter(other, ["main"], fps=10.0, meta={"instruction": "x"}).close()
    with pytest.raises(ValueError, match="different cameras"):
        export_recordings([folders[0], other], tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_export_episodes_command_takes_a_deploy_folder(tmp_path, capsys):
    from rlinf_vla import cli

    _record(tmp_path / "episodes/20261126-1-ep000", 4, "put the cup away", seed=1)
    _record(tmp_path / "episodes/20261126-2-ep001", 3, "wipe the table", seed=2)
    out = tmp_path / "ds"
    assert cli.main(["export-episodes", str(tmp_path / "episodes"), "-o", str(out)]) == 0
    ds = open_dataset(out)
    assert [e.length for e in ds.episodes] == [4, 3]
    assert ds.tasks == ["put the cup away", "wipe the table"]
    # a second export into the same folder is refused, naming it
    assert cli.main(["export-episodes", str(tmp_path / "episodes"), "-o", str(out)]) == 2
    assert str(out) in capsys.readouterr().err
    assert cli.main(["export-episodes", str(tmp_path / "nothing"), "-o", str(out)]) == 2
    assert "no recorded episode" in capsys.readouterr().err


def _damage(folder, how):
    """Break one recorded episode ``folder`` the way a crash or a full disk leaves it."""
    import json as _json

    if how == "truncated steps.npz":
        data = (folder / "steps.npz").read_bytes()
        (folder / "steps.npz").write_bytes(data[: len(data) // 2])
    elif how == "steps.npz without actions":
        with np.load(folder / "steps.npz") as f:
            kept = {k: f[k] for k in f.files if k != "action"}
        np.savez(folder / "steps.npz", **kept)
    elif how == "meta.json is a list":
        (folder / "meta.json").write_text("[1, 2]")
    elif how == "meta.json without cameras":
        meta = _json.loads((folder / "meta.json").read_text())
        del meta["cameras"]
        (folder / "meta.json").write_text(_json.dumps(meta))
    elif how == "truncated video":
        data = (folder / "main.mp4").read_bytes()
        (folder / "main.mp4").write_bytes(data[: len(data) // 3])
    elif how == "garbage video":
        (folder / "main.mp4").write_bytes(b"\x00garbage" * 100)
    return folder


DAMAGE = {
    "truncated steps.npz": "steps.npz cannot be read",
    "steps.npz without actions": "steps.npz lacks ['action']",
    "meta.json is a list": "meta.json holds a list, not a map",
    "meta.json without cameras": "meta.json's cameras must be a list of camera names",
    "truncated video": "camera 'main': its frames cannot be decoded",
    "garbage video": "camera 'main': its frames cannot be decoded",
}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_one_broken_recording_is_skipped_with_its_reason_and_the_others_export(
    tmp_path, capsys, how
):
    from rlinf_vla import cli

    _record(tmp_path / "episodes/1-ep000", 4, "put the cup away", seed=1)
    broken = _damage(_record(tmp_path / "episodes/2-ep001", 5, "wipe the table", seed=2), how)
    _record(tmp_path / "episodes/3-ep002", 3, "stack the cups", seed=3)
    out = tmp_path / "ds"
    assert cli.main(["export-episodes", str(tmp_path / "episodes"), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert f"skipped {broken}: {broken}: {DAMAGE[how]}" in err, err
    assert "Traceback" not in err and "2 episodes; 1 skipped" in captured.out
    ds = open_dataset(out)
    assert [e.length for e in ds.episodes] == [4, 3]
    assert ds.tasks == ["put the cup away", "stack the cups"]


def test_an_export_of_only_broken_recordings_fails_naming_each(tmp_path, capsys):
    from rlinf_vla import cli

    a = _damage(_record(tmp_path / "episodes/1-ep000", 4, "a", seed=1), "truncated steps.npz")
    b = _damage(_record(tmp_path / "episodes/2-ep001", 4, "b", seed=2), "meta.json is a list")
    assert (
        cli.main(["export-episodes", str(tmp_path / "episodes"), "-o", str(tmp_path / "ds")]) == 2
    )
    err = " ".join(capsys.readouterr().err.split())
    assert "no recording could be read" in err and str(a) in err and str(b) in err
    assert not (tmp_path / "ds").exists()
