"""The policy-server protocol: the handshake metadata and request validation.

One websocket connection carries one robot's requests (see ``docs/deploy.md``)::

    server -> client   {"type": "metadata", "protocol": 1, "policy": "openvla_oft",
                        "image_keys": ["main", "wrist"], "image_size": 224, "state_dim": 8,
                        "state_dim_exact": true, "action_dim": 7, "chunk_size": 8,
                        "control_rate_hz": 10.0, "max_message_bytes": 8388608}
    client -> server   {"type": "infer", "id": 3, "obs": {"images": {"main": uint8 [H, W, 3], ...},
                        "state": float32 [D] | nil, "instruction": "pick up the cube"}}
    server -> client   {"type": "actions", "id": 3, "actions": float32 [K, A],
                        "timing": {"queue_ms": .., "infer_ms": .., "server_ms": .., "batch_size": n}}
                     | {"type": "error", "id": 3 | nil, "reason": "...", "traceback": "..." | nil}

Arrays travel in the :mod:`rlinf_vla.real_robot.codec` format. Pure functions only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = [
    "PROTOCOL_VERSION",
    "PolicyMetadata",
    "RequestError",
    "parse_infer_request",
    "policy_metadata",
]

PROTOCOL_VERSION = 1
MAX_IMAGE_SIDE = 4096
#: The longest instruction a request may carry: characters, and UTF-8 bytes (what bounds the
#: tokens: a tokenizer splits rare characters such as emoji into their bytes). A task
#: instruction is a sentence; a 2048-emoji one held the inference thread for seconds.
MAX_INSTRUCTION_CHARS = 512
MAX_INSTRUCTION_BYTES = 1024


class RequestError(ValueError):
    """A request the server refuses; the message is sent back as the error reason."""


#: The control rates a robot client executes (Hz): slower would hold each action for seconds,
#: faster than any arm's command loop.
CONTROL_RATE_RANGE_HZ = (1.0, 1000.0)


@dataclass(frozen=True)
class PolicyMetadata:
    """What the server tells every client when it connects.

    Attributes:
        policy: registered policy name.
        image_keys: cameras the policy needs, in order (``main``, ``wrist``...).
        image_size: the model's square input resolution; any ``H x W`` is accepted (the
            policy resizes), so this is what a client should send to avoid wasted bandwidth.
        state_dim: proprioception size ``D`` (``None``: the policy reads no state).
        state_dim_exact: ``D`` must match exactly (``False``: any ``D <= state_dim``, padded).
        action_dim: ``A``; chunk_size: ``K`` actions per reply.
        control_rate_hz: the rate the actions were trained for (the client executes at it).
        max_message_bytes: the largest request frame the server reads.
    """

    policy: str
    image_keys: tuple[str, ...]
    image_size: int | None
    state_dim: int | None
    state_dim_exact: bool
    action_dim: int
    chunk_size: int
    control_rate_hz: float
    max_message_bytes: int

    def to_message(self) -> dict[str, Any]:
        out = asdict(self)
        out["image_keys"] = list(self.image_keys)
        return {"type": "metadata", "protocol": PROTOCOL_VERSION, **out}

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> PolicyMetadata:
        if "type" not in msg:
            keys = sorted(map(str, msg))[:8]
            raise ValueError(
                "the server's first message has no 'type' (keys "
                f"{keys}): this looks like an openpi server; deploy with protocol=openpi"
            )
        if msg.get("type") != "metadata":
            raise ValueError(f"expected a metadata message, got {msg.get('type')!r}")
        if msg.get("protocol") != PROTOCOL_VERSION:
            raise ValueError(
                f"server speaks protocol {msg.get('protocol')!r}, this client {PROTOCOL_VERSION}"
            )
        missing = [k for k in cls.__dataclass_fields__ if k not in msg]
        if missing:
            raise ValueError(f"the server's metadata lacks {missing}")
        values = {k: msg[k] for k in cls.__dataclass_fields__}
        if isinstance(values["image_keys"], list | tuple):
            values["image_keys"] = tuple(values["image_keys"])
        meta = cls(**values)
        problems = meta.problems()
        if problems:
            raise ValueError("; ".join(problems))
        return meta

    def problems(self) -> list[str]:
        """What makes these values unusable by a client (wrong types, sizes below 1, a
        control rate outside :data:`CONTROL_RATE_RANGE_HZ`; ``0``: not advertised)."""
        import math

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        out = []
        if not (
            isinstance(self.image_keys, tuple)
            and self.image_keys
            and all(isinstance(k, str) and k for k in self.image_keys)
        ):
            out.append(
                f"image_keys must be a non-empty list of camera names, got {self.image_keys!r}"
            )
        for name in ("action_dim", "chunk_size", "max_message_bytes"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                out.append(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("image_size", "state_dim"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                out.append(f"{name} must be an integer >= 1 or null, got {value!r}")
        rate = self.control_rate_hz
        low, high = CONTROL_RATE_RANGE_HZ
        if not isinstance(rate, int | float) or isinstance(rate, bool) or not math.isfinite(rate):
            out.append(f"control_rate_hz must be a number, got {rate!r}")
        elif rate != 0 and not low <= rate <= high:
            out.append(f"control_rate_hz must be in [{low:g}, {high:g}] Hz, got {rate!r}")
        return out


def policy_metadata(
    name: str, config: Any, control_rate_hz: float, max_message_bytes: int
) -> PolicyMetadata:
    """Metadata from a policy's config (any registered family)."""
    image_size = getattr(config, "image_size", None)
    if image_size is None and getattr(config, "image_sizes", None):
        image_size = int(config.image_sizes[0])
    if getattr(config, "use_proprio", False):  # OpenVLA-OFT: exactly proprio_dim
        state_dim, exact = int(config.proprio_dim), True
    elif hasattr(config, "max_state_dim"):  # π0 / π0.5: zero-padded up to max_state_dim
        state_dim, exact = int(config.max_state_dim), False
    else:
        state_dim, exact = None, False
    return PolicyMetadata(
        policy=name,
        image_keys=tuple(config.image_keys),
        image_size=None if image_size is None else int(image_size),
        state_dim=state_dim,
        state_dim_exact=exact,
        action_dim=int(config.action_dim),
        chunk_size=int(config.chunk_size),
        control_rate_hz=float(control_rate_hz),
        max_message_bytes=int(max_message_bytes),
    )


@dataclass
class InferRequest:
    """A validated single-robot request."""

    id: Any
    images: dict[str, np.ndarray]  # key -> uint8 [H, W, 3]
    state: np.ndarray | None  # float32 [D]
    instruction: str

    def signature(self) -> tuple:
        """Requests with equal signatures can be stacked into one batch."""
        shapes = tuple((k, v.shape) for k, v in sorted(self.images.items()))
        return shapes, None if self.state is None else self.state.shape


def parse_infer_request(msg: Any, meta: PolicyMetadata) -> InferRequest:
    """Check a decoded ``infer`` message against the policy's metadata.

    Raises:
        RequestError: naming the field and what was expected (missing camera, wrong shape or
            dtype, non-finite state, bad instruction, unknown message type).
    """
    if not isinstance(msg, dict):
        raise RequestError(f"a request must be a map, got {type(msg).__name__}")
    kind = msg.get("type")
    if kind != "infer":
        raise RequestError(f"unknown request type {kind!r} (known: 'infer')")
    req_id = msg.get("id")
    if req_id is not None and (not isinstance(req_id, int | str) or isinstance(req_id, bool)):
        raise RequestError("id must be an int or a string")
    obs = msg.get("obs")
    if not isinstance(obs, dict):
        raise RequestError("obs must be a map with images, state and instruction")
    unknown = sorted(set(obs) - {"images", "state", "instruction"})
    if unknown:
        raise RequestError(f"unknown obs key(s) {unknown} (known: images, state, instruction)")
    images = obs.get("images")
    if not isinstance(images, dict):
        raise RequestError("obs.images must be a map camera -> uint8 [H, W, 3]")
    for key in meta.image_keys:
        if key not in images:
            raise RequestError(
                f"missing camera {key!r}: the policy needs {list(meta.image_keys)}, "
                f"got {sorted(map(str, images))}"
            )
    checked: dict[str, np.ndarray] = {}
    for key in meta.image_keys:
        img = images[key]
        if not isinstance(img, np.ndarray):
            raise RequestError(f"obs.images.{key} must be an array, got {type(img).__name__}")
        if img.dtype != np.uint8:
            raise RequestError(f"obs.images.{key} must be uint8, got {img.dtype}")
        if img.ndim != 3 or img.shape[2] != 3:
            raise RequestError(f"obs.images.{key} must be [H, W, 3], got {list(img.shape)}")
        if not (1 <= img.shape[0] <= MAX_IMAGE_SIDE and 1 <= img.shape[1] <= MAX_IMAGE_SIDE):
            raise RequestError(
                f"obs.images.{key} has size {img.shape[0]}x{img.shape[1]}; each side must be "
                f"1..{MAX_IMAGE_SIDE}"
            )
        checked[key] = img
    state = obs.get("state")
    if meta.state_dim is None:
        state = None  # the policy reads no proprioception
    else:
        if state is None:
            if meta.state_dim_exact:
                raise RequestError(
                    f"obs.state is missing: the policy needs float32 [{meta.state_dim}]"
                )
        else:
            if not isinstance(state, np.ndarray) or state.dtype.kind != "f" or state.ndim != 1:
                raise RequestError(
                    f"obs.state must be a 1-d float array of {meta.state_dim} values, got "
                    f"{getattr(state, 'dtype', type(state).__name__)} {list(np.shape(state))}"
                )
            d = state.shape[0]
            ok = d == meta.state_dim if meta.state_dim_exact else 1 <= d <= meta.state_dim
            if not ok:
                want = f"{meta.state_dim}" if meta.state_dim_exact else f"1..{meta.state_dim}"
                raise RequestError(f"obs.state has {d} values, the policy expects {want}")
            with np.errstate(over="ignore", invalid="ignore"):
                state = state.astype(np.float32)  # what the policy reads: check after the cast
            if not np.isfinite(state).all():
                raise RequestError("obs.state holds NaN or inf (as float32)")
    instruction = obs.get("instruction")
    if (
        not isinstance(instruction, str)
        or len(instruction) > MAX_INSTRUCTION_CHARS
        or len(instruction.encode("utf-8", "surrogatepass")) > MAX_INSTRUCTION_BYTES
    ):
        got = (
            f"{len(instruction)} chars, {len(instruction.encode('utf-8', 'surrogatepass'))} bytes"
            if isinstance(instruction, str)
            else type(instruction).__name__
        )
        raise RequestError(
            f"obs.instruction must be a string of at most {MAX_INSTRUCTION_CHARS} chars and "
            f"{MAX_INSTRUCTION_BYTES} UTF-8 bytes, got {got}"
        )
    return InferRequest(id=req_id, images=checked, state=state, instruction=instruction)
