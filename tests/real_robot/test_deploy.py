"""End to end on loopback: policy server + client + safety layer + simulated Franka, recorded
episodes read back; the watchdog under a slow server; the e-stop; config validation."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from rlinf_vla.cli import COMMANDS, compose, main
from rlinf_vla.config import ConfigError
from rlinf_vla.real_robot.client import PolicyClient
from rlinf_vla.real_robot.deploy import run_episode, validate
from rlinf_vla.real_robot.recording import read_episode
from rlinf_vla.real_robot.safety import EStop
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
def test_slow_server_triggers_the_watchdog_and_the_arm_holds(tiny_policy, sim_robot, tmp_path):
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
                max_steps=20,
                **{"record.output_dir": str(tmp_path), "safety.watchdog_s": 0.3},
            )
        )
        with PolicyClient(url) as client:
            res = run_episode(sim_robot, client, job)
    ep = read_episode(res.folder, load_images=False)
    assert res.interventions["watchdog"] >= 1
    first_action = int(np.argmax(~ep.steps["hold"]))
    assert ep.steps["timestamp"][first_action] - ep.steps["timestamp"][0] >= 0.75  # 0.8 s wait
    held = ep.steps["ee_pos"][: first_action + 1]
    assert np.abs(held - held[0]).max() < 1e-3  # the arm did not move while waiting
    kinds = {i["kind"] for i in ep.interventions}
    assert kinds >= {"watchdog"}
    assert any(i["kind"] == "watchdog" and i["step"] <= first_action + 1 for i in ep.interventions)


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
def test_cli_deploy_without_a_server_fails_clearly(tmp_path):
    with pytest.raises(
        RuntimeError, match=r"no answer from the policy server at ws://127\.0\.0\.1:9"
    ):
        main(
            [
                "deploy",
                "server=ws://127.0.0.1:9",
                "robot.image_size=32",
                f"record.output_dir={tmp_path}",
            ]
        )
