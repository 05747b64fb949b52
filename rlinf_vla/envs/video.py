"""MP4 videos of chosen envs, with the instruction and the success drawn on every frame.

Used by :class:`rlinf_vla.envs.base.VectorEnv` when its config sets ``video_dir``: each recorded
env gets one file per episode, ``<prefix>_env<i>_ep<n>_<outcome>.mp4`` with ``outcome`` in
``success``, ``fail``, ``invalid`` or ``partial`` (episode still running at ``flush()``).
Files are written by a background thread; ``close()`` waits for them.
"""

from __future__ import annotations

import importlib.util
import os
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from rlinf_vla.types import Observation

_WIDTH = 320  # frames are scaled to this width (a multiple of 16, for H.264)
_TOP = 48  # bar with the instruction
_BOTTOM = 16  # bar with the step and the outcome


@dataclass
class _Episode:
    frames: list[np.ndarray] = field(default_factory=list)
    instructions: list[str] = field(default_factory=list)
    success: list[bool] = field(default_factory=list)


def annotate(frame: np.ndarray, instruction: str, step: int, success: bool) -> np.ndarray:
    """One video frame: ``frame`` (uint8 ``[H, W, 3]``) scaled up, with text bars around it."""
    from PIL import Image, ImageDraw

    h, w = frame.shape[:2]
    height = round(h * _WIDTH / w / 16) * 16 or 16
    img = Image.fromarray(np.ascontiguousarray(frame)).resize((_WIDTH, height), Image.NEAREST)
    canvas = Image.new("RGB", (_WIDTH, _TOP + height + _BOTTOM), (0, 0, 0))
    canvas.paste(img, (0, _TOP))
    draw = ImageDraw.Draw(canvas)
    lines = textwrap.wrap(instruction, width=52)[:3]
    for j, line in enumerate(lines):
        draw.text((4, 2 + 14 * j), line, fill=(255, 255, 255))
    status = "SUCCESS" if success else "running"
    color = (60, 220, 60) if success else (200, 200, 200)
    draw.text((4, _TOP + height + 2), f"step {step}", fill=(200, 200, 200))
    draw.text((_WIDTH - 60, _TOP + height + 2), status, fill=color)
    if success:
        draw.rectangle((0, _TOP, _WIDTH - 1, _TOP + height - 1), outline=(60, 220, 60), width=3)
    return np.asarray(canvas)


def require_ffmpeg(videos_off: str = "turn the videos off") -> None:
    """Fail naming the install when imageio's FFmpeg backend (``imageio-ffmpeg``) is missing.

    Without it imageio picks another plugin for ``.mp4`` and fails only at the first frame
    written, after the episodes were run.

    Args:
        videos_off: how to do without videos, for the message (e.g. a config override).
    """
    if importlib.util.find_spec("imageio_ffmpeg") is None:
        raise RuntimeError(
            "MP4 videos need imageio's FFmpeg backend, which is not installed: "
            f"pip install 'imageio[ffmpeg]', or {videos_off}"
        )


def write_mp4(path: str, frames: list[np.ndarray], fps: int) -> None:
    """Write uint8 ``[H, W, 3]`` frames (same size) to an H.264 MP4."""
    import imageio.v2 as imageio

    require_ffmpeg()
    with imageio.get_writer(
        path, format="FFMPEG", fps=fps, codec="libx264", macro_block_size=16
    ) as writer:
        for frame in frames:
            writer.append_data(frame)


class VideoRecorder:
    """Buffers the frames of envs ``env_ids`` and writes one MP4 per episode."""

    def __init__(
        self,
        out_dir: str,
        env_ids: tuple[int, ...],
        camera: str = "main",
        fps: int = 10,
        prefix: str = "env",
        env_offset: int = 0,
    ) -> None:
        require_ffmpeg()
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        self.env_ids = tuple(env_ids)
        self.camera = camera
        self.fps = fps
        self.prefix = prefix
        self.env_offset = env_offset
        self._episodes: dict[int, _Episode] = {}
        self._counts: dict[int, int] = dict.fromkeys(self.env_ids, 0)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="video")
        self._pending: list[Future] = []
        self.written: list[str] = []

    def mask(self, num_envs: int) -> torch.Tensor:
        m = torch.zeros(num_envs, dtype=torch.bool)
        m[list(self.env_ids)] = True
        return m

    def start(self, env_ids: torch.Tensor, obs: Observation) -> None:
        """Envs ``env_ids`` begin an episode whose first observation is ``obs`` (``[n]``)."""
        for j, i in enumerate(env_ids.tolist()):
            if i not in self._counts:
                continue
            if i in self._episodes:
                self._write(i, "partial")
            ep = _Episode()
            self._episodes[i] = ep
            self._append(ep, obs, j, False)

    def add(self, obs: Observation, mask: torch.Tensor, success: torch.Tensor) -> None:
        """Append the frame of every env in ``mask`` (``obs`` is the full batch)."""
        for i in torch.nonzero(mask).flatten().tolist():
            if i in self._episodes:
                self._append(self._episodes[i], obs, i, bool(success[i]))

    def end(self, env_ids: torch.Tensor, invalid: torch.Tensor) -> None:
        """Envs ``env_ids`` ended their episode; ``invalid`` is a ``[B]`` mask."""
        for i in env_ids.tolist():
            ep = self._episodes.get(i)
            if ep is None:
                continue
            outcome = "invalid" if invalid[i] else ("success" if any(ep.success) else "fail")
            self._write(i, outcome)

    def flush(self) -> None:
        for i in list(self._episodes):
            self._write(i, "partial")
        self.wait()

    def wait(self) -> None:
        for fut in self._pending:
            fut.result()
        self._pending.clear()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)

    def _append(self, ep: _Episode, obs: Observation, row: int, success: bool) -> None:
        ep.frames.append(obs.images[self.camera][row].cpu().numpy())
        ep.instructions.append(obs.instruction[row])
        ep.success.append(success)

    def _write(self, env: int, outcome: str) -> None:
        ep = self._episodes.pop(env)
        n = self._counts[env]
        self._counts[env] = n + 1
        path = os.path.join(
            self.out_dir, f"{self.prefix}_env{self.env_offset + env}_ep{n}_{outcome}.mp4"
        )
        self.written.append(path)

        def job() -> None:
            frames = [
                annotate(f, text, t, ok)
                for t, (f, text, ok) in enumerate(
                    zip(ep.frames, ep.instructions, ep.success, strict=True)
                )
            ]
            write_mp4(path, frames, self.fps)

        self._pending.append(self._pool.submit(job))
