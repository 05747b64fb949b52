"""SmolVLA held against lerobot's own implementation.

``fixtures/smolvla`` holds two lerobot 0.4 SmolVLA checkpoints on a tiny SmolVLM backbone
(written by ``scripts/make_smolvla_fixtures.py`` with lerobot's code: its ``config.json``,
``model.safetensors`` and processor pipelines) with inputs and the outputs lerobot computed from
them. The port loads them and must give the same pre-processed inputs, velocities (through the
KV cache and in the training pass), denoised actions, env actions and loss; its export must give
back the files lerobot wrote. With a side environment that has lerobot installed
(``$SMOLVLA_LEROBOT_PYTHON``, default ``.venv-lerobot/bin/python`` in the repository) lerobot also runs the
port's export live.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlinf_vla.policies import make_policy
from rlinf_vla.policies.smolvla.model import SmolVLAPolicy, apply_rope, patch_positions
from rlinf_vla.policies.smolvla.processor import SmolVLAInputs
from rlinf_vla.types import Observation
from tests.policies.conftest import make_obs

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures" / "smolvla"
VARIANTS = ("base", "half_expert")
TOL = 1e-4
PRE_STATS = "policy_preprocessor_step_5_normalizer_processor.safetensors"
POST_STATS = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
LEROBOT_PYTHON = Path(
    os.environ.get("SMOLVLA_LEROBOT_PYTHON", ROOT / ".venv-lerobot" / "bin" / "python")
)


def load_fixture(variant: str, **kw) -> SmolVLAPolicy:
    """The lerobot checkpoint; its backbone (``vlm_model_name: vlm``) lies beside it."""
    vlm = str(FIXTURES / "vlm")
    return make_policy(
        "smolvla",
        checkpoint=str(FIXTURES / variant),
        vlm_config=vlm,
        tokenizer=vlm,
        dtype="float32",
        **kw,
    ).eval()


@pytest.fixture(scope="module")
def inputs() -> dict:
    return load_file(str(FIXTURES / "inputs.safetensors"))


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads((FIXTURES / "meta.json").read_text())


def fixture_obs(inputs: dict, meta: dict) -> Observation:
    return Observation(
        images={k: inputs[f"image.{k}"] for k in meta["cameras"]},
        state=inputs["state"],
        instruction=list(meta["tasks"]),
    )


def lerobot_inputs(out: dict) -> SmolVLAInputs:
    keys = ("images", "image_masks", "tokens", "token_mask", "state")
    return SmolVLAInputs(*(out[f"pre.{k}"] for k in keys))


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


# ----------------------------------------------------------------------------------------------
# parity with lerobot's outputs
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpoint_config_is_read(variant):
    policy = load_fixture(variant)
    cfg = policy.config
    data = json.loads((FIXTURES / variant / "config.json").read_text())
    assert cfg.image_keys == ("main", "wrist") and cfg.action_dim == 4
    assert cfg.action_horizon == data["chunk_size"] == 4 and cfg.num_steps == 3
    assert cfg.num_vlm_layers == 4 and len(policy.vlm_with_expert.text_model.layers) == 4
    assert len(policy.vlm_with_expert.lm_expert.layers) == (4 if variant == "base" else 2)
    assert cfg.num_empty_cameras == data["empty_cameras"]
    assert cfg.normalization == "zscore"
    assert cfg.value_hidden_sizes == (512, 256, 128)  # the RL heads of a full-size policy
    stats = load_file(str(FIXTURES / variant / POST_STATS))
    assert torch.equal(torch.tensor(cfg.norm_stats["actions"]["std"]), stats["action.std"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_processor_matches_lerobot(variant, inputs, meta):
    """Image slots (resized, padded at the left and top, empty slots), prompt tokens (with the
    newline, right-padded) and the normalised state are lerobot's."""
    out = load_file(str(FIXTURES / variant / "outputs.safetensors"))
    x = load_fixture(variant).processor(fixture_obs(inputs, meta))
    assert max_err(x.images, out["pre.images"]) <= 1e-6
    assert torch.equal(x.image_masks, out["pre.image_masks"])
    assert torch.equal(x.tokens, out["pre.tokens"])
    assert torch.equal(x.token_mask, out["pre.token_mask"])
    assert not x.token_mask.all()  # the shorter prompt is padded
    assert max_err(x.state, out["pre.state"]) <= 1e-6


@pytest.mark.parametrize("variant", VARIANTS)
def test_velocities_match_lerobot(variant, inputs):
    out = load_file(str(FIXTURES / variant / "outputs.safetensors"))
    policy = load_fixture(variant)
    x = lerobot_inputs(out)
    t = inputs["time"]
    with torch.no_grad():
        v_cache = policy.velocity_from_inputs(x, inputs["x_t"], t)
        tt = t[:, None, None]
        x_t = tt * inputs["noise"] + (1 - tt) * out["pre.actions"]
        v_joint = policy.action_out_proj(policy._joint_pass(x, x_t, t)).float()
    assert out["v_cache"].abs().mean() > 0.1  # order-one outputs: the tolerance means something
    assert max_err(v_cache, out["v_cache"]) <= TOL
    assert max_err(v_joint, out["v_joint"]) <= TOL
    assert max_err(v_cache, out["v_joint"]) > 0.01  # different inputs, different velocities


@pytest.mark.parametrize("variant", VARIANTS)
def test_denoised_actions_match_lerobot(variant, inputs, meta):
    out = load_file(str(FIXTURES / variant / "outputs.safetensors"))
    policy = load_fixture(variant)
    sample = policy.denoise_from_inputs(lerobot_inputs(out), inputs["noise"])
    assert max_err(sample, out["sample"]) <= TOL
    obs = fixture_obs(inputs, meta)
    assert max_err(policy.denoise(obs, inputs["noise"]), out["actions"]) <= TOL
    # greedy act is the same ODE from its own starting noise
    noise = policy.greedy_initial_noise(obs)
    assert torch.equal(policy.act(obs, greedy=True).actions, policy.denoise(obs, noise))


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_matches_lerobot(variant, inputs, meta):
    out = load_file(str(FIXTURES / variant / "outputs.safetensors"))
    policy = load_fixture(variant)
    with torch.no_grad():
        loss = policy.loss(
            fixture_obs(inputs, meta), inputs["actions"], noise=inputs["noise"], time=inputs["time"]
        )
    assert abs(loss.item() - out["loss"].item()) <= TOL * max(1.0, out["loss"].item())


# ----------------------------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=VARIANTS)
def exported(request, tmp_path_factory):
    variant = request.param
    folder = tmp_path_factory.mktemp(f"export_{variant}")
    load_fixture(variant).save_pretrained(folder)
    return variant, folder


def test_export_writes_lerobots_files(exported):
    variant, folder = exported
    source = FIXTURES / variant
    theirs = load_file(str(source / "model.safetensors"))
    ours = load_file(str(folder / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    for name in ("config.json", "policy_preprocessor.json", "policy_postprocessor.json"):
        assert json.loads((folder / name).read_text()) == json.loads((source / name).read_text())
    for name in (PRE_STATS, POST_STATS):
        a, b = load_file(str(folder / name)), load_file(str(source / name))
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)


def test_export_loads_back(exported, inputs, meta):
    variant, folder = exported
    out = load_file(str(FIXTURES / variant / "outputs.safetensors"))
    loaded = make_policy("smolvla", checkpoint=str(folder), dtype="float32")  # no vlm_config=
    obs = fixture_obs(inputs, meta)
    assert max_err(loaded.denoise(obs, inputs["noise"]), out["actions"]) <= TOL


@pytest.mark.skipif(not LEROBOT_PYTHON.exists(), reason="no side environment with lerobot")
def test_lerobot_runs_the_export(exported):
    """lerobot itself loads the port's export and reproduces its stored outputs."""
    variant, folder = exported
    script = ROOT / "scripts" / "make_smolvla_fixtures.py"
    cmd = [str(LEROBOT_PYTHON), str(script), "--check", str(folder), "--variant", variant]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    diffs = json.loads(run.stdout.strip().splitlines()[-1])
    assert max(diffs.values()) <= 1e-5, diffs


# ----------------------------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------------------------
def test_patch_positions_are_transformers4s():
    """transformers 4.x buckets ``i / n * (1 - 1e-6)`` at ``k / side``: on a full 4x4 grid rows
    (and columns) 0 and 1 share an id and the last id is never used."""
    ids = patch_positions(4, 4, 4).view(4, 4)
    assert ids[:, 0].tolist() == [0, 0, 4, 8]
    assert ids[0].tolist() == [0, 0, 1, 2]
    assert patch_positions(2, 2, 4).tolist() == [0, 1, 4, 5]  # a half-size grid


def test_apply_rope_rotates_half_pairs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 8, generator=g)
    pos = torch.tensor([[0, 1, 5], [2, 3, 7]])
    y = apply_rope(x, pos)
    for b, i, h, j in ((0, 1, 2, 1), (1, 2, 0, 3)):
        angle = pos[b, i].item() / 10_000 ** (2 * j / 8)
        x1, x2 = x[b, i, h, j].item(), x[b, i, h, j + 4].item()
        c, s = math.cos(angle), math.sin(angle)
        assert math.isclose(y[b, i, h, j].item(), x1 * c - x2 * s, abs_tol=1e-5)
        assert math.isclose(y[b, i, h, j + 4].item(), x2 * c + x1 * s, abs_tol=1e-5)
    assert torch.equal(apply_rope(x, torch.zeros_like(pos)), x)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_suffix_is_causal_and_prefix_ignores_actions():
    """Changing a later action token changes neither earlier ones' velocities nor the prefix."""
    policy = make_policy("smolvla", preset="tiny", seed=0, action_dim=4, chunk_size=4).eval()
    obs = make_obs(2, ("main", "wrist"), 6)
    inputs = policy.processor(obs)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 8, generator=g)
    t = torch.tensor([0.7, 0.2])
    x2 = x.clone()
    x2[:, 2:] += 1.0
    with torch.no_grad():
        v1, v2 = (
            policy.velocity_from_inputs(inputs, x, t),
            policy.velocity_from_inputs(inputs, x2, t),
        )
        j1 = policy.action_out_proj(policy._joint_pass(inputs, x, t))
    torch.testing.assert_close(v1[:, :2], v2[:, :2], rtol=0, atol=1e-6)
    assert (v1[:, 2:] - v2[:, 2:]).abs().max() > 1e-3
    torch.testing.assert_close(j1, v1, rtol=0, atol=1e-5)  # cache and joint pass agree


@pytest.mark.parametrize(
    "extra",
    [
        {"noise_method": "flow_noise"},
        {"noise_method": "flow_sde", "joint_logprob": True},
        {"noise_method": "flow_sde", "sde_ignore_last": True},
    ],
)
def test_act_and_evaluate_agree(extra):
    kw = {"seed": 0, "action_dim": 4, "chunk_size": 3, "logprob_granularity": "token"}
    policy = make_policy("smolvla", preset="tiny", **kw, **extra)
    obs = make_obs(3, ("main", "wrist"), 6)
    torch.manual_seed(0)
    out = policy.act(obs)
    assert out.actions.shape == (3, 3, 4) and out.logprob.shape == (3, 3, 4)
    assert out.replay["chain"].shape == (3, policy.config.num_steps + 1, 4, 8)
    ev = policy.evaluate(obs, out.replay)
    assert (ev.logprob - out.logprob).abs().max() <= 1e-5
    assert torch.isfinite(ev.entropy).all() and ev.value.shape == (3,)
    # another chain has another log-prob
    other = dict(out.replay, chain=out.replay["chain"] + 0.05)
    assert (policy.evaluate(obs, other).logprob - out.logprob).abs().max() > 1e-3


def test_config_rejects_layouts_lerobot_cannot_run():
    with pytest.raises(ValueError, match="num_expert_layers"):
        make_policy("smolvla", preset="tiny", num_expert_layers=2)  # with self_attn every 2
    make_policy("smolvla", preset="tiny", num_expert_layers=2, self_attn_every_n_layers=0)
    with pytest.raises(ValueError, match="num_expert_layers"):
        make_policy("smolvla", preset="tiny", num_expert_layers=3)  # does not divide 4


def test_unknown_backbone_says_how_to_give_it():
    with pytest.raises(FileNotFoundError, match="vlm_config"):
        make_policy("smolvla", preset="full", vlm_model_name="org/unknown-vlm")


def test_full_preset_is_smolvla_base():
    from rlinf_vla.policies import policy_config

    cfg = policy_config("smolvla", preset="full")
    assert cfg.vlm_width == 960 and cfg.expert_width == 720
    assert cfg.expert_intermediate_size == 2048 and cfg.num_vlm_layers == 16
    assert [i for i in range(16) if cfg.is_self_attn_layer(i)] == list(range(0, 16, 2))


def test_unported_lerobot_option_fails(tmp_path):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "base", folder)
    data = json.loads((folder / "config.json").read_text())
    data["adapt_to_pi_aloha"] = True
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(NotImplementedError, match="adapt_to_pi_aloha"):
        SmolVLAPolicy.config_from_dir(folder, vlm_config=str(FIXTURES / "vlm"))


# ----------------------------------------------------------------------------------------------
# the commands: PPO on the toy env, a behaviour-cloning step
# ----------------------------------------------------------------------------------------------
def test_ppo_iteration_on_the_toy_env(tmp_path):
    """``rlinf-vla train policy=smolvla`` (one process, no Ray): one PPO iteration, and the
    checkpoint is a lerobot SmolVLA folder that loads back."""
    from rlinf_vla import cli

    args = ["placement=local", "placement.stages=1", "cluster.devices_per_node=1", "env=toy"]
    args += ["env.num_envs=2", "env.max_episode_steps=8", "runner.rollout_chunks=2"]
    args += ["algo.update_epochs=1", "policy=smolvla", "policy.image_keys=[main]"]
    args += ["runner.max_iterations=1", "runner.eval_interval=0", f"runner.output_dir={tmp_path}"]
    assert cli.main(["train", *args]) == 0
    [row] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["env_steps"] == 2 * 2 * 4  # envs x chunks x the tiny horizon
    assert row["train/update_steps"] >= 1 and math.isfinite(row["train/policy_loss"])
    assert abs(row["train/ratio_mean"] - 1.0) < 1e-4  # evaluate reproduced act's log-probs
    folder = tmp_path / "checkpoints" / "iter_1" / "policy"
    assert json.loads((folder / "config.json").read_text())["type"] == "smolvla"
    keys = load_file(str(folder / "model.safetensors"))
    assert all(k.startswith("model.") for k in keys)
    policy = make_policy("smolvla", checkpoint=str(folder))
    assert policy.config.image_keys == ("main",)


def test_sft_step_learns_with_the_datas_statistics(tmp_path):
    """``rlinf-vla sft policy=smolvla``'s job and one behaviour-cloning step of its actor (no
    Ray): the statistics reach the policy and its export, and the step changes the weights."""
    from dataclasses import asdict

    import numpy as np

    from rlinf_vla import cli
    from rlinf_vla.data import LeRobotWriter
    from rlinf_vla.pipelines.actor import ActorWorker
    from rlinf_vla.pipelines.sft import validate
    from rlinf_vla.runtime import Device
    from rlinf_vla.runtime.worker import WorkerContext

    writer = LeRobotWriter(tmp_path / "demos", 10, {"main": (16, 16)}, 3, 2)
    rng = np.random.default_rng(0)
    for _ in range(2):
        images = {"main": rng.integers(0, 255, (6, 16, 16, 3), dtype=np.uint8)}
        state = rng.normal(size=(6, 3)).astype(np.float32)
        writer.add_episode(images, state, rng.uniform(-1, 1, (6, 2)).astype(np.float32), "go")
    demos = writer.close()
    args = ["env=toy", "env.action_dim=2", "policy=smolvla", "policy.image_keys=[main]"]
    args += [f"data.paths=[{demos}]", "runner.eval_interval=0", "sft.batch_size=4"]
    args += ["sft.micro_batch_size=2", "sft.lr=1e-3"]
    job = validate(cli.compose("sft", args))
    stats = job.policy_config.norm_stats
    assert len(stats["actions"]["mean"]) == 2 and len(stats["state"]["std"]) == 3
    actor = ActorWorker.__new__(ActorWorker)
    actor._ctx = WorkerContext("actor", 0, 1, Device(0, 0, "local", "127.0.0.1", 0, "cpu"))
    actor.__init__(job.policy_name, job.policy_config, job.algo(1), seed=0)
    counts = actor.load_demonstrations(
        [str(demos)], [asdict(f) for f in job.features], job.policy_config.chunk_size
    )
    assert counts == {"frames": 12, "episodes": 2}
    before = actor.policy.action_out_proj.weight.detach().clone()
    metrics = actor.sft_step(1, 1)
    assert math.isfinite(metrics["train/loss"]) and metrics["train/loss"] > 0
    assert not torch.equal(actor.policy.action_out_proj.weight, before)
    actor.policy.save_pretrained(tmp_path / "export")
    saved = load_file(str(tmp_path / "export" / PRE_STATS))
    assert torch.equal(saved["action.mean"], torch.tensor(stats["actions"]["mean"]))
    assert torch.equal(saved["observation.state.std"], torch.tensor(stats["state"]["std"]))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
