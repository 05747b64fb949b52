"""The msgpack + numpy wire format: round trips and rejection of malformed arrays."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from rlinf_vla.real_robot.codec import DecodeError, packb, unpackb


@pytest.mark.parametrize(
    "dtype", ["uint8", "int16", "int64", "float16", "float32", "float64", "bool", ">f4"]
)
def test_round_trip_dtypes(dtype):
    x = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    y = unpackb(packb({"a": [x, {"b": x[0]}], "s": "text", "n": np.float32(1.5)}))
    np.testing.assert_array_equal(y["a"][0], x)
    assert y["a"][0].dtype == x.dtype and y["a"][0].shape == (2, 3, 4)
    np.testing.assert_array_equal(y["a"][1]["b"], x[0])
    assert y["s"] == "text" and y["n"] == 1.5


def test_layout_is_the_documented_one():
    """An array is a plain map {__ndarray__, dtype, shape, data}: decodable by any msgpack peer."""
    x = np.array([[1, 2, 3]], dtype="<i4")
    raw = msgpack.unpackb(packb(x))
    assert raw == {"__ndarray__": 1, "dtype": "<i4", "shape": [1, 3], "data": x.tobytes()}
    # And a hand-built message from another client decodes.
    frame = msgpack.packb(
        {"__ndarray__": 1, "dtype": "|u1", "shape": [2, 2], "data": b"\x01\x02\x03\x04"}
    )
    np.testing.assert_array_equal(unpackb(frame), [[1, 2], [3, 4]])


def test_non_contiguous_and_empty():
    x = np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]
    np.testing.assert_array_equal(unpackb(packb(x)), x)
    assert unpackb(packb(np.zeros((0, 3), np.uint8))).shape == (0, 3)


@pytest.mark.parametrize(
    "array_map, match",
    [
        ({"dtype": "<f4", "shape": [2], "data": b"\x00" * 7}, "needs 8 bytes"),
        ({"dtype": "|O", "shape": [1], "data": b"\x00" * 8}, "not allowed"),
        ({"dtype": "<U3", "shape": [1], "data": b"\x00" * 12}, "not allowed"),
        ({"dtype": "nonsense", "shape": [1], "data": b"\x00"}, "unknown dtype"),
        ({"dtype": "<f4", "shape": [-1], "data": b""}, "shape"),
        ({"dtype": "<f4", "shape": "2", "data": b"\x00" * 8}, "shape"),
        ({"dtype": "<f4", "shape": [2], "data": "text"}, "bytes"),
    ],
)
def test_malformed_arrays_are_rejected(array_map, match):
    frame = msgpack.packb({"x": {"__ndarray__": 1, **array_map}})
    with pytest.raises(DecodeError, match=match):
        unpackb(frame)


def test_garbage_is_rejected():
    for frame in (b"\xc1", b"\x92\x01", packb({"a": 1}) + b"extra", "a text frame"):
        with pytest.raises(DecodeError):
            unpackb(frame)
    with pytest.raises(DecodeError, match="exactly the keys"):
        unpackb(
            msgpack.packb({"__ndarray__": 1, "dtype": "<f4", "shape": [0], "data": b"", "x": 1})
        )


def test_object_arrays_cannot_be_sent():
    with pytest.raises(TypeError, match="dtype object"):
        packb(np.array([object()]))
