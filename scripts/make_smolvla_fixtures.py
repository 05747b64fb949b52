"""Reference outputs of lerobot's own SmolVLA for the parity test of ``policy=smolvla``.

Run with the Python of a virtual environment that has ``lerobot[smolvla]`` (0.4.x) installed;
it needs no network. It builds lerobot's ``SmolVLAPolicy`` on a tiny SmolVLM backbone (its
``config.json`` and tokenizer are written next to the checkpoint, under ``vlm/``) with seeded
random fp32 weights, saves it in lerobot's checkpoint layout (``config.json``,
``model.safetensors``, the pre/post-processor pipelines with their statistics), and stores
inputs with the outputs lerobot computes from them:

- ``v_cache``: the velocity of ``x_t`` at ``t`` through the prefix KV cache (``denoise_step``);
- ``v_joint``: the velocity of the training pass (prefix and suffix at once) at
  ``x_t = t noise + (1 - t) actions``, and ``loss`` (lerobot's ``forward``);
- ``sample``: ``sample_actions`` from ``noise`` (``num_steps`` Euler steps, model space), and
  ``actions``: the env-unit chunk after the post-processor;
- the pre-processed inputs (image slots, prompt tokens, normalised state).

    python scripts/make_smolvla_fixtures.py                   # writes tests/policies/fixtures/smolvla
    python scripts/make_smolvla_fixtures.py --check DIR       # lerobot on another checkpoint folder

``--check DIR`` loads ``DIR`` (e.g. an export of the port) with lerobot, recomputes every output
on the stored inputs of each variant and prints the largest differences to the stored ones as
JSON; it exits with status 1 when one exceeds ``--tol``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "policies" / "fixtures" / "smolvla"
SEED = 0

#: The tiny SmolVLM backbone (``SmolVLMConfig`` arguments).
VLM = {
    "scale_factor": 2,
    "vision_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
    },
    "text_config": {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 256,
    },
    "vocab_size": 128,
}

#: Checkpoint variants: name -> lerobot ``SmolVLAConfig`` arguments beyond the shared ones.
VARIANTS = {
    # smolvla_base's layout: an expert layer beside every VLM layer, cross-attention in every
    # second one, one missing camera filled in as an empty slot
    "base": {"num_vlm_layers": 4, "empty_cameras": 1},
    # half as many expert layers (beside VLM layers 0 and 2 only), cross-attention in every
    # layer (lerobot's only layout with fewer expert layers), the prefix padded to 32 tokens
    "half_expert": {
        "num_vlm_layers": 4,
        "num_expert_layers": 2,
        "self_attn_every_n_layers": 0,
        "prefix_length": 32,
    },
}
STATE_DIM, ACTION_DIM = 5, 4
CAMERAS = {"main": (24, 40), "wrist": (32, 32)}
TASKS = ["pick red cube", "open it\n"]  # 14 and 8 tokens: the second is padded


def tokenizer_files(folder: Path) -> None:
    """A character-level tokenizer of ``VLM``'s vocabulary (SmolVLM's special tokens first,
    no BOS added), saved as ``tokenizer.json``."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    pieces = specials + chars
    pieces += [f"<extra_{i}>" for i in range(VLM["vocab_size"] - len(pieces))]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.save_pretrained(str(folder))


def patch_lerobot(vlm_folders: list[Path]) -> None:
    """Let lerobot read the backbone config and tokenizer from a local folder (it asks the hub
    by ``vlm_model_name``): names are looked up in ``vlm_folders``' parents."""
    import lerobot.policies.smolvla.smolvlm_with_expert as swe
    import lerobot.processor.tokenizer_processor as tp
    from transformers import AutoTokenizer, SmolVLMConfig

    def resolve(name: str) -> str:
        for folder in vlm_folders:
            if (folder.parent / name / "config.json").exists():
                return str(folder.parent / name)
        if Path(name, "config.json").exists():
            return name
        raise FileNotFoundError(f"no local backbone folder for {name!r}")

    tokenizer_token_ids = SimpleNamespace(fake_image_token_id=3, global_image_token_id=4)
    swe.AutoConfig = SimpleNamespace(
        from_pretrained=lambda name, **kw: SmolVLMConfig.from_pretrained(resolve(name))
    )
    swe.AutoProcessor = SimpleNamespace(
        from_pretrained=lambda name, **kw: SimpleNamespace(tokenizer=tokenizer_token_ids)
    )
    tp.AutoTokenizer = SimpleNamespace(
        from_pretrained=lambda name, **kw: AutoTokenizer.from_pretrained(resolve(name))
    )


def randomize(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Weights of order-one activations: matrices ``N(0, 1/fan_in)``, biases ``N(0, 0.1)``,
    norm scales ``1 + N(0, 0.1)``, embeddings ``N(0, 1/width)``."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name or "position_embedding" in name:
                p.copy_(noise / math.sqrt(p.shape[-1]))
            else:
                fan_in = p[0].numel() if p.ndim > 1 else p.shape[0]
                p.copy_(noise / math.sqrt(fan_in))


def statistics(generator: torch.Generator) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for key, dim in (("observation.state", STATE_DIM), ("action", ACTION_DIM)):
        mean = torch.randn(dim, generator=generator)
        std = 0.5 + torch.rand(dim, generator=generator)
        out[key] = {
            "mean": mean,
            "std": std,
            "min": mean - 3 * std,
            "max": mean + 3 * std,
            "q01": mean - 2 * std,
            "q99": mean + 2 * std,
        }
    return out


def make_inputs(generator: torch.Generator) -> dict[str, torch.Tensor]:
    b = len(TASKS)
    inputs = {
        f"image.{k}": torch.randint(0, 256, (b, h, w, 3), generator=generator, dtype=torch.uint8)
        for k, (h, w) in CAMERAS.items()
    }
    inputs["state"] = torch.randn(b, STATE_DIM, generator=generator)
    inputs["actions"] = torch.randn(b, 4, ACTION_DIM, generator=generator)
    inputs["noise"] = torch.randn(b, 4, 8, generator=generator)
    inputs["x_t"] = torch.randn(b, 4, 8, generator=generator)
    inputs["time"] = torch.tensor([0.9, 0.35])
    return inputs


def lerobot_outputs(policy, pre, post, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Everything the parity test compares, computed by lerobot's code."""
    from lerobot.policies.smolvla.modeling_smolvla import make_att_2d_masks

    batch = {
        f"observation.images.{k}": inputs[f"image.{k}"].permute(0, 3, 1, 2).float() / 255.0
        for k in CAMERAS
    }
    batch["observation.state"] = inputs["state"].clone()
    batch["action"] = inputs["actions"].clone()
    batch["task"] = list(TASKS)
    batch = pre(batch)
    model = policy.model
    images, img_masks = policy.prepare_images(batch)
    state = policy.prepare_state(batch)
    tokens = batch["observation.language.tokens"]
    token_mask = batch["observation.language.attention_mask"]
    out = {
        "pre.images": torch.stack(images, 1),
        "pre.image_masks": torch.stack(img_masks, 1),
        "pre.tokens": tokens,
        "pre.token_mask": token_mask.bool(),
        "pre.state": state,
        "pre.actions": policy.prepare_action(batch),
    }
    with torch.no_grad():
        # the velocity through the prefix KV cache
        embs, pad, ar = model.embed_prefix(images, img_masks, tokens, token_mask, state=state)
        mask = make_att_2d_masks(pad, ar)
        _, cache = model.vlm_with_expert.forward(
            attention_mask=mask,
            position_ids=torch.cumsum(pad, dim=1) - 1,
            past_key_values=None,
            inputs_embeds=[embs, None],
            use_cache=True,
            fill_kv_cache=True,
        )
        out["v_cache"] = model.denoise_step(pad, cache, inputs["x_t"], inputs["time"])
        # the training pass: velocity (read at action_out_proj) and loss
        seen = []
        hook = model.action_out_proj.register_forward_hook(lambda m, i, o: seen.append(o))
        noise, time = inputs["noise"], inputs["time"]
        loss, _ = policy.forward(dict(batch), noise=noise, time=time)
        hook.remove()
        out["v_joint"] = seen[0]
        out["loss"] = loss.reshape(1)
        out["sample"] = model.sample_actions(
            images, img_masks, tokens, token_mask, state, noise=noise
        )
        policy.reset()
        chunk = policy.predict_action_chunk(dict(batch), noise=noise)
        out["actions"] = post(chunk)
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def build(variant: dict, folder: Path, stats: dict, generator: torch.Generator):
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors

    features = {
        f"observation.images.{k}": PolicyFeature(FeatureType.VISUAL, (3, h, w))
        for k, (h, w) in CAMERAS.items()
    }
    features["observation.state"] = PolicyFeature(FeatureType.STATE, (STATE_DIM,))
    config = SmolVLAConfig(
        input_features=features,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION_DIM,))},
        chunk_size=4,
        n_action_steps=4,
        max_state_dim=8,
        max_action_dim=8,
        num_steps=3,
        resize_imgs_with_padding=(32, 32),
        tokenizer_max_length=16,
        vlm_model_name="vlm",
        load_vlm_weights=False,
        device="cpu",
        push_to_hub=False,
        **variant,
    )
    policy = SmolVLAPolicy(config)
    randomize(policy, generator)
    policy.eval()
    pre, post = make_smolvla_pre_post_processors(config, dataset_stats=stats)
    policy.save_pretrained(folder)
    pre.save_pretrained(folder)
    post.save_pretrained(folder)
    return policy, pre, post


def load(folder: Path):
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.processor import PolicyProcessorPipeline
    from lerobot.processor.converters import (
        batch_to_transition,
        policy_action_to_transition,
        transition_to_batch,
        transition_to_policy_action,
    )

    policy = SmolVLAPolicy.from_pretrained(str(folder))
    policy.eval()
    pre = PolicyProcessorPipeline.from_pretrained(
        str(folder),
        "policy_preprocessor.json",
        to_transition=batch_to_transition,
        to_output=transition_to_batch,
    )
    post = PolicyProcessorPipeline.from_pretrained(
        str(folder),
        "policy_postprocessor.json",
        to_transition=policy_action_to_transition,
        to_output=transition_to_policy_action,
    )
    return policy, pre, post


def generate(out: Path) -> None:
    import lerobot
    from safetensors.torch import save_file
    from transformers import SmolVLMConfig

    out.mkdir(parents=True, exist_ok=True)
    vlm = out / "vlm"
    vlm.mkdir(exist_ok=True)
    SmolVLMConfig(**VLM).save_pretrained(str(vlm))
    tokenizer_files(vlm)
    patch_lerobot([vlm])
    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    inputs = make_inputs(generator)
    save_file(inputs, str(out / "inputs.safetensors"))
    meta = {"tasks": TASKS, "cameras": list(CAMERAS), "lerobot": lerobot.__version__}
    for name, variant in VARIANTS.items():
        folder = out / name
        stats = statistics(generator)
        policy, pre, post = build(variant, folder, stats, generator)
        save_file(lerobot_outputs(policy, pre, post, inputs), str(folder / "outputs.safetensors"))
        meta[name] = variant
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def check(folder: Path, variant: str, tol: float) -> int:
    from safetensors.torch import load_file

    patch_lerobot([folder / "vlm", FIXTURES / "vlm"])
    inputs = load_file(str(FIXTURES / "inputs.safetensors"))
    expected = load_file(str(FIXTURES / variant / "outputs.safetensors"))
    got = lerobot_outputs(*load(folder), inputs)
    diffs = {
        k: float((got[k].float() - expected[k].float()).abs().max())
        if got[k].shape == expected[k].shape
        else float("inf")
        for k in expected
    }
    print(json.dumps(diffs))
    return int(max(diffs.values()) > tol)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=FIXTURES)
    parser.add_argument("--check", type=Path, help="a SmolVLA checkpoint folder to run")
    parser.add_argument("--variant", default="base", choices=sorted(VARIANTS))
    parser.add_argument("--tol", type=float, default=1e-5)
    args = parser.parse_args()
    if args.check is not None:
        return check(args.check, args.variant, args.tol)
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
