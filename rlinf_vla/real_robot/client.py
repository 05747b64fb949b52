"""A light synchronous client of the policy server (robot side).

>>> client = PolicyClient("ws://127.0.0.1:8000", token=None)
>>> client.metadata.chunk_size, client.metadata.image_keys
(8, ('main', 'wrist'))
>>> actions, timing = client.infer({"main": img, "wrist": img2}, state, "pick up the cube")
>>> actions.shape                                  # float32 [K, A]
(8, 7)
"""

from __future__ import annotations

import contextlib
import urllib.error
import urllib.request
from typing import Any

import numpy as np

from rlinf_vla.real_robot import codec
from rlinf_vla.real_robot.protocol import PolicyMetadata

__all__ = ["PolicyClient", "ServerError", "check_health"]


class ServerError(RuntimeError):
    """The server answered a request with an error; ``reason`` says why."""

    def __init__(self, reason: str, remote_traceback: str | None = None) -> None:
        super().__init__(
            reason + (f"\n--- remote traceback ---\n{remote_traceback}" if remote_traceback else "")
        )
        self.reason = reason
        self.remote_traceback = remote_traceback


def check_health(url: str, timeout: float = 2.0) -> bool:
    """``True`` when the server at ``ws://host:port`` answers ``GET /healthz`` with 200."""
    http = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/")
    try:
        with urllib.request.urlopen(f"{http}/healthz", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class PolicyClient:
    """One connection to a policy server.

    Args:
        url: ``ws://host:port``.
        token: the server's shared token, if it has one.
        timeout: seconds to wait for the connection and for each reply.
        max_message_bytes: the largest reply accepted.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 10.0,
        max_message_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        from websockets.sync.client import connect

        headers = {"Authorization": f"Bearer {token}"} if token else None
        self.url = url
        self.timeout = timeout
        self._stack = contextlib.ExitStack()
        self._ws = self._stack.enter_context(
            connect(
                url,
                additional_headers=headers,
                max_size=max_message_bytes,
                open_timeout=timeout,
                compression=None,
            )
        )
        self.metadata = PolicyMetadata.from_message(codec.unpackb(self._ws.recv(timeout=timeout)))
        self._next_id = 0

    def send_raw(self, frame: bytes) -> dict[str, Any]:
        """Send one frame as-is and return the decoded reply (tests, debugging)."""
        self._ws.send(frame)
        return codec.unpackb(self._ws.recv(timeout=self.timeout))

    def infer(
        self, images: dict[str, np.ndarray], state: np.ndarray | None, instruction: str
    ) -> tuple[np.ndarray, dict[str, float]]:
        """One action chunk for one observation.

        Args:
            images: camera -> ``uint8 [H, W, 3]`` (at least the metadata's ``image_keys``).
            state: proprioception ``float32 [D]`` or ``None``.
            instruction: the task in natural language.

        Returns:
            ``actions float32 [K, A]`` and the server's timing (``queue_ms``, ``infer_ms``,
            ``server_ms``, ``batch_size``).

        Raises:
            ServerError: the server refused the request or the policy failed.
        """
        self._next_id += 1
        obs = {"images": images, "state": state, "instruction": instruction}
        reply = self.send_raw(codec.packb({"type": "infer", "id": self._next_id, "obs": obs}))
        if reply.get("type") == "error":
            raise ServerError(reply.get("reason", "unknown error"), reply.get("traceback"))
        if reply.get("type") != "actions" or reply.get("id") != self._next_id:
            raise ServerError(f"unexpected reply {reply.get('type')!r} to request {self._next_id}")
        return np.asarray(reply["actions"], dtype=np.float32), reply.get("timing", {})

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
