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

__all__ = ["BadReply", "PolicyClient", "ServerError", "check_actions", "check_health"]


class ServerError(RuntimeError):
    """The server answered a request with an error; ``reason`` says why."""

    def __init__(self, reason: str, remote_traceback: str | None = None) -> None:
        super().__init__(
            reason + (f"\n--- remote traceback ---\n{remote_traceback}" if remote_traceback else "")
        )
        self.reason = reason
        self.remote_traceback = remote_traceback


class BadReply(RuntimeError):
    """The server's reply is not a valid answer (not msgpack, not a map, actions of the wrong
    type, shape or values): nothing of it may be executed. The message says what was wrong."""


def check_actions(actions: Any, action_dim: int) -> np.ndarray:
    """``actions`` as ``float32 [K, action_dim]`` (``K >= 1``, every value finite), or
    :class:`BadReply` naming what is wrong."""
    if not isinstance(actions, np.ndarray):
        raise BadReply(f"reply 'actions' is a {type(actions).__name__}, not an array")
    if actions.dtype.kind not in "fiu":
        raise BadReply(f"reply 'actions' has dtype {actions.dtype}, expected float")
    if actions.ndim != 2 or actions.shape[0] < 1 or actions.shape[1] != action_dim:
        raise BadReply(
            f"reply 'actions' has shape {list(actions.shape)}, expected [K, {action_dim}] "
            "with K >= 1"
        )
    with np.errstate(over="ignore", invalid="ignore"):
        out = actions.astype(np.float32)
    if not np.isfinite(out).all():
        raise BadReply("reply 'actions' holds NaN or inf (in float32)")
    return out


def check_health(url: str, timeout: float = 2.0) -> bool:
    """``True`` when the server at ``ws://host:port`` answers ``GET /healthz`` with 200."""
    http = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/")
    try:
        with urllib.request.urlopen(f"{http}/healthz", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def open_connection(
    url: str,
    headers: dict[str, str] | None,
    timeout: float,
    max_message_bytes: int,
    openpi: bool,
    server: str,
) -> tuple[contextlib.ExitStack, Any, dict[str, Any]]:
    """Connect to a policy server and read its first message, the metadata map.

    Returns the exit stack that closes the connection, the connection, and the decoded map
    (bytes keys of ``openpi``'s array format understood). Raises :class:`BadReply`, with the
    connection closed, when the first message is a text frame, not msgpack or not a map.
    """
    from websockets.sync.client import connect

    stack = contextlib.ExitStack()
    ws = stack.enter_context(
        connect(
            url,
            additional_headers=headers,
            max_size=max_message_bytes,
            open_timeout=timeout,
            compression=None,
        )
    )
    try:
        first = ws.recv(timeout=timeout)
        if not isinstance(first, bytes):
            raise ValueError(f"a text frame: {first[:200]!r}")
        message = codec.unpackb(first, openpi=True) if openpi else codec.unpackb(first)
        if not isinstance(message, dict):
            raise ValueError(f"a {type(message).__name__}, not a map")
    except (ValueError, TypeError) as e:
        stack.close()
        raise BadReply(f"{server}'s metadata is not valid: {e}") from None
    return stack, ws, message


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
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self.url = url
        self.timeout = timeout
        self._stack, self._ws, message = open_connection(
            url, headers, timeout, max_message_bytes, openpi=False, server="the server"
        )
        try:
            self.metadata = PolicyMetadata.from_message(message)
        except (ValueError, KeyError, TypeError) as e:
            self._stack.close()
            raise BadReply(f"the server's metadata is not valid: {e}") from None
        self._next_id = 0

    def send_raw(self, frame: bytes) -> Any:
        """Send one frame as-is and return the decoded reply (tests, debugging).

        Raises:
            BadReply: the reply is not valid msgpack (or is a text frame).
        """
        self._ws.send(frame)
        data = self._ws.recv(timeout=self.timeout)
        if not isinstance(data, bytes):
            raise BadReply("the server sent a text frame; replies are binary msgpack")
        try:
            return codec.unpackb(data)
        except codec.DecodeError as e:
            raise BadReply(f"the reply is not a valid message: {e}") from None

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
            BadReply: the reply is malformed (see :func:`check_actions`); nothing of it is
                usable.
        """
        self._next_id += 1
        obs = {"images": images, "state": state, "instruction": instruction}
        reply = self.send_raw(codec.packb({"type": "infer", "id": self._next_id, "obs": obs}))
        if not isinstance(reply, dict):
            raise BadReply(f"the reply is a {type(reply).__name__}, expected a map")
        if reply.get("type") == "error":
            reason = reply.get("reason")
            tb = reply.get("traceback")
            raise ServerError(
                reason if isinstance(reason, str) else "unknown error",
                tb if isinstance(tb, str) else None,
            )
        if reply.get("type") != "actions":
            raise BadReply(f"unexpected reply type {reply.get('type')!r}, expected 'actions'")
        if reply.get("id") != self._next_id:
            raise BadReply(f"reply to request {reply.get('id')!r}, expected {self._next_id}")
        actions = check_actions(reply.get("actions"), self.metadata.action_dim)
        timing = reply.get("timing")
        return actions, timing if isinstance(timing, dict) else {}

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
