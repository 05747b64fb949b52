"""End to end on loopback: policy server + client + safety layer + simulated Franka, recorded
episodes read back; the watchdog under a slow server; the e-stop; config validation."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import ClassVar

import numpy as np
import pytest
import torch

from rlinf_vla.cli import COMMANDS, compose, main
from rlinf_vla.config import ConfigError
from rlinf_vla.real_robot.client import PolicyClient
from rlinf_vla.real_robot.deploy import run_episode, validate
from rlinf_vla.real_robot.recording import read_episode
from rlinf_vla.real_robot.safety import INTERVENTIONS, EStop
from rlinf_vla.real_robot.server import PolicyServer, ServerConfig
from rlinf_vla.types import Observation


def deploy_cfg(**overrides):
    cmd = COMMANDS["deploy"]
    return compose(cmd.config_name, [f"{k}={v}" for k, v in overrides.items()], cmd.config_dir)


@pytest.fixture(scope="module")
def served(tiny_policy):
    srv = PolicyServer(tiny_policy, "openvla_oft", ServerConfig(port=0, control_rate_hz=20.0))
    with srv.run_in_thread() as url:
        yield srv, url


@pytest.fixture(scope="module")
def sim_robot():
    from rlinf_vla.real_robot.sim import SimFranka, SimFrankaConfig

    robot = SimFranka(SimFrankaConfig(image_size=32, control_rate_hz=20.0))
    yield robot
    robot.close()


@pytest.mark.sim
def test_loopback_episode_on_the_simulated_franka(served, sim_robot, tiny_policy, tmp_path):
    _, url = served
    job = validate(
        deploy_cfg(
            server=url,
            max_steps=16,
            realtime="false",
            **{"record.output_dir": str(tmp_path), "record.video": "png"},
        )
    )
    with PolicyClient(url) as client:
        res = run_episode(sim_robot, client, job)
    assert res.steps == 16 and res.queries == 2 and res.server_errors == 0 and not res.estopped
    ep = read_episode(res.folder)
    assert len(ep) == 16 and ep.images["main"].shape == (16, 32, 32, 3)
    # The chunk executed at ticks 0..7 is the policy's answer to the observation recorded at tick 0.
    obs = Observation(
        images={k: torch.from_numpy(ep.images[k][:1].copy()) for k in ("main", "wrist")},
        state=torch.from_numpy(ep.steps["state"][:1]),
        instruction=[job.instruction],
    )
    with torch.inference_mode():
        want = tiny_policy.act(obs, greedy=True).actions[0].numpy()
    np.testing.assert_allclose(ep.steps["policy_action"][:8], want, atol=1e-4)
    # What was executed respects the limits; the arm moved and stayed in the box.
    cfg = job.safety
    assert not ep.steps["hold"].any()
    assert np.linalg.norm(ep.steps["action"][:, :3], axis=1).max() <= cfg.max_translation_m + 1e-6
    assert np.linalg.norm(ep.steps["action"][:, 3:6], axis=1).max() <= cfg.max_rotation_rad + 1e-6
    assert np.linalg.norm(ep.steps["ee_pos"][-1] - ep.steps["ee_pos"][0]) > 0.02
    assert np.all(ep.steps["ee_pos"] >= np.array(cfg.workspace_min) - 0.005)
    assert np.all(ep.steps["ee_pos"] <= np.array(cfg.workspace_max) + 0.005)
    assert sum(ep.meta["interventions"].values()) == len(ep.interventions)
    assert ep.meta["policy"]["chunk_size"] == 8 and ep.meta["control_rate_hz"] == 20.0


@pytest.mark.sim
def test_late_chunks_are_dropped_and_the_arm_holds(tiny_policy, sim_robot, tmp_path):
    """Every reply arrives 0.8 s after its observation (2.7x the 0.3 s watchdog): its actions
    are all past their deadline, so none is executed, the arm holds, and each dropped chunk
    is recorded (hold ticks with the policy's action and the watchdog bit)."""

    class Slow(torch.nn.Module):
        config = tiny_policy.config

        def act(self, obs, greedy=False):
            time.sleep(0.8)
            return tiny_policy.act(obs, greedy=greedy)

    srv = PolicyServer(Slow(), "openvla_oft", ServerConfig(port=0, control_rate_hz=20.0))
    with srv.run_in_thread() as url:
        job = validate(
            deploy_cfg(
                server=url,
                max_steps=40,
                **{"record.output_dir": str(tmp_path), "safety.watchdog_s": 0.3},
            )
        )
        with PolicyClient(url) as client:
            res = run_episode(sim_robot, client, job)
    ep = read_episode(res.folder, load_images=False)
    assert res.queries >= 2 and res.interventions["watchdog"] >= 2
    assert ep.steps["hold"].all()  # nothing of a late chunk was executed
    assert np.abs(ep.steps["ee_pos"] - ep.steps["ee_pos"][0]).max() < 1e-3
    dropped = ~np.isnan(ep.steps["policy_action"][:, 0])
    assert dropped.sum() == ep.meta["late_chunks"] >= 1  # one dropped action per late chunk
    late = [i for i in ep.interventions if i["kind"] == "watchdog" and "late" in i["detail"]]
    assert len(late) == ep.meta["late_chunks"]
    mask = ep.steps["interventions"][dropped]
    assert np.all(mask & (1 << INTERVENTIONS.index("watchdog")))


@pytest.mark.sim
def test_a_chunk_within_the_deadline_is_executed(served, sim_robot, tmp_path):
    """Realtime, fast server: the chunk's age (from its observation) is under the deadline,
    so actions are executed. (A generous deadline: on a loaded CI machine the simulated
    ticks overrun 50 ms, and the lateness of a chunk's later actions grows with them.)"""
    _, url = served
    job = validate(
        deploy_cfg(
            server=url,
            max_steps=12,
            **{"record.output_dir": str(tmp_path), "safety.watchdog_s": 3.0},
        )
    )
    with PolicyClient(url) as client:
        res = run_episode(sim_robot, client, job)
    ep = read_episode(res.folder, load_images=False)
    assert (~ep.steps["hold"]).sum() >= 4 and ep.meta["late_chunks"] == 0


class _Recorder:
    """Passes calls to the simulated robot, counting commands and stops."""

    def __init__(self, robot, estop: EStop, trigger_after: int) -> None:
        self.robot, self.estop, self.trigger_after = robot, estop, trigger_after
        self.camera_names = robot.camera_names
        self.commands = self.stops = 0

    def reset(self):
        return self.robot.reset()

    def read(self):
        return self.robot.read()

    def command(self, *args, **kwargs):
        self.commands += 1
        self.robot.command(*args, **kwargs)
        if self.commands == self.trigger_after:  # someone hits the button from another thread
            t = threading.Thread(target=self.estop.trigger, args=("test button",))
            t.start()
            t.join()

    def stop(self):
        self.stops += 1
        self.robot.stop()


@pytest.mark.sim
def test_estop_ends_the_episode_and_stops_the_arm(served, sim_robot, tmp_path):
    _, url = served
    job = validate(deploy_cfg(server=url, max_steps=200, **{"record.output_dir": str(tmp_path)}))
    estop = EStop()
    robot = _Recorder(sim_robot, estop, trigger_after=6)
    with PolicyClient(url) as client:
        res = run_episode(robot, client, job, estop)
    # stop() ran inside trigger (before the next tick); no command was sent after it.
    assert res.estopped and res.steps == 7 and robot.commands == 6 and robot.stops >= 1
    assert res.interventions["estop"] == 1
    ep = read_episode(res.folder, load_images=False)
    assert ep.meta["estop"] == "test button" and ep.steps["hold"].tolist()[-1]
    # The backend brakes within one period (< 0.02 rad) and then holds where it stopped.
    q = sim_robot.joint_positions
    for _ in range(6):
        st = sim_robot.read()
        sim_robot.command(st.ee_pos, st.ee_rot, False)
    assert np.abs(sim_robot.joint_positions - q).max() < 0.03
    q = sim_robot.joint_positions
    st = sim_robot.read()
    sim_robot.command(st.ee_pos, st.ee_rot, False)
    assert np.abs(sim_robot.joint_positions - q).max() < 2e-3


@pytest.mark.sim
def test_cli_deploy_on_loopback(served, tmp_path, capsys):
    _, url = served
    rc = main(
        [
            "deploy",
            "robot=sim",
            f"server={url}",
            "instruction=push the cube",
            "max_steps=4",
            "realtime=false",
            "robot.image_size=32",
            f"record.output_dir={tmp_path}",
        ]
    )
    assert rc == 0
    (folder,) = tmp_path.iterdir()
    ep = read_episode(folder, load_images=False)
    assert len(ep) == 4 and ep.meta["instruction"] == "push the cube"
    assert "episode 0: 4 steps" in capsys.readouterr().out


def test_validation_errors_name_the_key():
    with pytest.raises(ConfigError, match="server must be a ws://"):
        validate(deploy_cfg(server="http://x"))
    with pytest.raises(ConfigError, match="realtime=false"):
        validate(
            deploy_cfg(
                robot="franka",
                realtime="false",
                **{"robot.cameras.main": "1", "robot.cameras.wrist": "2"},
            )
        )
    with pytest.raises(ConfigError, match=r"robot\.cameras"):
        validate(deploy_cfg(robot="franka"))
    with pytest.raises(ConfigError, match="unknown config key"):
        validate(deploy_cfg(**{"+speed": 3}))
    with pytest.raises(ConfigError, match=r"safety\.unknown_limit"):
        validate(deploy_cfg(**{"+safety.unknown_limit": 1}))
    with pytest.raises(ConfigError, match="instruction is empty"):
        validate(deploy_cfg(instruction="' '"))
    job = validate(
        deploy_cfg(
            robot="franka", **{"robot.cameras.main": 123456789012, "robot.cameras.wrist": "2"}
        )
    )
    assert job.robot.cameras == {"main": "123456789012", "wrist": "2"}


def test_serve_validation():
    from rlinf_vla.real_robot.serve import validate as serve_validate

    cmd = COMMANDS["serve"]
    job = serve_validate(compose(cmd.config_name, ["policy=pi0", "server.port=0"], cmd.config_dir))
    assert job.policy_name == "pi0" and job.server.port == 0
    with pytest.raises(ConfigError, match="checkpoint"):
        serve_validate(compose(cmd.config_name, ["policy.checkpoint=/nonexistent"], cmd.config_dir))
    with pytest.raises(ConfigError, match="chunk_size"):
        serve_validate(compose(cmd.config_name, ["policy.chunk_size=0"], cmd.config_dir))
    with pytest.raises(ConfigError, match=r"server\.host"):
        serve_validate(compose(cmd.config_name, ["+server.host_name=x"], cmd.config_dir))


@pytest.mark.sim
def test_cli_deploy_without_a_server_fails_clearly(tmp_path, capsys):
    rc = main(
        [
            "deploy",
            "server=ws://127.0.0.1:9",
            "robot.image_size=32",
            f"record.output_dir={tmp_path}",
        ]
    )
    assert rc == 1
    assert "no answer from the policy server at ws://127.0.0.1:9" in capsys.readouterr().err


class _FakeServer:
    """A websocket server speaking the handshake, answering the first request with a good
    chunk and every later one with ``bad`` (bytes sent as-is)."""

    META: ClassVar[dict] = {
        "type": "metadata",
        "protocol": 1,
        "policy": "fake",
        "image_keys": ["main", "wrist"],
        "image_size": 32,
        "state_dim": 8,
        "state_dim_exact": True,
        "action_dim": 7,
        "chunk_size": 8,
        "control_rate_hz": 20.0,
        "max_message_bytes": 8 * 1024 * 1024,
    }

    def __init__(self, bad) -> None:
        self.bad = bad

    def handler(self, ws) -> None:
        from rlinf_vla.real_robot import codec

        ws.send(codec.packb(self.META))
        for n, frame in enumerate(ws):
            req = codec.unpackb(frame)
            if n == 0:
                good = np.zeros((8, 7), np.float32)
                good[:, 0] = 0.001
                ws.send(codec.packb({"type": "actions", "id": req["id"], "actions": good}))
            else:
                bad = self.bad(req["id"]) if callable(self.bad) else self.bad
                ws.send(bad)

    def __enter__(self) -> str:
        from websockets.sync.server import serve

        self.server = serve(self.handler, "127.0.0.1", 0)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.thread.join(10)


def _reply(actions):
    from rlinf_vla.real_robot import codec

    return lambda req_id: codec.packb({"type": "actions", "id": req_id, "actions": actions})


BAD_REPLIES = {
    "wrong width": (_reply(np.zeros((8, 5), np.float32)), r"shape \[8, 5\], expected \[K, 7\]"),
    "scalar": (_reply(np.float32(0.5)), "not an array"),
    "1-d": (_reply(np.zeros(7, np.float32)), r"shape \[7\]"),
    "empty": (_reply(np.zeros((0, 7), np.float32)), r"shape \[0, 7\]"),
    "nan": (_reply(np.full((8, 7), np.nan, np.float32)), "NaN or inf"),
    "float32 overflow": (_reply(np.full((8, 7), 1e300)), "NaN or inf"),
    "bools": (_reply(np.ones((8, 7), bool)), "dtype bool"),
    "nested lists": (_reply([[0.0] * 7] * 8), "list, not an array"),
    "not a map": (lambda _id: __import__("msgpack").packb([1, 2, 3]), "list, expected a map"),
    "garbage bytes": (b"\xc1\xff\x00garbage", "not a valid message"),
    "text frame": ("hello", "text frame"),
    "wrong id": (
        lambda _id: __import__("msgpack").packb({"type": "actions", "id": -5}),
        "reply to request -5",
    ),
}


@pytest.mark.sim
@pytest.mark.parametrize("case", list(BAD_REPLIES))
def test_a_bad_reply_stops_the_robot_and_keeps_the_recording(case, sim_robot, tmp_path):
    """A malformed reply (after a good first chunk): nothing of it is executed, the robot is
    stopped, the episode so far is written with the reason, and the error names it."""
    from rlinf_vla.config import RunAborted

    bad, pattern = BAD_REPLIES[case]
    with _FakeServer(bad) as url:
        job = validate(
            deploy_cfg(
                server=url,
                max_steps=30,
                realtime="false",
                **{"record.output_dir": str(tmp_path), "robot.image_size": 32},
            )
        )
        estop = EStop()
        robot = _Recorder(sim_robot, estop, trigger_after=10**9)
        with PolicyClient(url) as client, pytest.raises(RunAborted, match=pattern) as info:
            run_episode(robot, client, job, estop)
    assert "the robot was stopped" in str(info.value)
    assert robot.commands == 8 and robot.stops >= 1  # the good chunk only
    (folder,) = tmp_path.iterdir()
    assert str(folder) in str(info.value)
    ep = read_episode(folder, load_images=False)
    assert len(ep) == 8 and ep.steps["policy_action"].shape == (8, 7)
    assert ep.meta["aborted"].startswith("bad reply from the policy server")
    assert not ep.steps["hold"].any()


@pytest.mark.sim
def test_cli_deploy_exits_1_naming_a_bad_reply(sim_robot, tmp_path, capsys):
    bad, _ = BAD_REPLIES["wrong width"]
    with _FakeServer(bad) as url:
        rc = main(
            [
                "deploy",
                f"server={url}",
                "max_steps=20",
                "realtime=false",
                "robot.image_size=32",
                f"record.output_dir={tmp_path}",
            ]
        )
    assert rc == 1
    err = capsys.readouterr().err
    assert "shape [8, 5], expected [K, 7]" in err and "Traceback" not in err
    (folder,) = tmp_path.iterdir()
    assert (folder / "steps.npz").is_file() and (folder / "meta.json").is_file()


@pytest.mark.parametrize(
    "override, key",
    [
        ("action.translation_scale=inf", "action.translation_scale"),
        ("action.rotation_scale=nan", "action.rotation_scale"),
        ("action.rotation_scale=-1", "action.rotation_scale"),
        ("safety.max_rotation_rad=nan", "safety.max_rotation_rad"),
        ("safety.workspace_max=[0.7,inf,0.5]", "safety.workspace_max"),
        ("safety.gripper_threshold=nan", "safety.gripper_threshold"),
        ("safety.tracking_margin_m=-0.001", "safety.tracking_margin_m"),
        ("safety.tracking_margin_m=0.05", "safety.tracking_margin_m"),
        ("control_rate_hz=inf", "control_rate_hz"),
        ("connect_timeout_s=nan", "connect_timeout_s"),
        ("connect_timeout_s=0", "connect_timeout_s"),
        ("robot.physics_dt=inf", "robot.physics_dt"),
        ("robot.cube_pos=[0.5,nan,0.02]", "robot.cube_pos"),
    ],
)
def test_non_finite_config_values_are_refused_naming_the_key(override, key, capsys):
    k, v = override.split("=", 1)
    with pytest.raises(ConfigError, match=re.escape(key)):
        validate(deploy_cfg(**{k: v}))
    assert main(["deploy", override, "--cfg", "job"]) == 2
    assert key in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, key",
    [
        ("server.control_rate_hz=inf", "server.control_rate_hz"),
        ("server.batch_window_ms=nan", "server.batch_window_ms"),
        ("server.auth_failure_delay_s=inf", "server.auth_failure_delay_s"),
    ],
)
def test_non_finite_serve_values_are_refused_naming_the_key(override, key, capsys):
    assert main(["serve", override, "--cfg", "job"]) == 2
    assert key in capsys.readouterr().err


class _OpenpiServer(_FakeServer):
    """An openpi policy server's handshake: metadata without a control rate (openpi's own
    servers advertise none), then nothing."""

    def handler(self, ws) -> None:
        from rlinf_vla.real_robot import codec

        ws.send(codec.packb({}, openpi=True))
        for _ in ws:
            pass


def test_a_server_without_a_control_rate_is_refused_before_the_robot_starts(
    tmp_path, capsys, monkeypatch
):
    from rlinf_vla.real_robot import deploy

    def no_robot(*args, **kwargs):
        raise AssertionError("the robot was started for a server that gives no control rate")

    monkeypatch.setattr(deploy, "make_robot", no_robot)
    with _OpenpiServer(b"") as url:
        args = ["deploy", f"server={url}", "protocol=openpi", "robot.image_size=32"]
        rc = main([*args, f"record.output_dir={tmp_path}"])
    assert rc == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "does not advertise a control rate" in err and "set control_rate_hz" in err
    assert not any(tmp_path.iterdir())  # no episode recorded


def _serving(**metadata):
    """A server whose metadata differs from a good one by ``metadata``."""

    class Server(_FakeServer):
        META: ClassVar[dict] = {**_FakeServer.META, **metadata}

    return Server(b"")


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"action_dim": 6}, "the policy's action_dim is 6; the Franka convention needs 7"),
        ({"state_dim": 5}, "the policy reads a state of 5 values; the robot sends 8"),
        ({"image_keys": ["top"]}, "the policy needs cameras ['top']; robot 'sim' has"),
        ({"control_rate_hz": float("nan")}, "control_rate_hz must be a number, got nan"),
        ({"control_rate_hz": "fast"}, "control_rate_hz must be a number, got 'fast'"),
        ({"control_rate_hz": 0.01}, "control_rate_hz must be in [1, 1000] Hz, got 0.01"),
        ({"control_rate_hz": 1e6}, "control_rate_hz must be in [1, 1000] Hz"),
        ({"chunk_size": 0}, "chunk_size must be an integer >= 1, got 0"),
        ({"chunk_size": -3}, "chunk_size must be an integer >= 1, got -3"),
        ({"image_keys": []}, "image_keys must be a non-empty list"),
    ],
)
def test_a_server_that_does_not_fit_is_refused_before_the_robot_starts(
    metadata, message, tmp_path, capsys, monkeypatch
):
    from rlinf_vla.real_robot import deploy

    def no_robot(*args, **kwargs):
        raise AssertionError("the robot was started for a server that does not fit it")

    monkeypatch.setattr(deploy, "make_robot", no_robot)
    with _serving(**metadata) as url:
        args = ["deploy", f"server={url}", "robot.image_size=32", f"record.output_dir={tmp_path}"]
        rc = main(args)
    assert rc == 1
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "Traceback" not in err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


class _Refuser(_FakeServer):
    """Answers the first two requests, then refuses every one."""

    def handler(self, ws) -> None:
        from rlinf_vla.real_robot import codec

        ws.send(codec.packb(self.META))
        for n, frame in enumerate(ws):
            req = codec.unpackb(frame)
            if n < 2:
                good = np.zeros((8, 7), np.float32)
                ws.send(codec.packb({"type": "actions", "id": req["id"], "actions": good}))
            else:
                refusal = {"type": "error", "id": req["id"], "reason": "out of memory"}
                ws.send(codec.packb({**refusal, "traceback": None}))


@pytest.mark.sim
def test_a_server_that_keeps_refusing_stops_the_episode_with_its_reason(tmp_path, capsys):
    with _Refuser(b"") as url:
        rc = main(
            [
                "deploy",
                f"server={url}",
                "max_steps=60",
                "realtime=false",
                "robot.image_size=32",
                f"record.output_dir={tmp_path}",
            ]
        )
    assert rc == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "the policy server refused 3 requests in a row (the last: out of memory)" in err
    (folder,) = tmp_path.iterdir()
    meta = json.loads((folder / "meta.json").read_text())
    assert "refused 3 requests in a row" in meta["aborted"] and meta["server_errors"] == 3
    steps = np.load(folder / "steps.npz")
    assert len(steps["timestamp"]) < 60  # stopped before its 60 steps


@pytest.mark.sim
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_mid_episode_is_an_estop_in_the_episode_record(served, tmp_path, capsys, sig):
    import os
    import signal

    _, url = served
    timer = threading.Timer(2.0, lambda: os.kill(os.getpid(), getattr(signal, sig)))
    timer.start()
    try:
        rc = main(
            [
                "deploy",
                f"server={url}",
                "max_steps=400",  # 20 s at 20 Hz: the signal comes first
                "robot.image_size=32",
                f"record.output_dir={tmp_path}",
            ]
        )
    finally:
        timer.cancel()
    (folder,) = tmp_path.iterdir()
    ep = read_episode(folder, load_images=False)
    assert ep.meta["estop"] == f"signal {sig}"
    assert 0 < len(ep) < 400 and ep.steps["hold"].tolist()[-1]
    assert rc == {"SIGTERM": 143, "SIGINT": 130}[sig]  # not 0: the run did not complete


@pytest.mark.sim
def test_an_episode_cut_by_the_connection_records_why(tiny_policy, tmp_path, capsys):
    import json as _json

    small = ServerConfig(port=0, control_rate_hz=20.0, max_message_bytes=4096)
    with PolicyServer(tiny_policy, "openvla_oft", small).run_in_thread() as url:
        args = ["deploy", f"server={url}", "max_steps=20", "realtime=false"]
        rc = main([*args, "robot.image_size=64", f"record.output_dir={tmp_path}"])
    assert rc == 1  # two 64 px cameras are more than the server's 4 kB frames
    assert "no answer from the policy server" in capsys.readouterr().err
    (folder,) = tmp_path.iterdir()
    meta = _json.loads((folder / "meta.json").read_text())
    assert "ConnectionClosed" in meta["aborted"] and "1009" in meta["aborted"]


@pytest.mark.sim
def test_a_recording_that_fails_stops_the_robot_and_says_so(
    served, sim_robot, tmp_path, monkeypatch, capsys
):
    """A disk that fills up during an episode: the robot is stopped and the run ends naming
    the recording (exit 1), not the policy server, which answered every query."""
    import errno

    from rlinf_vla.real_robot.deploy import RecordingFailed
    from rlinf_vla.real_robot.recording import EpisodeWriter

    add = EpisodeWriter.add
    calls = []

    def add_until_full(self, **step):
        calls.append(1)
        if len(calls) > 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return add(self, **step)

    monkeypatch.setattr(EpisodeWriter, "add", add_until_full)
    _, url = served
    job = validate(
        deploy_cfg(
            server=url, max_steps=30, realtime="false", **{"record.output_dir": str(tmp_path)}
        )
    )
    estop = EStop()
    robot = _Recorder(sim_robot, estop, trigger_after=10**9)
    with PolicyClient(url) as client, pytest.raises(RecordingFailed) as info:
        run_episode(robot, client, job, estop)
    message = str(info.value)
    assert "recording to" in message and "No space left on device" in message
    assert "the robot was stopped" in message and robot.stops >= 1
    assert robot.commands == 6  # the tick whose record failed was the last
    (folder,) = tmp_path.iterdir()
    assert json.loads((folder / "meta.json").read_text())["aborted"].startswith("recording to")
    # the command: exit 1, the recording named, the server not blamed
    calls.clear()
    record = f"record.output_dir={tmp_path / 'cli'}"
    rc = main(["deploy", f"server={url}", "max_steps=30", "realtime=false", record])
    err = capsys.readouterr().err
    assert rc == 1 and "No space left on device" in err, err
    assert "no answer from the policy server" not in err and "Traceback" not in err
