"""The policy server on loopback: handshake, health, batching, and robustness against malformed,
oversize and unauthenticated requests (good requests keep being answered after each)."""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest
import torch

from rlinf_vla.real_robot import codec
from rlinf_vla.real_robot.client import PolicyClient, ServerError, check_health
from rlinf_vla.real_robot.server import PolicyServer, ServerConfig
from rlinf_vla.types import Observation

from .conftest import good_obs

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def server(tiny_policy):
    srv = PolicyServer(
        tiny_policy,
        "openvla_oft",
        # Throttling off here: these tests fail authentication on purpose, then connect again.
        ServerConfig(port=0, token=TOKEN, max_message_bytes=64 * 1024, auth_failure_delay_s=0),
    )
    with srv.run_in_thread() as url:
        yield srv, url


def reference_actions(policy, obs: dict) -> np.ndarray:
    """``act`` called directly, without the server: ``[K, A]``."""
    o = Observation(
        images={k: torch.from_numpy(v[None].copy()) for k, v in obs["images"].items()},
        state=torch.from_numpy(obs["state"][None].copy()),
        instruction=[obs["instruction"]],
    )
    with torch.inference_mode():
        return policy.act(o, greedy=True).actions[0].numpy()


def assert_serves(url: str, policy) -> None:
    obs = good_obs(seed=7)
    with PolicyClient(url, TOKEN) as c:
        actions, timing = c.infer(obs["images"], obs["state"], obs["instruction"])
    np.testing.assert_allclose(actions, reference_actions(policy, obs), atol=1e-5)
    assert timing["batch_size"] == 1 and timing["server_ms"] >= timing["infer_ms"] > 0


def test_handshake_and_health(server, tiny_policy):
    srv, url = server
    assert check_health(url)
    with PolicyClient(url, TOKEN) as c:
        m = c.metadata
    cfg = tiny_policy.config
    assert m.policy == "openvla_oft" and m.image_keys == ("main", "wrist")
    assert (m.state_dim, m.state_dim_exact) == (cfg.proprio_dim, True)
    assert (m.action_dim, m.chunk_size) == (7, cfg.chunk_size)
    assert m.image_size == cfg.image_sizes[0] and m.control_rate_hz == 10.0
    assert m.max_message_bytes == 64 * 1024
    assert srv.warmup() > 0  # an act() on blank inputs of the advertised sizes
    assert_serves(url, tiny_policy)


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda o: o["images"].pop("wrist"), "missing camera 'wrist'"),
        (
            lambda o: o["images"].__setitem__("main", np.zeros((32, 32), np.uint8)),
            "must be [H, W, 3]",
        ),
        (
            lambda o: o["images"].__setitem__("main", np.zeros((32, 32, 4), np.uint8)),
            "must be [H, W, 3]",
        ),
        (
            lambda o: o["images"].__setitem__("main", np.zeros((32, 32, 3), np.float32)),
            "must be uint8",
        ),
        (lambda o: o["images"].__setitem__("main", [[1, 2, 3]]), "must be an array"),
        (
            lambda o: o.__setitem__("state", np.zeros(5, np.float32)),
            "obs.state has 5 values, the policy expects 8",
        ),
        (lambda o: o.__setitem__("state", np.zeros((2, 8), np.float32)), "1-d float array"),
        (lambda o: o.__setitem__("state", None), "obs.state is missing"),
        (lambda o: o.__setitem__("state", np.full(8, np.nan, np.float32)), "NaN"),
        # Finite in float64, inf once cast to the policy's float32.
        (lambda o: o.__setitem__("state", np.full(8, 1e300)), "NaN or inf (as float32)"),
        (lambda o: o.__setitem__("state", np.full(8, -3.5e38)), "NaN or inf (as float32)"),
        (lambda o: o.__setitem__("instruction", 42), "obs.instruction"),
        # a sentence, not a book: characters, and the bytes that bound its tokens
        (lambda o: o.__setitem__("instruction", "a" * 513), "at most 512 chars"),
        (lambda o: o.__setitem__("instruction", "\U0001f916" * 300), "got 300 chars, 1200 bytes"),
        (lambda o: o.__setitem__("extra", 1), "unknown obs key"),
    ],
)
def test_wrong_requests_get_a_reason_and_the_connection_keeps_serving(
    server, tiny_policy, mutate, reason
):
    _srv, url = server
    obs = good_obs()
    mutate(obs)
    with PolicyClient(url, TOKEN) as c:
        reply = c.send_raw(codec.packb({"type": "infer", "id": 5, "obs": obs}))
        assert reply["type"] == "error" and reply["id"] == 5
        assert reason in reply["reason"], reply["reason"]
        good = good_obs(seed=1)
        actions, _ = c.infer(good["images"], good["state"], good["instruction"])  # same connection
        assert actions.shape == (8, 7)


def test_the_server_logs_why_it_refused_a_request(server, tiny_policy, caplog):
    _srv, url = server
    obs = good_obs()
    obs["extra"] = 1
    with (
        caplog.at_level("WARNING", logger="rlinf_vla.real_robot.server"),
        PolicyClient(url, TOKEN) as c,
    ):
        reply = c.send_raw(codec.packb({"type": "infer", "id": 5, "obs": obs}))
        c.send_raw(b"\xc1\xc1\xc1")
    refusals = [r.getMessage() for r in caplog.records if "refused a request" in r.getMessage()]
    assert len(refusals) == 2, refusals
    assert reply["reason"].splitlines()[0] in refusals[0] and "from 127.0.0.1:" in refusals[0]
    assert "not a msgpack message" in refusals[1]


def test_garbage_frames(server, tiny_policy):
    _srv, url = server
    with PolicyClient(url, TOKEN) as c:
        for frame, reason in [
            (b"\xc1\xc1\xc1", "not a msgpack message"),
            (msgpack.packb([1, 2, 3]), "must be a map"),
            (msgpack.packb({"type": "launch_missiles"}), "unknown request type"),
            (
                msgpack.packb(
                    {
                        "type": "infer",
                        "obs": {
                            "images": {
                                "main": {
                                    "__ndarray__": 1,
                                    "dtype": "|u1",
                                    "shape": [9],
                                    "data": b"x",
                                }
                            }
                        },
                    }
                ),
                "needs 9 bytes",
            ),
        ]:
            reply = c.send_raw(frame)
            assert reply["type"] == "error" and reason in reply["reason"], reply
        c._ws.send("a text frame")
        reply = codec.unpackb(c._ws.recv(timeout=10))
        assert reply["type"] == "error" and "binary frame" in reply["reason"]
    assert_serves(url, tiny_policy)


def test_oversize_frame_closes_only_that_connection(server, tiny_policy):
    from websockets.exceptions import ConnectionClosedError

    _srv, url = server
    with PolicyClient(url, TOKEN) as c:
        big = good_obs(size=160)  # 2 x 160 x 160 x 3 = 154 kB > 64 kB
        with pytest.raises(ConnectionClosedError) as err:
            c.infer(big["images"], big["state"], big["instruction"])
        assert err.value.rcvd is not None and err.value.rcvd.code == 1009  # "message too big"
    assert_serves(url, tiny_policy)


def test_unauthenticated_connections_are_refused(server, tiny_policy):
    from websockets.exceptions import InvalidStatus

    srv, url = server
    before = srv.stats["rejected_auth"]
    for token in (None, "wrong-token!", TOKEN + "x"):
        with pytest.raises(InvalidStatus) as err:
            PolicyClient(url, token)
        assert err.value.response.status_code == 401
    assert srv.stats["rejected_auth"] == before + 3
    assert check_health(url)  # the health check needs no token
    assert_serves(url, tiny_policy)


def test_inference_failure_returns_the_remote_traceback(server, tiny_policy, monkeypatch):
    srv, url = server

    def broken(obs, greedy=False):
        raise RuntimeError("CUDA out of memory (simulated)")

    obs = good_obs()
    with PolicyClient(url, TOKEN) as c:
        monkeypatch.setattr(srv.policy, "act", broken)
        with pytest.raises(ServerError) as err:
            c.infer(obs["images"], obs["state"], obs["instruction"])
        assert "CUDA out of memory" in err.value.reason
        assert "Traceback" in err.value.remote_traceback and "broken" in err.value.remote_traceback
        monkeypatch.undo()
        actions, _ = c.infer(obs["images"], obs["state"], obs["instruction"])
    np.testing.assert_allclose(actions, reference_actions(tiny_policy, obs), atol=1e-5)


def test_concurrent_requests_are_batched(tiny_policy):
    """Six robots ask at once; the server answers each with its own chunk (equal to an
    unbatched call) using fewer act() calls than requests."""
    srv = PolicyServer(tiny_policy, "openvla_oft", ServerConfig(port=0, batch_window_ms=50.0))
    n = 6
    obs = [good_obs(seed=100 + i) for i in range(n)]
    results: dict[int, np.ndarray] = {}
    sizes: dict[int, int] = {}
    with srv.run_in_thread() as url:
        clients = [PolicyClient(url) for _ in range(n)]
        barrier = threading.Barrier(n)

        def ask(i: int) -> None:
            barrier.wait()
            results[i], timing = clients[i].infer(
                obs[i]["images"], obs[i]["state"], obs[i]["instruction"]
            )
            sizes[i] = timing["batch_size"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for c in clients:
            c.close()
    assert len(results) == n
    assert srv.stats["batches"] < n and max(sizes.values()) > 1
    for i in range(n):
        np.testing.assert_allclose(results[i], reference_actions(tiny_policy, obs[i]), atol=1e-4)


def test_server_config_validation():
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="token"):
        ServerConfig(token="short")
    with pytest.raises(ValueError, match="max_message_bytes"):
        ServerConfig(max_message_bytes=10)


def test_health_check_of_nothing():
    t = time.perf_counter()
    assert not check_health("ws://127.0.0.1:9", timeout=0.5)
    assert time.perf_counter() - t < 5


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e300])
def test_non_finite_policy_actions_are_not_sent(server, tiny_policy, monkeypatch, bad):
    """A policy answering NaN/inf (or float64 values that overflow float32) gets an error
    reply, never the actions; the connection keeps serving."""
    srv, url = server
    real_act = srv._act

    def broken(batch):
        out = real_act(batch).astype(np.float64)
        out[:, 3, 2] = bad
        return out

    obs = good_obs()
    before = srv.stats["non_finite_actions"]
    with PolicyClient(url, TOKEN) as c:
        monkeypatch.setattr(srv, "_act", broken)
        with pytest.raises(ServerError, match="non-finite actions"):
            c.infer(obs["images"], obs["state"], obs["instruction"])
        monkeypatch.undo()
        actions, _ = c.infer(obs["images"], obs["state"], obs["instruction"])
    assert srv.stats["non_finite_actions"] == before + 1
    np.testing.assert_allclose(actions, reference_actions(tiny_policy, obs), atol=1e-5)


def test_failed_authentication_is_throttled_per_peer(tiny_policy, caplog):
    """After a wrong token, further wrong tokens from the peer's address are refused (429, not
    logged, not counted) for auth_failure_delay_s, doubling with each failure; the right token
    is always answered, and does not reset the address's failures."""
    from websockets.exceptions import InvalidStatus

    now = [1000.0]
    srv = PolicyServer(
        tiny_policy, "openvla_oft", ServerConfig(port=0, token=TOKEN, auth_failure_delay_s=2.0)
    )
    srv.clock = lambda: now[0]

    def status(token):
        try:
            PolicyClient(url, token).close()
        except InvalidStatus as e:
            return e.response.status_code
        return 101

    with (
        caplog.at_level("WARNING", logger="rlinf_vla.real_robot.server"),
        srv.run_in_thread() as url,
    ):
        assert status("wrong-token!") == 401
        # A burst of 200 guesses inside the 2 s window: all refused, none counted.
        assert [status(f"guess-{i:08d}") for i in range(200)] == [429] * 200
        assert status(TOKEN) == 101  # the robot's own client, on the same address: served
        now[0] += 2.01
        assert status("wrong-again!") == 401  # second failure: 4 s
        now[0] += 3.9
        assert status("wrong-again!") == 429
        assert status(TOKEN) == 101
        now[0] += 0.2
        assert status("wrong-again!") == 401  # third failure (not reset by the success): 8 s
        now[0] += 7.9
        assert status("guess") == 429
        assert check_health(url)  # the health check is never throttled
    assert srv.stats["rejected_auth"] == 3 and srv.stats["throttled_auth"] == 202
    warnings = [r for r in caplog.records if "bad or missing token" in r.getMessage()]
    assert [w.getMessage().split("(")[1].split(")")[0] for w in warnings] == [
        "1 in a row; refused for 2.0 s",
        "2 in a row; refused for 4.0 s",
        "3 in a row; refused for 8.0 s",
    ]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "gpu-3.lab"])
def test_serving_other_machines_needs_a_token_or_an_explicit_opt_out(host: str) -> None:
    with pytest.raises(
        ValueError, match=r"server\.host=.* serves other machines: set server\.token"
    ):
        ServerConfig(host=host)
    assert ServerConfig(host=host, token=TOKEN).host == host
    assert ServerConfig(host=host, allow_unauthenticated=True).token is None


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "::1", "localhost"])
def test_this_machine_only_needs_no_token(host: str) -> None:
    assert ServerConfig(host=host).token is None


def test_serve_on_a_port_in_use_names_the_key(capsys, tmp_path):
    import socket

    from rlinf_vla import cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main(["serve", "policy=openvla_oft", f"server.port={port}"])
    assert code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"server.host=127.0.0.1 server.port={port}: cannot listen there" in err
    assert "choose another server.port" in err


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::1", "::", "localhost", "gpu-3.lab"])
def test_server_config_accepts_addresses_and_host_names(host: str) -> None:
    assert ServerConfig(host=host, token=TOKEN).host == host


@pytest.mark.parametrize("host", ["0.0.0.0.0", "256.1.1.1", "", "a..b", "-x.lab", "bad_host"])
def test_server_config_refuses_malformed_hosts(host: str) -> None:
    with pytest.raises(ValueError, match=r"server\.host"):
        ServerConfig(host=host)


@pytest.mark.parametrize("name", ["pi0", "smolvla"])
def test_the_flow_matching_families_are_served_their_greedy_actions(name):
    """π0 and SmolVLA behind the same server: the client gets the policy's own greedy chunk
    (the ODE from the noise its greedy seed draws for the observation), and the metadata the
    family's config advertises."""
    from rlinf_vla.policies import make_policy

    policy = make_policy(name, preset="tiny", seed=0).eval()
    srv = PolicyServer(policy, name, ServerConfig(port=0, token=TOKEN, auth_failure_delay_s=0))
    obs = good_obs(seed=3)
    obs["state"] = obs["state"][: policy.config.max_state_dim]
    with srv.run_in_thread() as url, PolicyClient(url, TOKEN) as c:
        assert c.metadata.policy == name and c.metadata.chunk_size == policy.config.chunk_size
        actions, _ = c.infer(obs["images"], obs["state"], obs["instruction"])
        again, _ = c.infer(obs["images"], obs["state"], obs["instruction"])
    want = reference_actions(policy, obs)
    assert actions.shape == (policy.config.chunk_size, policy.config.action_dim)
    np.testing.assert_allclose(actions, want, atol=1e-5)
    np.testing.assert_array_equal(actions, again)
