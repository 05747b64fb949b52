"""The openpi-compatible protocol, spoken here with plain ``msgpack`` and ``websockets`` in
openpi's documented message format (bytes-keyed arrays, flat observations, ``{"actions": ...}``
replies, errors as a text frame then close 1011); the real openpi-client runs in
``tests/interop/``."""

from __future__ import annotations

import contextlib
import threading

import msgpack
import numpy as np
import pytest
import torch
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from rlinf_vla.config import ConfigError, RunAborted
from rlinf_vla.real_robot import codec
from rlinf_vla.real_robot.client import BadReply, PolicyClient
from rlinf_vla.real_robot.openpi import OpenpiClient, to_native_obs
from rlinf_vla.real_robot.protocol import RequestError
from rlinf_vla.real_robot.server import PolicyServer, ServerConfig
from rlinf_vla.types import Observation


# --------------------------------------------------------------- openpi's wire, written out
def _op_default(obj):
    if isinstance(obj, np.ndarray):
        return {
            b"__ndarray__": True,
            b"data": obj.tobytes(),
            b"dtype": obj.dtype.str,
            b"shape": obj.shape,
        }
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


def _op_hook(m):
    if b"__ndarray__" in m:
        return np.ndarray(buffer=m[b"data"], dtype=np.dtype(m[b"dtype"]), shape=m[b"shape"])
    return m


def op_pack(obj) -> bytes:
    return msgpack.packb(obj, default=_op_default)


def op_unpack(data: bytes):
    return msgpack.unpackb(data, object_hook=_op_hook)


def libero_obs(size: int = 32, seed: int = 0, chw: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    shape = (3, size, size) if chw else (size, size, 3)
    return {
        "observation/image": rng.integers(0, 256, shape, dtype=np.uint8),
        "observation/wrist_image": rng.integers(0, 256, shape, dtype=np.uint8),
        "observation/state": rng.uniform(-1, 1, 8),  # float64, as LIBERO's example sends
        "prompt": "pick up the red cube",
    }


def direct_actions(policy, images: dict, state: np.ndarray, instruction: str) -> np.ndarray:
    obs = Observation(
        images={k: torch.from_numpy(np.ascontiguousarray(v))[None] for k, v in images.items()},
        state=torch.from_numpy(state.astype(np.float32))[None],
        instruction=[instruction],
    )
    with torch.inference_mode():
        return policy.act(obs, greedy=True).actions[0].float().numpy()


@pytest.fixture(scope="module")
def openpi_served(tiny_policy):
    cfg = ServerConfig(port=0, protocol="openpi", token="secret-key-123")
    srv = PolicyServer(tiny_policy, "openvla_oft", cfg)
    with srv.run_in_thread() as url:
        yield srv, url


def _connect(url: str, key: str = "secret-key-123", scheme: str = "Api-Key"):
    return connect(url, additional_headers={"Authorization": f"{scheme} {key}"}, compression=None)


# --------------------------------------------------------------- codec
def test_codec_reads_and_writes_openpi_arrays_and_scalars():
    msg = {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "s": np.float32(0.25), "t": "x"}
    ours = codec.unpackb(op_pack(msg), openpi=True)
    assert ours["a"].dtype == np.int16 and ours["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert ours["s"] == np.float32(0.25) and ours["s"].dtype == np.float32 and ours["t"] == "x"
    back = op_unpack(codec.packb({"actions": np.ones((4, 7), np.float32)}, openpi=True))
    assert back["actions"].shape == (4, 7) and back["actions"].dtype == np.float32
    # The native decoder leaves openpi's bytes-keyed maps alone (no silent array).
    assert isinstance(codec.unpackb(op_pack({"a": np.zeros(2)}))["a"], dict)


@pytest.mark.parametrize(
    "arr, reason",
    [
        ({b"__ndarray__": True, b"data": b"\0" * 3, b"dtype": "<f4", b"shape": [1]}, "needs 4"),
        ({b"__ndarray__": True, b"data": b"", b"dtype": "|O", b"shape": [0]}, "not allowed"),
        ({b"__ndarray__": True, b"data": b"", b"dtype": "<f4"}, "exactly the keys"),
        ({b"__npgeneric__": True, b"data": "x", b"dtype": "<f4"}, "must be a number"),
    ],
)
def test_codec_refuses_malformed_openpi_arrays(arr, reason):
    with pytest.raises(codec.DecodeError, match=reason):
        codec.unpackb(msgpack.packb({"x": arr}), openpi=True)


# --------------------------------------------------------------- layouts
def test_layout_mapping_droid_concatenates_state_and_aloha_reads_nested_chw(tiny_policy):
    srv = PolicyServer(tiny_policy, "openvla_oft", ServerConfig(port=0))
    meta = srv.metadata  # cameras main, wrist; state exactly 8
    rng = np.random.default_rng(1)
    droid = {
        "observation/exterior_image_1_left": rng.integers(0, 256, (16, 16, 3), dtype=np.uint8),
        "observation/wrist_image_left": rng.integers(0, 256, (16, 16, 3), dtype=np.uint8),
        "observation/joint_position": np.arange(7, dtype=np.float64),
        "observation/gripper_position": np.array([0.5]),
        "prompt": b"open the drawer",
    }
    obs = to_native_obs(droid, "droid", meta)
    assert obs["state"].tolist() == [0, 1, 2, 3, 4, 5, 6, 0.5]
    assert obs["images"]["main"] is droid["observation/exterior_image_1_left"]
    assert obs["instruction"] == "open the drawer"
    chw = rng.integers(0, 256, (3, 16, 20), dtype=np.uint8)
    aloha = {
        "images": {"cam_high": chw, "cam_left_wrist": chw, "cam_low": chw},
        "state": np.zeros(8),
    }
    obs = to_native_obs(aloha, "aloha", meta, default_prompt="fold the towel")
    assert obs["images"]["main"].shape == (16, 20, 3)
    assert np.array_equal(obs["images"]["main"][..., 1], chw[1])
    assert obs["instruction"] == "fold the towel"
    with pytest.raises(RequestError, match=r"unknown observation key\(s\) \['observation/imgae'\]"):
        to_native_obs({**libero_obs(), "observation/imgae": 1}, "libero", meta)
    with pytest.raises(RequestError, match="missing 'observation/wrist_image'"):
        to_native_obs({k: v for k, v in libero_obs().items() if "wrist" not in k}, "libero", meta)


def test_serve_refuses_a_layout_with_too_few_cameras(tiny_policy, monkeypatch):
    from rlinf_vla.cli import COMMANDS, compose
    from rlinf_vla.real_robot.serve import validate

    cmd = COMMANDS["serve"]
    job = validate(compose(cmd.config_name, ["server.protocol=openpi"], cmd.config_dir))
    assert job.server.protocol == "openpi" and job.server.openpi_layout == "libero"
    with pytest.raises(ConfigError, match=r"server\.protocol must be one of native, openpi"):
        validate(compose(cmd.config_name, ["server.protocol=grpc"], cmd.config_dir))
    with pytest.raises(ConfigError, match=r"server\.openpi_layout must be one of"):
        validate(compose(cmd.config_name, ["server.openpi_layout=bridge"], cmd.config_dir))
    monkeypatch.setattr(tiny_policy.config, "image_keys", ("a", "b", "c"))
    with pytest.raises(ValueError, match="openpi layout 'libero' has 2 camera"):
        PolicyServer(tiny_policy, "openvla_oft", ServerConfig(protocol="openpi"))


# --------------------------------------------------------------- the server, openpi side
def test_openpi_request_gets_the_policys_actions(openpi_served, tiny_policy):
    _, url = openpi_served
    with _connect(url) as ws:
        meta = op_unpack(ws.recv())
        assert "type" not in meta and meta["protocol"] == "openpi"
        assert meta["action_dim"] == 7 and meta["chunk_size"] == 8
        assert meta["openpi_layout"] == "libero" and "observation/image" in meta["observation_keys"]
        for chw in (False, True):
            obs = libero_obs(chw=chw, seed=3)
            ws.send(op_pack(obs))
            reply = op_unpack(ws.recv())
            assert reply["actions"].shape == (8, 7) and reply["actions"].dtype == np.float32
            assert reply["server_timing"]["batch_size"] == 1
            img, wrist = obs["observation/image"], obs["observation/wrist_image"]
            if chw:
                img, wrist = img.transpose(1, 2, 0), wrist.transpose(1, 2, 0)
            want = direct_actions(
                tiny_policy, {"main": img, "wrist": wrist}, obs["observation/state"], obs["prompt"]
            )
            np.testing.assert_allclose(reply["actions"], want, atol=1e-5)


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"observation/state": np.zeros(5)}, "obs.state has 5 values, the policy expects 8"),
        ({"observation/state": np.full(8, 1e300)}, "NaN or inf"),
        ({"observation/image": np.zeros((32, 32, 3), np.float32)}, "must be uint8"),
        ({"prompt": 7}, "instruction must be a string"),
        ({"extra": 1}, "unknown observation key"),
    ],
)
def test_a_bad_openpi_request_gets_a_text_frame_and_close_1011(openpi_served, change, reason):
    _, url = openpi_served
    with _connect(url) as ws:
        ws.recv()
        ws.send(op_pack({**libero_obs(), **change}))
        text = ws.recv()
        assert isinstance(text, str) and reason in text
        if "obs." in reason or "instruction" in reason:
            assert "observation/image -> images.main" in text  # the mapping is named
        with pytest.raises(ConnectionClosed) as info:
            ws.recv()
        assert info.value.rcvd.code == 1011


def test_openpi_requests_are_batched_and_size_limited_like_native_ones(tiny_policy):
    cfg = ServerConfig(port=0, protocol="openpi", batch_window_ms=300, max_message_bytes=8192)
    srv = PolicyServer(tiny_policy, "openvla_oft", cfg)
    with srv.run_in_thread() as url, contextlib.ExitStack() as stack:
        conns = [stack.enter_context(connect(url, compression=None)) for _ in range(3)]
        for ws in conns:
            ws.recv()
        barrier, sizes = threading.Barrier(3), []

        def ask(ws, seed):
            barrier.wait()
            ws.send(op_pack(libero_obs(size=16, seed=seed)))
            sizes.append(op_unpack(ws.recv())["server_timing"]["batch_size"])

        threads = [threading.Thread(target=ask, args=(ws, i)) for i, ws in enumerate(conns)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(sizes) == 3 and max(sizes) >= 2, sizes
        big = conns[0]
        big.send(op_pack(libero_obs(size=64)))  # 2 x 12 kB of images > 8 kB
        with pytest.raises(ConnectionClosed) as info:
            big.recv()
        assert info.value.rcvd.code == 1009
        conns[1].send(op_pack(libero_obs(size=16)))  # the others are unaffected
        assert op_unpack(conns[1].recv())["actions"].shape == (8, 7)


def test_api_key_and_bearer_tokens_are_accepted_and_a_wrong_key_refused(openpi_served):
    _, url = openpi_served
    for scheme in ("Api-Key", "Bearer"):
        with _connect(url, scheme=scheme) as ws:
            assert isinstance(ws.recv(), bytes)
    srv, _ = openpi_served
    srv.config.auth_failure_delay_s = 0  # no throttling for this check
    with pytest.raises(InvalidStatus) as info:
        _connect(url, key="wrong-key-000")
    assert info.value.response.status_code == 401


def test_a_native_server_tells_an_openpi_client_to_switch(tiny_policy):
    srv = PolicyServer(tiny_policy, "openvla_oft", ServerConfig(port=0))
    with srv.run_in_thread() as url, connect(url, compression=None) as ws:
        ws.recv()
        ws.send(op_pack(libero_obs()))
        text = ws.recv()
        assert isinstance(text, str) and "server.protocol=openpi" in text


def test_each_client_names_the_other_protocol(openpi_served, tiny_policy):
    _, url = openpi_served
    with pytest.raises(BadReply, match="looks like an openpi server; deploy with protocol=openpi"):
        PolicyClient(url, token="secret-key-123")
    native = PolicyServer(tiny_policy, "openvla_oft", ServerConfig(port=0))
    with native.run_in_thread() as native_url, pytest.raises(BadReply, match="native protocol"):
        OpenpiClient(native_url)


def test_openpi_client_against_the_openpi_mode_server(openpi_served, tiny_policy):
    _, url = openpi_served
    obs = libero_obs(seed=5)
    images = {"main": obs["observation/image"], "wrist": obs["observation/wrist_image"]}
    with OpenpiClient(url, token="secret-key-123") as client:
        assert client.metadata.control_rate_hz == 10.0 and client.metadata.chunk_size == 8
        actions, timing = client.infer(images, obs["observation/state"], obs["prompt"])
        want = direct_actions(tiny_policy, images, obs["observation/state"], obs["prompt"])
        np.testing.assert_allclose(actions, want, atol=1e-5)
        assert timing["batch_size"] == 1
    with OpenpiClient(url, token="secret-key-123") as client:
        bad = {"main": images["main"][..., :2], "wrist": images["wrist"]}
        from rlinf_vla.real_robot.client import ServerError

        with pytest.raises(ServerError, match=r"must be \[H, W, 3\]"):
            client.infer(bad, obs["observation/state"], obs["prompt"])


# --------------------------------------------------------------- deploy against openpi
class _OpenpiStyleServer:
    """openpi's server side as documented: any metadata map first, then for each flat
    observation ``{"actions": [H, 7], "server_timing": ...}``; errors as a text frame and
    close 1011. Records every observation it received."""

    def __init__(self, metadata: dict, horizon: int = 10) -> None:
        self.metadata, self.horizon, self.received = metadata, horizon, []

    def handler(self, ws) -> None:
        ws.send(op_pack(self.metadata))
        for frame in ws:
            obs = op_unpack(frame)
            self.received.append(obs)
            try:
                assert obs["observation/image"].dtype == np.uint8
                actions = np.zeros((self.horizon, 7))
                actions[:, 0] = 0.002
                ws.send(op_pack({"actions": actions, "server_timing": {"infer_ms": 1.0}}))
            except Exception as e:
                ws.send(f"Traceback: {type(e).__name__}: {e}")
                ws.close(1011, "Internal server error")
                return

    def __enter__(self) -> str:
        from websockets.sync.server import serve

        self.server = serve(self.handler, "127.0.0.1", 0, compression=None)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.thread.join(10)


def test_deploy_config_protocol_keys():
    from rlinf_vla.real_robot.deploy import validate
    from tests.real_robot.test_deploy import deploy_cfg

    job = validate(deploy_cfg(protocol="openpi"))
    assert job.protocol == "openpi" and job.openpi_layout == "libero"
    with pytest.raises(ConfigError, match="openpi_layout must be one of libero"):
        validate(deploy_cfg(protocol="openpi", openpi_layout="aloha"))
    with pytest.raises(ConfigError, match="protocol must be one of native, openpi"):
        validate(deploy_cfg(protocol="zmq"))


@pytest.mark.sim
def test_deploy_drives_the_simulated_franka_from_an_openpi_server(tmp_path, capsys):
    from rlinf_vla.cli import main
    from rlinf_vla.real_robot.recording import read_episode

    fake = _OpenpiStyleServer({})  # openpi's servers often send an empty metadata map
    with fake as url:
        args = [
            "deploy",
            f"server={url}",
            "protocol=openpi",
            "max_steps=12",
            "realtime=false",
            f"record.output_dir={tmp_path}",
            "record.video=png",
            "robot.image_size=32",
        ]
        native = [a for a in args if a != "protocol=openpi"]
        assert main([*native, "control_rate_hz=20"]) == 1  # the native client names the fix
        assert "looks like an openpi server; deploy with protocol=openpi" in capsys.readouterr().err
        rc = main(args)
        assert rc == 2  # no control rate advertised: refused before the robot moves
        assert "set control_rate_hz" in capsys.readouterr().err
        assert fake.received == []
        assert main([*args, "control_rate_hz=20"]) == 0
    # 12 ticks, chunks of 10: two requests, each LIBERO's flat observation.
    assert len(fake.received) == 2
    obs = fake.received[0]
    assert sorted(obs) == [
        "observation/image",
        "observation/state",
        "observation/wrist_image",
        "prompt",
    ]
    assert obs["observation/image"].shape == (32, 32, 3) and obs["observation/state"].shape == (8,)
    assert obs["prompt"] == "pick up the red cube"
    (folder,) = list(tmp_path.iterdir())
    ep = read_episode(folder)
    np.testing.assert_allclose(ep.steps["policy_action"][:10, 0], 0.002)
    np.testing.assert_array_equal(ep.images["main"][0], obs["observation/image"])


@pytest.mark.sim
def test_deploy_stops_on_an_openpi_error_frame(tmp_path):
    from rlinf_vla.real_robot.deploy import run, validate
    from tests.real_robot.test_deploy import deploy_cfg

    class Failing(_OpenpiStyleServer):
        def handler(self, ws) -> None:
            ws.send(op_pack({}))
            ws.recv()
            ws.send("Traceback (most recent call last):\nKeyError: 'observation/foo'")
            ws.close(1011, "Internal server error")

    with Failing({}) as url:
        job = validate(
            deploy_cfg(
                server=url,
                protocol="openpi",
                control_rate_hz=20,
                max_steps=6,
                realtime="false",
                **{"record.output_dir": str(tmp_path), "robot.image_size": 32},
            )
        )
        with pytest.raises(RunAborted, match="no answer from the policy server"):
            run(job)
