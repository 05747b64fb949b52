"""What ``rlinf-vla train`` hands its workers: the typed env and policy configs that validation
resolved, built by the workers as they are (the env's seed, a checkpoint's own settings)."""

from types import SimpleNamespace

import pytest

from rlinf_vla import cli
from rlinf_vla.pipelines import runner as runner_module
from rlinf_vla.pipelines import validate
from rlinf_vla.runtime import Device
from rlinf_vla.runtime.worker import WorkerContext


class _Stop(Exception):
    pass


def _handover(monkeypatch, job):
    """The ``(worker class, args, kwargs)`` the runner gives each group, without Ray."""
    groups = {}

    def group(cluster, cls, name, devices, args=(), kwargs=None, wait=True, channels=False):
        groups[name] = (cls, args, kwargs or {})
        if name == "actor":
            raise _Stop  # every group is described: stop before anything would start
        return SimpleNamespace(shutdown=lambda: None)

    monkeypatch.setattr(runner_module, "WorkerGroup", group)
    channel = SimpleNamespace(close=lambda: None)
    monkeypatch.setattr(runner_module, "Channel", SimpleNamespace(create=lambda name, **_: channel))
    with pytest.raises(_Stop):
        runner_module.EmbodiedRunner(job, SimpleNamespace(num_devices=1, devices=[]))
    return groups


def _build(cls, args, kwargs=None, rank=0, world_size=1):
    """The worker ``cls(*args)`` as rank ``rank`` of its group builds itself (in this process)."""
    worker = cls.__new__(cls)
    device = Device(0, 0, "local", "127.0.0.1", 0, "cpu")
    worker._ctx = WorkerContext(cls.__name__, rank, world_size, device)
    worker.__init__(*args, **(kwargs or {}))
    return worker


def _env_seeds(monkeypatch, tmp_path, overrides):
    args = ["env=toy", "env.num_envs=4", "cluster.devices_per_node=1", "runner.seed=7"]
    job = validate(cli.compose("train", [*args, f"runner.output_dir={tmp_path}", *overrides]))
    cls, worker_args, _ = _handover(monkeypatch, job)["env"]
    seeds = []
    for rank in range(2):  # two env workers: each builds its own share of the envs
        worker = _build(cls, worker_args, rank=rank, world_size=2)
        seeds += [env.config.seed for env in worker.envs]
        worker.close()
    return job, seeds


def test_the_envs_take_the_runner_seed_unless_env_seed_is_set(monkeypatch, tmp_path):
    job, seeds = _env_seeds(monkeypatch, tmp_path, [])
    assert seeds == [7, 7] and job.env_config.seed == 7
    # env.seed=0 equals the env's default: set on the command line, it still wins
    job, seeds = _env_seeds(monkeypatch, tmp_path, ["env.seed=0"])
    assert seeds == [0, 0] and job.env_config.seed == 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from rlinf_vla.policies import make_policy

    path = tmp_path_factory.mktemp("ckpt")
    make_policy("openvla", preset="tiny", chunk_size=4, action_dim=7).save_pretrained(path)
    return path


@pytest.mark.parametrize(("given", "chunk"), [([], 4), (["policy.chunk_size=1"], 1)])
def test_a_checkpoints_chunk_size_wins_unless_the_command_line_sets_one(
    monkeypatch, tmp_path, checkpoint, given, chunk
):
    # OpenVLA's class default is 1; the checkpoint was trained with 4 (policy.chunk_size=1 is
    # set by hand, so it wins although it equals the default).
    args = ["env=toy", "env.num_envs=2", "cluster.devices_per_node=1"]
    args += [f"policy.checkpoint={checkpoint}", f"runner.output_dir={tmp_path}"]
    job = validate(cli.compose("train", [*args, *given]))
    groups = _handover(monkeypatch, job)
    cls, worker_args, kwargs = groups["rollout"]
    rollout = _build(cls, worker_args, kwargs)
    env_cls, env_args, _ = groups["env"]
    env = _build(env_cls, env_args)
    out = rollout.policy.act(env.envs[0].reset())
    env.close()
    assert rollout.policy.config.chunk_size == chunk
    assert tuple(out.actions.shape) == (2, chunk, 7)
    cls, worker_args, kwargs = groups["actor"]
    assert _build(cls, worker_args, kwargs).policy.config.chunk_size == chunk
