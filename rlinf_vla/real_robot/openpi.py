"""The openpi-compatible protocol: observation layouts and a robot-side client.

openpi (Physical Intelligence) serves its policies over websockets with msgpack too, but its
messages differ from the native ones of :mod:`.protocol`:

- arrays are maps with bytes keys (``codec.packb(..., openpi=True)``);
- the server's first frame is a metadata map of any content (no ``type``);
- a request is the observation itself, a flat map whose keys depend on the robot (the
  *layout*, :data:`LAYOUTS`), with no ``type`` / ``id`` / ``obs`` envelope;
- a reply is ``{"actions": [H, A], ...}``; an error is a **text** frame (the traceback), after
  which the server closes the connection with code 1011 (openpi's client raises on a text frame);
- a token travels as ``Authorization: Api-Key <key>``.

``rlinf-vla serve server.protocol=openpi server.openpi_layout=libero`` maps a layout's keys onto
the policy's cameras (in order), state and instruction, then validates and batches exactly like a
native request (:func:`.protocol.parse_infer_request`). :class:`OpenpiClient` is the robot side
for ``rlinf-vla deploy protocol=openpi``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rlinf_vla.real_robot import codec
from rlinf_vla.real_robot.protocol import PROTOCOL_VERSION, PolicyMetadata, RequestError

__all__ = [
    "LAYOUTS",
    "OpenpiClient",
    "OpenpiLayout",
    "check_layout",
    "looks_like_openpi_request",
    "metadata_message",
    "to_native_obs",
]

#: The protocols serve's ``server.protocol`` and deploy's ``protocol`` accept.
PROTOCOLS = ("native", "openpi")


@dataclass(frozen=True)
class OpenpiLayout:
    """Where one robot family's openpi clients put each part of an observation.

    Attributes:
        cameras: image keys, in the order they map onto the policy's ``image_keys``
            (``a/b`` is key ``b`` of the map under ``a``). A policy with fewer cameras ignores
            the rest; one with more cannot be served with this layout.
        state: keys whose 1-d arrays are concatenated, in this order, into the state.
        optional: further keys openpi's clients send that are accepted and ignored.
        channels_first: openpi's own clients send ``[3, H, W]`` images (the server accepts
            ``[H, W, 3]`` and ``[3, H, W]`` either way).
    """

    cameras: tuple[str, ...]
    state: tuple[str, ...]
    optional: tuple[str, ...] = ()
    channels_first: bool = False
    prompt: str = "prompt"

    def known_keys(self) -> list[str]:
        return [*self.cameras, *self.state, *self.optional, self.prompt]


#: openpi's observation keys per robot (from its LIBERO, DROID and ALOHA examples and policies).
LAYOUTS: dict[str, OpenpiLayout] = {
    "libero": OpenpiLayout(
        cameras=("observation/image", "observation/wrist_image"),
        state=("observation/state",),  # [8]: eef position, axis-angle, two gripper fingers
    ),
    "droid": OpenpiLayout(
        cameras=("observation/exterior_image_1_left", "observation/wrist_image_left"),
        state=("observation/joint_position", "observation/gripper_position"),  # [7] + [1]
    ),
    "aloha": OpenpiLayout(
        cameras=("images/cam_high", "images/cam_left_wrist", "images/cam_right_wrist"),
        state=("state",),  # [14]: two 6-joint arms and their grippers
        optional=("images/cam_low",),
        channels_first=True,
    ),
}


def _layout(name: str) -> OpenpiLayout:
    if name not in LAYOUTS:
        raise ValueError(f"unknown openpi layout {name!r} (known: {', '.join(LAYOUTS)})")
    return LAYOUTS[name]


def check_layout(name: str, image_keys: tuple[str, ...] | list[str]) -> dict[str, str]:
    """The mapping openpi key -> policy camera for a policy's ``image_keys``, or ``ValueError``
    when the layout is unknown or has fewer cameras than the policy needs."""
    layout = _layout(name)
    if len(image_keys) > len(layout.cameras):
        raise ValueError(
            f"openpi layout {name!r} has {len(layout.cameras)} camera(s) "
            f"{list(layout.cameras)}; the policy needs {len(image_keys)} {list(image_keys)}"
        )
    return dict(zip(layout.cameras, image_keys, strict=False))


def describe(name: str, image_keys: tuple[str, ...] | list[str]) -> str:
    """``observation/image -> main, ...``: the mapping, for error messages and the console."""
    layout = _layout(name)
    parts = [f"{k} -> images.{v}" for k, v in check_layout(name, image_keys).items()]
    parts.append(f"{' + '.join(layout.state)} -> state")
    parts.append(f"{layout.prompt} -> instruction")
    return ", ".join(parts)


def _flatten(obs: dict) -> dict[str, Any]:
    """One level of nested maps becomes ``outer/inner`` keys (ALOHA's ``images`` map)."""
    flat: dict[str, Any] = {}
    for key, value in obs.items():
        if not isinstance(key, str):
            raise RequestError(f"observation keys must be strings, got {key!r}")
        if isinstance(value, dict):
            for inner, v in value.items():
                if not isinstance(inner, str):
                    raise RequestError(f"observation keys must be strings, got {inner!r}")
                flat[f"{key}/{inner}"] = v
        else:
            flat[key] = value
    return flat


def _image(img: Any) -> Any:
    """``uint8 [3, H, W]`` -> ``[H, W, 3]``; anything else is left to the native checks."""
    if (
        isinstance(img, np.ndarray)
        and img.dtype == np.uint8
        and img.ndim == 3
        and img.shape[0] == 3
        and img.shape[2] != 3
    ):
        return np.ascontiguousarray(img.transpose(1, 2, 0))
    return img


def looks_like_openpi_request(msg: Any) -> bool:
    """A map without the native ``type`` that holds openpi observation keys."""
    if not isinstance(msg, dict) or "type" in msg:
        return False
    return any(
        isinstance(k, str) and (k == "prompt" or k == "images" or k.startswith("observation/"))
        for k in msg
    )


def to_native_obs(
    msg: Any, layout_name: str, meta: PolicyMetadata, default_prompt: str | None = None
) -> dict[str, Any]:
    """An openpi observation as the native ``infer`` request (validated afterwards by
    :func:`.protocol.parse_infer_request`, like any native request).

    Raises:
        RequestError: not a map, an unknown key, a state part missing or not concatenable.
    """
    layout = _layout(layout_name)
    if not isinstance(msg, dict):
        raise RequestError(f"an openpi observation must be a map, got {type(msg).__name__}")
    if "type" in msg and "obs" in msg:
        raise RequestError(
            "this server speaks the openpi protocol (a flat observation map); a native "
            "rlinf-vla client needs a server started without server.protocol=openpi"
        )
    flat = _flatten(msg)
    known = layout.known_keys()
    unknown = sorted(set(flat) - set(known))
    if unknown:
        raise RequestError(
            f"unknown observation key(s) {unknown} for openpi layout {layout_name!r} "
            f"(known: {known})"
        )
    cameras = check_layout(layout_name, meta.image_keys)
    images = {policy_key: _image(flat[k]) for k, policy_key in cameras.items() if k in flat}
    for k, policy_key in cameras.items():
        if k not in flat:
            raise RequestError(
                f"missing {k!r} (the policy's camera {policy_key!r}); openpi layout "
                f"{layout_name!r} needs {list(cameras)}"
            )
    state = None
    present = [k for k in layout.state if k in flat]
    if meta.state_dim is not None and present:
        if len(present) != len(layout.state):
            missing = [k for k in layout.state if k not in flat]
            raise RequestError(f"missing state part(s) {missing} (the state is {layout.state})")
        parts = []
        for k in layout.state:
            part = flat[k]
            if isinstance(part, np.generic):  # openpi sends a numpy scalar as one
                part = np.asarray(part).reshape(1)
            if not isinstance(part, np.ndarray) or part.ndim != 1:
                raise RequestError(
                    f"{k} must be a 1-d float array, got "
                    f"{getattr(part, 'dtype', type(part).__name__)} {list(np.shape(part))}"
                )
            parts.append(part)
        state = parts[0] if len(parts) == 1 else np.concatenate(parts)
    prompt = flat.get(layout.prompt, default_prompt)
    if isinstance(prompt, bytes):
        try:
            prompt = prompt.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"{layout.prompt} is not valid UTF-8") from None
    return {"images": images, "state": state, "instruction": prompt}


def metadata_message(meta: PolicyMetadata, layout_name: str) -> dict[str, Any]:
    """What an openpi-protocol server sends first: the native metadata fields (openpi's
    clients pass the map on unread) without the native ``type``, plus the layout's keys."""
    out = meta.to_message()
    del out["type"]
    out["protocol"] = "openpi"
    out["openpi_layout"] = layout_name
    out["observation_keys"] = LAYOUTS[layout_name].known_keys()
    return out


# ---------------------------------------------------------------------------- robot side
class OpenpiClient:
    """A robot client of an openpi policy server (``rlinf-vla deploy protocol=openpi``),
    with :class:`~rlinf_vla.real_robot.client.PolicyClient`'s interface.

    It sends LIBERO-layout observations (two cameras, the 8-d proprioception the robot
    reports, the prompt) and reads ``actions [H, 7]``. openpi's metadata usually says nothing
    about the policy, so what the robot needs is fixed here: ``image_keys`` are the robot's
    ``main`` and ``wrist`` cameras, ``action_dim`` 7, ``chunk_size`` what each reply holds
    (unless the server advertises one), and the control rate must come from the server's
    metadata (an rlinf-vla server advertises it) or deploy's ``control_rate_hz``.

    Args:
        url: ``ws://host:port``.
        token: the server's API key (sent as ``Authorization: Api-Key <token>``).
        layout: the observation layout; only ``libero`` matches a Franka's TCP-delta actions.
        timeout: seconds to wait for the connection and each reply.
    """

    #: The layouts a Franka can send (its proprioception and action convention are LIBERO's).
    ROBOT_LAYOUTS = ("libero",)

    def __init__(
        self,
        url: str,
        token: str | None = None,
        layout: str = "libero",
        timeout: float = 10.0,
        max_message_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        from rlinf_vla.real_robot.client import BadReply, open_connection

        if layout not in self.ROBOT_LAYOUTS:
            raise ValueError(
                f"openpi layout {layout!r} cannot be sent by this robot client (known: "
                f"{', '.join(self.ROBOT_LAYOUTS)})"
            )
        self.url, self.timeout, self.layout = url, timeout, LAYOUTS[layout]
        headers = {"Authorization": f"Api-Key {token}"} if token else None
        self._stack, self._ws, raw = open_connection(
            url, headers, timeout, max_message_bytes, openpi=True, server="the openpi server"
        )
        if raw.get("type") == "metadata" and raw.get("protocol") == PROTOCOL_VERSION:
            self._stack.close()
            raise BadReply(
                f"{url} is an rlinf-vla server speaking the native protocol (its metadata has "
                f"type 'metadata', protocol {PROTOCOL_VERSION}): deploy without protocol=openpi, or "
                "start the server with server.protocol=openpi"
            )
        self.server_metadata = raw

        def number(key: str, kind: type) -> Any:
            v = raw.get(key)
            return v if isinstance(v, kind) and not isinstance(v, bool) and v > 0 else None

        self.metadata = PolicyMetadata(
            policy=raw["policy"] if isinstance(raw.get("policy"), str) else "openpi",
            image_keys=("main", "wrist"),
            image_size=number("image_size", int),
            state_dim=8,
            state_dim_exact=True,
            action_dim=7,
            chunk_size=number("chunk_size", int) or 0,  # 0: whatever each reply holds
            control_rate_hz=float(number("control_rate_hz", int | float) or 0.0),
            max_message_bytes=number("max_message_bytes", int) or 0,
        )

    def infer(
        self, images: dict[str, np.ndarray], state: np.ndarray | None, instruction: str
    ) -> tuple[np.ndarray, dict[str, float]]:
        """One action chunk, as :meth:`PolicyClient.infer`.

        Raises:
            ServerError: the server answered with a text frame (openpi's error reply).
            BadReply: the reply is not a map with a finite ``actions [H, 7]``.
        """
        from rlinf_vla.real_robot.client import BadReply, ServerError, check_actions

        main, wrist = self.layout.cameras
        obs = {main: images["main"], wrist: images["wrist"], self.layout.prompt: instruction}
        if state is not None:
            obs[self.layout.state[0]] = np.asarray(state, dtype=np.float32)
        self._ws.send(codec.packb(obs, openpi=True))
        data = self._ws.recv(timeout=self.timeout)
        if isinstance(data, str):
            raise ServerError(f"the openpi server answered with an error: {data.strip()}")
        try:
            reply = codec.unpackb(data, openpi=True)
        except codec.DecodeError as e:
            raise BadReply(f"the reply is not a valid message: {e}") from None
        if not isinstance(reply, dict):
            raise BadReply(f"the reply is a {type(reply).__name__}, expected a map")
        if "actions" not in reply:
            keys = sorted(map(str, reply))[:10]
            raise BadReply(f"the reply has no 'actions' (keys {keys})")
        actions = check_actions(reply["actions"], self.metadata.action_dim)
        timing = reply.get("server_timing")
        return actions, timing if isinstance(timing, dict) else {}

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> OpenpiClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
