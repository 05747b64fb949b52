"""Contract tests over every registered env: shapes, dtypes, determinism, chunks, auto-reset."""

from __future__ import annotations

import os

import pytest
import torch

from rlinf_vla.envs import ENVS, VectorEnv, group_reset_ids, make_env
from rlinf_vla.types import ChunkResult, Observation

# Small, fast settings per env; simulator envs need their package and are marked ``sim``.
SETTINGS: dict[str, dict] = {
    "toy": {"num_envs": 4, "image_size": 32, "max_episode_steps": 6},
    "maniskill": {
        "task": "PickCube-v1",
        "num_envs": 2,
        "image_size": 64,
        "sim_backend": "cpu",
        "max_episode_steps": 6,
    },
    "libero": {
        "suite": "libero_spatial",
        "task_ids": (0,),
        "num_envs": 2,
        "image_size": 64,
        "fast_render": True,
        "settle_steps": 2,
        "max_episode_steps": 6,
    },
    "metaworld": {
        "task": "pick-place-v3",
        "num_envs": 2,
        "image_size": 64,
        "fast_render": True,
        "max_episode_steps": 6,
    },
}
SIM_MODULES = {"maniskill": "mani_skill", "libero": "libero.libero", "metaworld": "metaworld"}
#: Envs whose action is not the 7-D end-effector delta + gripper.
ACTION_DIMS = {"metaworld": 4}


def _params() -> list:
    out = []
    for name in sorted(ENVS):
        marks = [pytest.mark.sim] if name in SIM_MODULES else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def test_every_registered_env_has_settings() -> None:
    assert set(ENVS) == set(SETTINGS)


@pytest.fixture(scope="module", params=_params())
def env(request: pytest.FixtureRequest) -> VectorEnv:
    name = request.param
    if name in SIM_MODULES:
        pytest.importorskip(SIM_MODULES[name])
    e = make_env(name, **SETTINGS[name])
    yield e
    e.close()


def _check_obs(env: VectorEnv, obs: Observation) -> None:
    b = env.num_envs
    assert isinstance(obs, Observation)
    assert "main" in obs.images
    for key, img in obs.images.items():
        assert img.dtype == torch.uint8, key
        assert img.ndim == 4 and img.shape[0] == b and img.shape[3] == 3, (key, img.shape)
    assert obs.state is not None and obs.state.dtype == torch.float32
    assert obs.state.shape[0] == b and obs.state.ndim == 2
    assert torch.isfinite(obs.state).all()
    assert len(obs.instruction) == b and all(isinstance(s, str) and s for s in obs.instruction)


def _check_result(env: VectorEnv, res: ChunkResult, k: int) -> None:
    b = env.num_envs
    _check_obs(env, res.obs)
    assert res.reward.shape == (b, k) and res.reward.dtype == torch.float32
    assert res.terminated.shape == (b, k) and res.terminated.dtype == torch.bool
    assert res.truncated.shape == (b, k) and res.truncated.dtype == torch.bool
    assert res.success.shape == (b,) and res.success.dtype == torch.bool
    assert not (res.terminated & res.truncated).any()
    # at most one end per env and chunk
    assert ((res.terminated | res.truncated).sum(1) <= 1).all()
    for key in ("invalid", "done", "episode_reset_ids", "reset_ids", "elapsed_steps"):
        assert res.info[key].shape == (b,), key
    assert torch.equal(res.info["done"], (res.terminated | res.truncated).any(1))
    if res.final_obs is not None:
        _check_obs(env, res.final_obs)


def test_properties(env: VectorEnv) -> None:
    assert env.num_envs == SETTINGS[env.name]["num_envs"]
    assert env.action_dim == ACTION_DIMS.get(env.name, 7)
    assert env.max_episode_steps == 6


def test_spec_is_what_the_built_env_provides(env: VectorEnv) -> None:
    """``spec()`` is known before the env starts (a policy is sized and checked against it):
    the built env's cameras, action size and state size are those."""
    spec = env.config.spec()
    obs = env.reset(torch.arange(env.num_envs))
    assert spec.state_dim == obs.state.shape[-1]
    assert spec.action_dim == env.action_dim
    assert spec.cameras == tuple(obs.images)


def test_toy_privileged_state_is_the_spec_state_size() -> None:
    e = make_env("toy", **SETTINGS["toy"], state_mode="privileged")
    assert e.reset().state.shape[-1] == e.config.spec().state_dim == 4


def test_reset_is_deterministic(env: VectorEnv) -> None:
    ids = torch.arange(env.num_envs) + 3
    a = env.reset(ids)
    _check_obs(env, a)
    b = env.reset(ids)
    for key in a.images:
        assert torch.equal(a.images[key], b.images[key]), key
    assert torch.allclose(a.state, b.state)
    assert a.instruction == b.instruction
    assert torch.equal(env.reset_ids, ids)


def test_group_reset_gives_identical_scenes(env: VectorEnv) -> None:
    ids = group_reset_ids(torch.tensor([7]), env.num_envs)
    obs = env.reset(ids)
    for key, img in obs.images.items():
        assert torch.equal(img[0], img[-1]), key
    assert torch.allclose(obs.state[0], obs.state[-1])


def test_chunk_step_and_auto_reset(env: VectorEnv) -> None:
    env.reset(torch.arange(env.num_envs))
    k = 4
    res = env.chunk_step(torch.zeros(env.num_envs, k, env.action_dim))
    _check_result(env, res, k)
    assert not res.info["done"].any() or res.terminated.any()
    # 6-step limit: the second chunk truncates at its 2nd step (unless a success came first)
    res2 = env.chunk_step(torch.zeros(env.num_envs, k, env.action_dim))
    _check_result(env, res2, k)
    ended = res.info["done"]
    assert res2.truncated[~ended, 1].all()
    assert not res2.truncated[~ended][:, 2:].any()
    assert res2.final_obs is not None
    # ended envs were auto-reset: fresh episodes with new reset ids
    assert (res2.info["elapsed_steps"][~ended] == 0).all()
    assert not torch.equal(res2.info["reset_ids"], res2.info["episode_reset_ids"])
    # final_obs differs from the reset obs for the ended envs
    i = int(torch.nonzero(~ended)[0])
    assert not torch.equal(res2.final_obs.images["main"][i], res2.obs.images["main"][i])


def test_bad_actions(env: VectorEnv) -> None:
    env.reset()
    with pytest.raises(ValueError, match=r"\[num_envs, K, action_dim\]"):
        env.chunk_step(torch.zeros(env.num_envs, env.action_dim))
    with pytest.raises(ValueError, match="action_dim"):
        env.chunk_step(torch.zeros(env.num_envs, 2, env.action_dim + 1))
    bad = torch.zeros(env.num_envs, 2, env.action_dim)
    bad[1, 1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"env index\(es\) \[1\]"):
        env.chunk_step(bad)


def test_unknown_config_key_is_named() -> None:
    with pytest.raises(TypeError, match="num_env"):
        make_env("toy", num_env=3)


def test_unknown_env_lists_known() -> None:
    with pytest.raises(KeyError, match="toy"):
        make_env("mujoco_soccer")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_envs": 0}, "num_envs"),
        ({"num_envs": 4, "group_size": 3}, "group_size"),
        ({"image_size": 2}, "image_size"),
        ({"video_env_ids": (9,)}, "video_env_ids"),
    ],
)
def test_invalid_config_names_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make_env("toy", **kwargs)


def test_import_needs_no_simulator() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import rlinf_vla.envs as e; "
        "bad = [m for m in ('mani_skill', 'sapien', 'libero', 'mujoco', 'robosuite', 'metaworld') "
        "if m in sys.modules]; assert not bad, bad; print(sorted(e.ENVS))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert "toy" in out.stdout


def test_every_env_declares_its_evaluation_and_dataset_hooks() -> None:
    """``EnvConfig``'s hooks, read before anything starts: every env's protocols are values
    ``rlinf-vla eval`` knows, ``package`` (the settings as given) among them, and its record of
    its default protocol names it; ``none`` is the harness's, never an env's perturbation kind.
    The defaults (toy): ``package`` only, no perturbations, the env's name as the robot."""
    from rlinf_vla.envs import env_config
    from rlinf_vla.eval.protocol import PROTOCOLS

    robots = {}
    for name, cls in ENVS.items():
        protocols = cls.config_cls.eval_protocols()
        assert set(protocols) <= set(PROTOCOLS) and "package" in protocols, name
        assert "none" not in cls.config_cls.eval_perturbations(), name
        cfg = env_config(name)
        assert cfg.protocol_record(protocols[0])["name"] == protocols[0], name
        robots[name] = cfg.robot_type(name)
    assert robots == {"toy": "toy", "maniskill": "panda", "libero": "panda", "metaworld": "sawyer"}
    assert env_config("maniskill", robot="panda_wristcam").robot_type("maniskill") == "panda"
    toy = env_config("toy")
    assert (toy.eval_protocols(), toy.eval_perturbations()) == (("package",), ())
    assert toy.protocol_record("package") == {"name": "package"} and toy.camera_hint() == ""
    with pytest.raises(ValueError, match="env 'toy' has no perturbations"):
        toy.plan_perturbations("toy", ["ood_object"], 0, [])
