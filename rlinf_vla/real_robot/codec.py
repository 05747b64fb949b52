"""The wire format of the policy server: msgpack with numpy arrays.

Every websocket message is one binary frame holding one msgpack map. A numpy array anywhere in
the message is encoded as a map with exactly these keys::

    {"__ndarray__": 1, "dtype": "<f4", "shape": [2, 7], "data": <bytes, C order>}

``dtype`` is numpy's ``dtype.str`` (byte order included, so a big-endian peer still decodes it);
only plain numeric and boolean dtypes are accepted (``b1``, ``u1``..``u8``, ``i1``..``i8``,
``f2``, ``f4``, ``f8``), never ``object``. ``data`` must hold exactly ``prod(shape) * itemsize``
bytes. numpy scalars are sent as Python numbers. Decoding rejects anything else with
:class:`DecodeError`, whose message says what was wrong, so a server can answer it.

``openpi=True`` selects the variant openpi's ``msgpack_numpy`` speaks: the same array map with
**bytes** keys (``b"__ndarray__"``, ``b"data"``, ``b"dtype"``, ``b"shape"``) and numpy scalars as
``{b"__npgeneric__": True, b"data": value, b"dtype": str}``. Decoding it applies the same checks.

>>> msg = {"images": {"main": np.zeros((224, 224, 3), np.uint8)}, "state": np.ones(8, np.float32)}
>>> unpackb(packb(msg))["state"]
array([1., 1., 1., 1., 1., 1., 1., 1.], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

__all__ = ["ALLOWED_KINDS", "DecodeError", "packb", "unpackb"]

#: numpy dtype kinds accepted on the wire (bool, unsigned, signed, float).
ALLOWED_KINDS = frozenset("buif")
_ARRAY_KEYS = frozenset({"__ndarray__", "dtype", "shape", "data"})
_SCALAR_KEYS = frozenset({"__npgeneric__", "dtype", "data"})
_MAX_NDIM = 8


class DecodeError(ValueError):
    """A message that is not valid msgpack or holds a malformed array."""


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in ALLOWED_KINDS:
            raise TypeError(f"cannot send arrays of dtype {obj.dtype} (allowed kinds: b, u, i, f)")
        arr = np.ascontiguousarray(obj)
        return {
            "__ndarray__": 1,
            "dtype": arr.dtype.str,
            "shape": list(arr.shape),
            "data": arr.tobytes(),
        }
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot serialise object of type {type(obj).__name__}")


def _encode_openpi(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        if obj.dtype.kind not in ALLOWED_KINDS:
            raise TypeError(f"cannot send scalars of dtype {obj.dtype} (allowed kinds: b, u, i, f)")
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return {k.encode(): v for k, v in _encode(obj).items()}


def packb(obj: Any, openpi: bool = False) -> bytes:
    """Serialise a message (maps, lists, str, bytes, numbers, numpy arrays) to bytes
    (``openpi``: arrays and numpy scalars in openpi's bytes-keyed form)."""
    return msgpack.packb(obj, default=_encode_openpi if openpi else _encode, use_bin_type=True)


def _decode_array(m: dict[str, Any]) -> np.ndarray:
    try:
        dtype = np.dtype(m["dtype"])
    except TypeError as e:
        raise DecodeError(f"array has an unknown dtype {m['dtype']!r}") from e
    if dtype.kind not in ALLOWED_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise DecodeError(f"array dtype {dtype.str!r} is not allowed (kinds: b, u, i, f)")
    shape = m["shape"]
    if (
        not isinstance(shape, list | tuple)
        or len(shape) > _MAX_NDIM
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
    ):
        raise DecodeError(f"array shape {shape!r} must be a list of at most 8 non-negative ints")
    data = m["data"]
    if not isinstance(data, bytes):
        raise DecodeError("array data must be bytes")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise DecodeError(
            f"array of shape {list(shape)} and dtype {dtype.str} needs {expected} bytes, got {len(data)}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _decode_scalar(m: dict[str, Any]) -> np.generic:
    try:
        dtype = np.dtype(m["dtype"])
    except TypeError as e:
        raise DecodeError(f"scalar has an unknown dtype {m['dtype']!r}") from e
    value = m["data"]
    if dtype.kind not in ALLOWED_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise DecodeError(f"scalar dtype {dtype.str!r} is not allowed (kinds: b, u, i, f)")
    if isinstance(value, bytes | str | list | dict) or value is None:
        raise DecodeError(f"scalar data must be a number, got {type(value).__name__}")
    try:
        return dtype.type(value)
    except (OverflowError, ValueError, TypeError) as e:
        raise DecodeError(f"scalar {value!r} does not fit dtype {dtype.str}") from e


def _hook(m: dict[Any, Any]) -> Any:
    if "__ndarray__" in m:
        if set(m) != _ARRAY_KEYS:
            raise DecodeError(f"array map must have exactly the keys {sorted(_ARRAY_KEYS)}")
        return _decode_array(m)
    return m


def _hook_openpi(m: dict[Any, Any]) -> Any:
    if b"__ndarray__" in m or b"__npgeneric__" in m:
        if not all(isinstance(k, bytes) for k in m):
            raise DecodeError("an openpi array map must have only bytes keys")
        plain = {k.decode("ascii", "replace"): v for k, v in m.items()}
        if "__ndarray__" in plain:
            if set(plain) != _ARRAY_KEYS:
                raise DecodeError(f"array map must have exactly the keys {sorted(_ARRAY_KEYS)}")
            return _decode_array(plain)
        if set(plain) != _SCALAR_KEYS:
            raise DecodeError(f"scalar map must have exactly the keys {sorted(_SCALAR_KEYS)}")
        return _decode_scalar(plain)
    return _hook(m)


def unpackb(data: bytes, openpi: bool = False) -> Any:
    """Deserialise a message; arrays come back read-only (views on the received bytes).
    ``openpi``: also accept openpi's bytes-keyed arrays and numpy scalars.

    Raises:
        DecodeError: the bytes are not one complete msgpack object, or an array is malformed.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeError(f"expected a binary frame, got {type(data).__name__}")
    try:
        return msgpack.unpackb(
            data, object_hook=_hook_openpi if openpi else _hook, raw=False, strict_map_key=True
        )
    except DecodeError:
        raise
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise DecodeError(f"not a msgpack message: {e}") from None
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise DecodeError(f"not a msgpack message: {e}") from None
