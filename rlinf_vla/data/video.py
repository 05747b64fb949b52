"""MP4 video for LeRobot datasets: encode frames with H.264, probe a file's header without
decoding it, decode a range of frames.

Encoding and decoding run the FFmpeg binary that ``imageio-ffmpeg`` ships (it decodes H.264,
HEVC and AV1, the codecs LeRobot datasets use). Frames are ``uint8 [H, W, 3]`` RGB.

Timing convention (LeRobot's): a file holds frames at a constant rate ``fps``; frame ``k`` of
the file is shown at ``k / fps`` seconds. A v3.0 file holds several episodes one after the
other, and an episode's frame ``i`` is the file's frame ``round((from_timestamp + i / fps) * fps)``.
"""

from __future__ import annotations

import struct
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["H264Encoder", "VideoProbe", "concat_mp4", "decode_frames", "probe_mp4"]

# MP4 sample-entry codes -> the codec names FFmpeg (and LeRobot's info.json) use.
_FOURCC_CODECS = {
    "avc1": "h264",
    "avc3": "h264",
    "hvc1": "hevc",
    "hev1": "hevc",
    "av01": "av1",
    "vp09": "vp9",
    "mp4v": "mpeg4",
}


def _ffmpeg() -> Any:
    try:
        import imageio_ffmpeg
    except ImportError as e:
        raise ImportError(
            "LeRobot dataset videos need the FFmpeg binary of imageio-ffmpeg: "
            "pip install 'imageio[ffmpeg]'"
        ) from e
    return imageio_ffmpeg


class H264Encoder:
    """Stream frames into one H.264 (``libx264``, ``yuv420p``) MP4 file.

    Args:
        path: the ``.mp4`` file to write.
        height, width: frame size (even: ``yuv420p`` halves the chroma planes).
        fps: frame rate.
        crf: x264's constant rate factor: 0 encodes the YUV frames losslessly, 51 is the
            worst, 18 is usually called visually lossless. Decoded frames differ from the
            originals by the codec's loss and by the RGB -> YUV 4:2:0 -> RGB conversion (which
            dominates at the default: on smooth 128 px images with sensor noise, crf 12 gave a
            mean absolute error of 3.6 / 255 and crf 5 gave 3.4, at 6.5 and 10.5 kB a frame).
        preset: x264's speed/size trade-off.
        gop: keyframe interval in frames. Small values let a reader seek to any frame quickly
            (LeRobot's own encoder uses 2), at the cost of size.
    """

    def __init__(
        self,
        path: str | Path,
        height: int,
        width: int,
        fps: int,
        crf: int = 12,
        preset: str = "fast",
        gop: int = 2,
    ) -> None:
        if height % 2 or width % 2:
            raise ValueError(
                f"H.264 in yuv420p needs an even frame size, got {height}x{width} (HxW): "
                "crop or pad the images"
            )
        self.path = Path(path)
        self.height, self.width = height, width
        self.frames = 0
        self._gen = _ffmpeg().write_frames(
            str(self.path),
            (width, height),
            fps=fps,
            codec="libx264",
            pix_fmt_in="rgb24",
            pix_fmt_out="yuv420p",
            quality=None,
            macro_block_size=1,
            ffmpeg_log_level="error",
            output_params=[
                "-crf", str(crf),
                "-preset", preset,
                "-g", str(gop),
                # no B-frames: presentation order = decoding order, first frame at t = 0
                "-bf", "0",
                "-movflags", "+faststart",
            ],
        )  # fmt: skip
        self._gen.send(None)

    def write(self, frames: np.ndarray) -> None:
        """Append ``uint8 [T, H, W, 3]`` frames."""
        if frames.dtype != np.uint8 or frames.shape[1:] != (self.height, self.width, 3):
            raise ValueError(
                f"{self.path.name}: frames must be uint8 [T, {self.height}, {self.width}, 3], "
                f"got {frames.dtype} {list(frames.shape)}"
            )
        for frame in frames:
            self._gen.send(np.ascontiguousarray(frame))
        self.frames += len(frames)

    def close(self) -> None:
        """Finish the file (waits for FFmpeg)."""
        if self._gen is not None:
            self._gen.close()
            self._gen = None


def concat_mp4(inputs: Sequence[Path], output: Path) -> None:
    """Join MP4 files of the same codec settings into ``output`` without re-encoding (FFmpeg's
    concat demuxer, stream copy): each file's frames follow the previous file's, on one
    timeline. The inputs must lie in one folder."""
    folder = inputs[0].parent
    if any(p.parent != folder for p in inputs):
        raise ValueError("concat_mp4: the inputs must lie in one folder")
    listing = folder / f"{output.stem}.ffconcat"
    lines = ["ffconcat version 1.0"]
    lines += ["file '" + p.name.replace("'", "'\\''") + "'" for p in inputs]
    listing.write_text("\n".join(lines) + "\n")
    cmd = [
        _ffmpeg().get_ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-nostdin", "-y",
        "-f", "concat", "-safe", "0", "-i", str(listing),
        "-map", "0:v:0", "-c", "copy", "-movflags", "+faststart", str(output),
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        listing.unlink(missing_ok=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"FFmpeg could not join {len(inputs)} videos into {output}: {done.stderr.strip()}"
        )


@dataclass(frozen=True)
class VideoProbe:
    """What an MP4 file's header says about its (first) video track.

    Attributes:
        frames: number of coded frames (``None`` for a fragmented MP4, whose header does not
            list them).
        width, height: frame size in pixels.
        codec: FFmpeg's codec name (``h264``, ``av1``, ``hevc``...) or the raw sample-entry code.
        duration_s: the track's duration.
    """

    frames: int | None
    width: int
    height: int
    codec: str
    duration_s: float


def _boxes(data: bytes, start: int, end: int) -> Iterator[tuple[str, int, int]]:
    """ISO-BMFF boxes in ``data[start:end]``: ``(type, payload_start, box_end)``."""
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        header = 8
        if size == 1:
            if pos + 16 > end:
                return
            size = struct.unpack(">Q", data[pos + 8 : pos + 16])[0]
            header = 16
        elif size == 0:
            size = end - pos
        if size < header or pos + size > end:
            return
        yield kind.decode("latin-1"), pos + header, pos + size
        pos += size


def _child(data: bytes, start: int, end: int, kind: str) -> tuple[int, int] | None:
    for k, s, e in _boxes(data, start, end):
        if k == kind:
            return s, e
    return None


def _read_moov(path: Path) -> bytes:
    """The ``moov`` box of an MP4 file (read without loading the media data)."""
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        pos = 0
        while pos + 8 <= size:
            f.seek(pos)
            header = f.read(16)
            box_size, kind = struct.unpack(">I4s", header[:8])
            header_len = 8
            if box_size == 1:
                box_size = struct.unpack(">Q", header[8:16])[0]
                header_len = 16
            elif box_size == 0:
                box_size = size - pos
            if box_size < header_len:
                break
            if kind == b"moov":
                f.seek(pos)
                return f.read(box_size)
            pos += box_size
    raise ValueError("no 'moov' box: not an MP4 file, or the file was not finished")


def probe_mp4(path: str | Path) -> VideoProbe:
    """Read an MP4 file's header: frame count, size, codec and duration of its video track.

    Raises:
        ValueError: not an MP4 file, or no video track.
    """
    path = Path(path)
    moov = _read_moov(path)
    for kind, s, e in _boxes(moov, 8, len(moov)):
        if kind != "trak":
            continue
        mdia = _child(moov, s, e, "mdia")
        if mdia is None:
            continue
        hdlr = _child(moov, *mdia, "hdlr")
        if hdlr is None or moov[hdlr[0] + 8 : hdlr[0] + 12] != b"vide":
            continue
        mdhd = _child(moov, *mdia, "mdhd")
        duration_s = 0.0
        if mdhd is not None:
            version = moov[mdhd[0]]
            if version == 1:
                timescale, duration = struct.unpack(">IQ", moov[mdhd[0] + 20 : mdhd[0] + 32])
            else:
                timescale, duration = struct.unpack(">II", moov[mdhd[0] + 12 : mdhd[0] + 20])
            duration_s = duration / timescale if timescale else 0.0
        minf = _child(moov, *mdia, "minf")
        stbl = _child(moov, *minf, "stbl") if minf else None
        if stbl is None:
            continue
        frames = None
        stsz = _child(moov, *stbl, "stsz")
        stz2 = _child(moov, *stbl, "stz2")
        if stsz is not None:
            frames = struct.unpack(">I", moov[stsz[0] + 8 : stsz[0] + 12])[0]
        elif stz2 is not None:
            frames = struct.unpack(">I", moov[stz2[0] + 8 : stz2[0] + 12])[0]
        if frames == 0:
            frames = None  # fragmented MP4: the samples are listed in the fragments
        stsd = _child(moov, *stbl, "stsd")
        codec, width, height = "?", 0, 0
        if stsd is not None:
            entries = list(_boxes(moov, stsd[0] + 8, stsd[1]))
            if entries:
                fourcc, es, _ = entries[0]
                codec = _FOURCC_CODECS.get(fourcc, fourcc)
                # VisualSampleEntry: 6 reserved, 2 data_reference_index, 16 pre-defined, w, h
                width, height = struct.unpack(">HH", moov[es + 24 : es + 28])
        return VideoProbe(frames, width, height, codec, duration_s)
    raise ValueError("no video track")


def decode_frames(
    path: str | Path,
    height: int,
    width: int,
    start: int = 0,
    count: int | None = None,
    fps: float | None = None,
) -> np.ndarray:
    """Decode frames ``start .. start + count - 1`` of a video as ``uint8 [n, H, W, 3]``.

    Every coded frame comes out once, in presentation order (no frame-rate conversion). A
    non-zero ``start`` seeks to ``start / fps`` seconds (``fps`` is then required): FFmpeg
    decodes from the keyframe before it and drops the frames before it.
    ``count=None`` decodes to the end. Fewer frames come back when the file has fewer.
    """
    ff = _ffmpeg()
    input_params: list[str] = []
    if start:
        if not fps:
            raise ValueError("decoding from a frame other than the first needs the frame rate")
        # half a frame early: lands on frame `start` whatever the rounding of its timestamp
        input_params = ["-ss", f"{(start - 0.5) / fps:.6f}"]
    output_params = ["-fps_mode", "passthrough"]
    if count is not None:
        output_params += ["-frames:v", str(count)]
    frame_bytes = height * width * 3
    frames: list[np.ndarray] = []
    gen = ff.read_frames(
        str(path), pix_fmt="rgb24", input_params=input_params, output_params=output_params
    )
    try:
        meta = gen.__next__()
        size = tuple(meta.get("size") or (width, height))
        if size != (width, height):
            raise ValueError(
                f"{path}: frames are {size[1]}x{size[0]} (HxW), expected {height}x{width}"
            )
        for raw in gen:
            if len(raw) != frame_bytes:
                break
            frames.append(np.frombuffer(raw, np.uint8).reshape(height, width, 3))
    finally:
        gen.close()
    if not frames:
        return np.zeros((0, height, width, 3), np.uint8)
    return np.stack(frames)
