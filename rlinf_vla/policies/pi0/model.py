"""π0 and π0.5 on transformers 5.x Gemma/PaliGemma blocks, with Flow-SDE / Flow-Noise RL.

Model (openpi ``PI0Pytorch`` + ``PaliGemmaWithExpertModel``; keys as in openpi's PyTorch
``model.safetensors``, or with lerobot's ``model.`` prefix):

- ``paligemma_with_expert.paligemma``: SigLIP + projector + Gemma LM (the VLM, "prefix");
- ``paligemma_with_expert.gemma_expert.model``: the Gemma action expert ("suffix"); both run
  layer by layer with **one joint attention** over ``prefix + suffix`` (mixture of transformers):
  the prefix attends bidirectionally to itself, the suffix block-causally (π0: the state token
  sees the prefix and itself, the action tokens see everything);
- π0: ``state_proj``, ``action_in_proj``, ``action_time_mlp_in/out`` (time enters by
  concatenation), ``action_out_proj``; π0.5: ``action_in_proj``, ``time_mlp_in/out`` (time enters
  through adaRMS norms in the expert), ``action_out_proj``.

Flow matching (t = 1 is noise, t = 0 is data): ``x_t = t noise + (1 - t) a``, target
``u = noise - a``; training times ``Beta(1.5, 1) * 0.999 + 0.001``; sampling integrates
``x <- x - dt v(x, t)`` over ``t_k = linspace(1, 1/K, K)`` (openpi: K = 10).

RL (RLinf / πRL; MODELS.md §4), with ``Δ = t_k - t_{k+1}``, ``x0 = x - t v``, ``x1 = x + (1-t) v``:

- Flow-SDE: one step ``k*`` per sample is stochastic,
  ``sigma = a sqrt(t / (1 - t'))`` (``t' = t_1`` at ``t = 1``),
  ``mean = x0 (1 - t + Δ) + x1 (t - Δ - sigma² Δ / (2 t))``, ``std = sqrt(Δ) sigma``; other steps
  are the ODE ``mean = x - Δ v``. The log-prob is ``log N(x_{k*+1}; mean, std²)``. With
  ``joint_logprob`` every step is that stochastic step, scored as Flow-Noise below.
- Flow-Noise: every step ``x_{k+1} ~ N(x - Δ v, std_θ²)`` with a learned std in
  ``[0.08, 0.16]``; the log-prob is the mean over the ``K + 1`` terms ``log N(x_0; 0, I)`` and
  ``log N(x_{k+1}; mean_k, std_k²)``.

Log-probs are per element of the executed actions ``[:, :K_exec, :A_env]``, then summed to the
configured granularity. ``replay``: ``chain [B, K+1, H, D]`` (every denoising state) and, for
one-step Flow-SDE, ``denoise_index [B]``.

Greedy ``act`` integrates the ODE (no SDE / learned noise) from ``x_0``: by default
(``greedy_noise="sample"``) a ``N(0, I)`` draw, as openpi's ``sample_actions`` starts from, taken
from a generator seeded by ``greedy_seed`` and a hash of each observation
(:meth:`Pi0Policy.greedy_initial_noise`), so greedy actions are a fixed function of the
observation (reproducible evaluations, whatever the batching, and untouched by torch's global
RNG); ``greedy_noise="zero"`` starts from the noise mode ``x_0 = 0`` instead.

Export (:meth:`Pi0Policy.save_pretrained`): openpi's PyTorch checkpoint layout, which
``openpi.policies.policy_config.create_trained_policy`` serves: one ``model.safetensors`` whose keys
are exactly those that ``safetensors.torch.load_model(PI0Pytorch(...), ...)`` requires (strict),
and ``assets/<asset_id>/norm_stats.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from abc import abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlinf_vla.policies.base import (
    CheckpointMismatchError,
    Policy,
    check_state_dict,
    find_checkpoint,
    load_rl_heads,
    load_safetensors_dir,
    register_policy,
    save_rl_heads,
    save_safetensors_dir,
    seeded,
)
from rlinf_vla.policies.heads import ValueHead, gaussian_entropy, gaussian_logprob
from rlinf_vla.policies.pi0.config import RUN_FIELDS, FlowMatchingConfig, Pi0Config
from rlinf_vla.policies.pi0.processor import (
    LEROBOT_BUFFER_PREFIXES,
    NORM_STATS_LOCATIONS,
    Pi0Inputs,
    Pi0Processor,
    find_norm_stats,
    write_openpi_norm_stats,
)
from rlinf_vla.types import ActOutput, EvalOutput, Observation

__all__ = [
    "AdaRMSNorm",
    "ExploreNoiseNet",
    "FlowMatchingPolicy",
    "PaliGemmaWithExpert",
    "Pi0Policy",
    "make_att_2d_masks",
    "posemb_sincos",
    "sample_time",
]

log = logging.getLogger(__name__)

_MASK_VALUE = -2.3819763e38  # openpi's additive mask value (finite: no NaN on empty rows)


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------
def posemb_sincos(t: Tensor, dim: int, min_period: float, max_period: float) -> Tensor:
    """Sine-cosine time embedding ``[B] -> [B, dim]``: ``fraction = linspace(0, 1, dim/2)``,
    ``period = min * (max/min) ** fraction``, ``[sin(2 pi t / period), cos(2 pi t / period)]``."""
    if dim % 2:
        raise ValueError(f"dim must be even, got {dim}")
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    x = 2 * math.pi * t.double()[:, None] / period[None]
    return torch.cat([torch.sin(x), torch.cos(x)], dim=1).float()


def sample_time(n: int, alpha: float = 1.5, beta: float = 1.0, device: Any = "cpu") -> Tensor:
    """Training times ``Beta(alpha, beta) * 0.999 + 0.001`` (``[n]``)."""
    dist = torch.distributions.Beta(torch.tensor(alpha), torch.tensor(beta))
    return (dist.sample((n,)) * 0.999 + 0.001).to(device)


def make_att_2d_masks(pad: Tensor, ar: Tensor) -> Tensor:
    """``attn[b, i, j] = cumsum(ar)[j] <= cumsum(ar)[i] and pad[i] and pad[j]`` (``[B, N, N]``):
    tokens with ``ar = 0`` share the block of the token before them (bidirectional inside a
    block), ``ar = 1`` starts a new block that earlier blocks cannot see."""
    cum = ar.long().cumsum(1)
    att = cum[:, None, :] <= cum[:, :, None]
    return att & (pad[:, None, :] & pad[:, :, None])


class AdaRMSNorm(nn.Module):
    """π0.5's adaptive RMSNorm: ``scale, shift, gate = dense(cond)``;
    ``y = x / rms(x) * (1 + scale) + shift`` (float32), and the ``gate`` for the residual."""

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)
        nn.init.zeros_(self.dense.weight)

    def forward(self, x: Tensor, cond: Tensor) -> tuple[Tensor, Tensor]:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        scale, shift, gate = self.dense(cond.to(self.dense.weight.dtype))[:, None].chunk(3, dim=-1)
        out = normed * (1 + scale.float()) + shift.float()
        return out.to(x.dtype), gate.to(x.dtype)


class ExploreNoiseNet(nn.Module):
    """Flow-Noise's learned std: ``MLP(tanh)(h) -> tanh -> logvar`` in
    ``[log low², log high²]``, ``std = exp(logvar / 2)`` (``[..., D_in] -> [..., D_out]``)."""

    def __init__(
        self, in_dim: int, out_dim: int, hidden: tuple[int, ...], std_range: tuple[float, float]
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = in_dim
        for h in hidden:
            layers += [nn.Linear(d, h), nn.Tanh()]
            d = h
        layers.append(nn.Linear(d, out_dim))
        self.mlp = nn.Sequential(*layers)
        lo, hi = std_range
        self.register_buffer("logvar_min", torch.tensor(2 * math.log(lo)), persistent=False)
        self.register_buffer("logvar_max", torch.tensor(2 * math.log(hi)), persistent=False)

    def forward(self, h: Tensor) -> Tensor:
        y = torch.tanh(self.mlp(h.float()))
        logvar = self.logvar_min + (self.logvar_max - self.logvar_min) * (y + 1) / 2
        return torch.exp(0.5 * logvar)


class _Expert(nn.Module):
    """Holds the expert ``GemmaModel`` as ``.model`` (openpi's ``GemmaForCausalLM`` naming,
    without its unused ``lm_head`` and ``embed_tokens``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


class PaliGemmaWithExpert(nn.Module):
    """PaliGemma (``paligemma``) and the Gemma action expert (``gemma_expert``) run jointly."""

    def __init__(self, config: Pi0Config) -> None:
        super().__init__()
        from transformers import GemmaConfig, GemmaModel, PaliGemmaConfig
        from transformers import PaliGemmaForConditionalGeneration as PaliGemma

        t = dict(config.text_config)
        vocab = int(t["vocab_size"])
        pali_cfg = PaliGemmaConfig(
            vision_config={**config.vision_config, "vision_use_head": False},
            text_config={**t, "hidden_activation": "gelu_pytorch_tanh"},
            projection_dim=int(t["hidden_size"]),
            image_token_index=vocab - 1,
            vocab_size=vocab,
        )
        pali_cfg.vision_config.projection_dim = int(t["hidden_size"])
        self.paligemma = PaliGemma(pali_cfg)
        e = {k: v for k, v in config.expert_config.items() if k != "vocab_size"}
        expert_cfg = GemmaConfig(
            **e,
            vocab_size=1,
            hidden_activation="gelu_pytorch_tanh",
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        )
        expert = GemmaModel(expert_cfg)
        expert.embed_tokens = None
        if config.pi05:
            width = int(e["hidden_size"])
            for layer in expert.layers:
                layer.input_layernorm = AdaRMSNorm(width, width)
                layer.post_attention_layernorm = AdaRMSNorm(width, width)
            expert.norm = AdaRMSNorm(width, width)
        self.gemma_expert = _Expert(expert)
        self.gradient_checkpointing = False

    @property
    def vlm(self) -> nn.Module:
        return self.paligemma.model.language_model

    def embed_image(self, pixels: Tensor) -> Tensor:
        """``[B, 3, S, S]`` in ``[-1, 1]`` -> projected patch tokens ``[B, P, D_vlm]``."""
        model = self.paligemma.model
        dtype = model.multi_modal_projector.linear.weight.dtype
        hidden = model.vision_tower(pixel_values=pixels.to(dtype)).last_hidden_state
        return model.multi_modal_projector(hidden)

    def embed_language(self, tokens: Tensor) -> Tensor:
        """Token embeddings, scaled by ``sqrt(width)`` inside Gemma's embedding module."""
        return self.vlm.embed_tokens(tokens)

    @staticmethod
    def _norm(norm: nn.Module, x: Tensor, cond: Tensor | None) -> tuple[Tensor, Tensor | None]:
        if isinstance(norm, AdaRMSNorm):
            return norm(x, cond)
        return norm(x), None

    def _layer(
        self,
        i: int,
        hs: list[Tensor | None],
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        past: tuple[Tensor, Tensor] | None,
        cond: Tensor | None,
    ) -> tuple[list[Tensor | None], tuple[Tensor, Tensor]]:
        from transformers.models.gemma.modeling_gemma import apply_rotary_pos_emb

        layers = (self.vlm.layers[i], self.gemma_expert.model.layers[i])
        conds = (None, cond)
        qs, ks, vs, gates = [], [], [], []
        for h, layer, c in zip(hs, layers, conds, strict=True):
            if h is None:
                gates.append(None)
                continue
            normed, gate = self._norm(layer.input_layernorm, h, c)
            gates.append(gate)
            attn = layer.self_attn
            shape = (h.shape[0], h.shape[1], -1, attn.head_dim)
            qs.append(attn.q_proj(normed).view(shape).transpose(1, 2))
            ks.append(attn.k_proj(normed).view(shape).transpose(1, 2))
            vs.append(attn.v_proj(normed).view(shape).transpose(1, 2))
        q, k, v = torch.cat(qs, 2), torch.cat(ks, 2), torch.cat(vs, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        rep = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, kr.transpose(2, 3)) * layers[0].self_attn.scaling
        probs = torch.softmax(scores.float() + mask, dim=-1).to(q.dtype)
        att = torch.matmul(probs, vr).transpose(1, 2)
        att = att.reshape(att.shape[0], att.shape[1], -1)
        out: list[Tensor | None] = []
        start = 0
        for h, layer, c, gate in zip(hs, layers, conds, gates, strict=True):
            if h is None:
                out.append(None)
                continue
            n = h.shape[1]
            o = layer.self_attn.o_proj(att[:, start : start + n])
            start += n
            h = h + (o * gate if gate is not None else o)
            normed, gate2 = self._norm(layer.post_attention_layernorm, h, c)
            m = layer.mlp(normed)
            out.append(h + (m * gate2 if gate2 is not None else m))
        return out, (k, v)

    def forward(
        self,
        embeds: list[Tensor | None],
        mask: Tensor,
        positions: Tensor,
        past: list[tuple[Tensor, Tensor]] | None = None,
        cond: Tensor | None = None,
    ) -> tuple[list[Tensor | None], list[tuple[Tensor, Tensor]]]:
        """Run ``[prefix, suffix]`` (either may be ``None``) through all layers.

        Args:
            embeds: prefix ``[B, Np, Dv]`` and/or suffix ``[B, Ns, De]`` input embeddings.
            mask: ``bool [B, Nq, Nk]`` attention mask (keys include the cached prefix).
            positions: RoPE positions ``[B, Nq]``.
            past: per-layer ``(k, v)`` of a previous prefix pass.
            cond: π0.5's adaRMS condition ``[B, De]``.

        Returns:
            final-normed outputs ``[prefix, suffix]`` and the per-layer ``(k, v)``.
        """
        ref = next(h for h in embeds if h is not None)
        cos, sin = self.vlm.rotary_emb(ref, positions)
        add_mask = torch.where(mask[:, None], 0.0, _MASK_VALUE).float()
        hs = list(embeds)
        cache = []
        for i in range(len(self.vlm.layers)):
            layer_past = past[i] if past is not None else None
            if self.gradient_checkpointing and self.training:
                hs, kv = torch.utils.checkpoint.checkpoint(
                    self._layer, i, hs, cos, sin, add_mask, layer_past, cond, use_reentrant=False
                )
            else:
                hs, kv = self._layer(i, hs, cos, sin, add_mask, layer_past, cond)
            cache.append(kv)
        outs: list[Tensor | None] = []
        norms = (self.vlm.norm, self.gemma_expert.model.norm)
        for h, norm, c in zip(hs, norms, (None, cond), strict=True):
            outs.append(None if h is None else self._norm(norm, h, c)[0])
        return outs, cache


# ----------------------------------------------------------------------------------------------
# Policy
# ----------------------------------------------------------------------------------------------
_OPENPI_PREFIX = "paligemma_with_expert."
#: openpi's ``PaliGemmaForConditionalGeneration`` output head, tied to the token embedding:
#: ``safetensors.torch.save_model`` stores the pair under this (alphabetically first) name.
_TIED_HEAD = "paligemma_with_expert.paligemma.lm_head.weight"
_EMBED = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
#: openpi's expert is a ``GemmaForCausalLM`` whose ``embed_tokens`` is removed after its
#: ``lm_head`` was tied to it: the head stays, an unused ``[vocab, expert width]`` parameter
#: that openpi's strict loader still requires.
_EXPERT_HEAD = "paligemma_with_expert.gemma_expert.lm_head.weight"
#: ``assets/<asset_id>/`` of an export when neither the config nor the checkpoint names one.
DEFAULT_ASSET_ID = "default"
#: Optional keys of openpi / lerobot files that this port does not use.
_IGNORED_KEYS = re.compile(
    r"paligemma_with_expert\.(gemma_expert\.lm_head\.weight|gemma_expert\.model\.embed_tokens\.weight)"
)
LORA_TARGETS = (
    r".*(paligemma\.model\.language_model|gemma_expert\.model)\.layers\.\d+\."
    r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
)


class FlowMatchingPolicy(Policy):
    """The flow-matching RL machinery shared by π0 / π0.5 and SmolVLA: the denoising chain,
    Flow-SDE / Flow-Noise log-probabilities, values and the flow-matching loss.

    A family provides ``processor`` (called on an observation; ``normalize_actions`` /
    ``unnormalize_actions``), ``action_out_proj``, ``value_head``, ``noise_head`` and three
    passes: :meth:`_prefix_pass` (``{"pad", "cache", "out"}``), :meth:`_suffix_pass` (the
    expert's action outputs against the cached prefix) and :meth:`_joint_pass` (both at once,
    for the loss).
    """

    config: FlowMatchingConfig

    def _make_rl_heads(self, expert_width: int, prefix_width: int) -> None:
        """The value head (on the expert's or the prefix's outputs, ``value_source``) and, for
        Flow-Noise, the noise-std net on the expert's outputs."""
        cfg = self.config
        value_dim = expert_width if cfg.value_source == "expert" else prefix_width
        self.value_head = (
            ValueHead(value_dim, cfg.value_hidden_sizes, 1, "relu") if cfg.value_head else None
        )
        self.noise_head = (
            ExploreNoiseNet(
                expert_width, cfg.max_action_dim, cfg.noise_hidden_sizes, cfg.noise_std_range
            )
            if cfg.noise_method == "flow_noise"
            else None
        )

    @abstractmethod
    def _prefix_pass(self, inputs: Any) -> dict[str, Any]:
        """The observation prefix: ``pad [B, Np]``, the per-layer ``cache`` and ``out``."""

    @abstractmethod
    def _suffix_pass(self, inputs: Any, prefix: dict[str, Any], x: Tensor, t: Tensor) -> Tensor:
        """The expert's outputs at the ``H`` action tokens ``[B, H, D_expert]``."""

    @abstractmethod
    def _joint_pass(self, inputs: Any, x: Tensor, t: Tensor) -> Tensor:
        """:meth:`_suffix_pass`'s outputs from one pass over prefix and suffix (training)."""

    def velocity(self, obs: Observation, x: Tensor, t: Tensor) -> Tensor:
        """``v_θ(x, t)`` ``float32 [B, H, D]`` for model-space states ``x`` and times ``t [B]``."""
        inputs = self.processor(obs, self.device)
        out = self._suffix_pass(
            inputs, self._prefix_pass(inputs), x.to(self.device), t.to(self.device)
        )
        return self.action_out_proj(out).float()

    def _prefix_value(self, prefix: dict[str, Any]) -> Tensor | None:
        if self.value_head is None:
            return None
        h, pad = prefix["out"], prefix["pad"].to(prefix["out"].dtype)
        h = (h * pad[..., None]).sum(1) / pad.sum(1, keepdim=True).clamp(min=1)
        h = h.detach() if self.config.detach_value_input else h
        return self.value_head(h.float()).squeeze(-1)

    def _expert_value(self, suffix_out: Tensor) -> Tensor:
        h = suffix_out[:, : self.config.chunk_size].mean(1)
        h = h.detach() if self.config.detach_value_input else h
        return self.value_head(h.float()).squeeze(-1)

    # -- the denoising chain -----------------------------------------------------------------
    def timesteps(self, device: Any = "cpu") -> Tensor:
        """``t_0 = 1 > ... > t_{K-1} = 1/K`` and ``t_K = 0`` (``[K + 1]``)."""
        k = self.config.num_steps
        t = torch.linspace(1.0, 1.0 / k, k, device=device)
        return torch.cat([t, torch.zeros(1, device=device)])

    def sde_sigmas(self, device: Any = "cpu") -> Tensor:
        """Flow-SDE ``sigma_k = a sqrt(t_k / (1 - t'_k))`` with ``t'_0 = t_1`` (``[K]``)."""
        t = self.timesteps(device)
        denom = torch.where(t == 1, t[1], t)
        return self.config.noise_level * torch.sqrt(t / (1 - denom))[:-1]

    def _step(
        self, x: Tensor, v: Tensor, k: Tensor, suffix_out: Tensor, stochastic: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Mean and std of ``x_{k+1}`` given ``x = x_k`` (``[B, H, D]``), ``k [B]``, and the
        per-sample flag ``stochastic [B]`` (Flow-SDE's chosen step; ODE elsewhere)."""
        ts = self.timesteps(x.device)
        t = ts[k][:, None, None]
        delta = (ts[k] - ts[k + 1])[:, None, None]
        ode_mean = x - delta * v
        if self.config.noise_method == "flow_noise":
            return ode_mean, self.noise_head(suffix_out)
        sigma = self.sde_sigmas(x.device)[k][:, None, None]
        x0, x1 = x - t * v, x + (1 - t) * v
        sde_mean = x0 * (1 - t + delta) + x1 * (t - delta - sigma**2 * delta / (2 * t))
        std = (torch.sqrt(delta) * sigma).expand_as(x)
        s = stochastic[:, None, None]
        return torch.where(s, sde_mean, ode_mean), torch.where(s, std, torch.zeros_like(std))

    def _crop(self, x: Tensor) -> Tensor:
        """Per-element ``[B, H, D]`` -> the executed actions ``[B, K, A]``."""
        return x[:, : self.config.chunk_size, : self.config.action_dim]

    def greedy_initial_noise(self, obs: Observation) -> Tensor:
        """Greedy ``act``'s starting noise ``x_0`` ``float32 [B, H, D]`` (on the CPU): per
        observation, ``N(0, I)`` drawn by a CPU generator seeded with a hash of ``greedy_seed``
        and the observation (its images, state and instruction). Equal observations get equal
        noise whatever their batch, other observations independent-looking draws, and torch's
        global RNG is left alone; ``greedy_noise="zero"`` gives zeros."""
        cfg = self.config
        shape = (cfg.action_horizon, cfg.max_action_dim)
        if cfg.greedy_noise == "zero":
            return torch.zeros(obs.batch_size, *shape)
        rows = []
        images = {k: obs.images[k].cpu().contiguous() for k in sorted(obs.images)}
        state = obs.state.detach().cpu().float().contiguous() if obs.state is not None else None
        for i in range(obs.batch_size):
            h = hashlib.blake2b(digest_size=8, key=str(cfg.greedy_seed).encode())
            for k, img in images.items():
                h.update(k.encode())
                h.update(img[i].numpy().tobytes())
            if state is not None:
                h.update(state[i].numpy().tobytes())
            h.update(obs.instruction[i].encode())
            g = torch.Generator().manual_seed(int.from_bytes(h.digest(), "little") >> 1)
            rows.append(torch.randn(shape, generator=g))
        return torch.stack(rows)

    @torch.no_grad()
    def act(self, obs: Observation, greedy: bool = False) -> ActOutput:
        cfg = self.config
        inputs = self.processor(obs, self.device)
        prefix = self._prefix_pass(inputs)
        b, device = obs.batch_size, self.device
        shape = (b, cfg.action_horizon, cfg.max_action_dim)
        if greedy:
            x = self.greedy_initial_noise(obs).to(device)
        else:
            x = torch.randn(shape, device=device)
        n_choices = cfg.num_steps - 1 if cfg.sde_ignore_last else cfg.num_steps
        one_step = cfg.one_sde_step
        if one_step:
            chosen = (
                torch.zeros(b, dtype=torch.long, device=device)
                if greedy
                else torch.randint(0, n_choices, (b,), device=device)
            )
        else:
            chosen = torch.full((b,), -1, dtype=torch.long, device=device)
        chain, steps = [x], []
        for k in range(cfg.num_steps):
            ks = torch.full((b,), k, dtype=torch.long, device=device)
            if greedy:  # the plain ODE at every step (Flow-SDE's drift term left out too)
                stochastic = torch.zeros(b, dtype=torch.bool, device=device)
            elif one_step:
                stochastic = chosen == k
            else:
                stochastic = ks >= 0
            mean, std, out = self._transition(inputs, prefix, x, ks, stochastic)
            steps.append((mean, std, out))
            x = mean if greedy else mean + std * torch.randn_like(mean)
            chain.append(x)
        replay = {"chain": torch.stack(chain, dim=1)}
        if one_step:
            replay["denoise_index"] = chosen
            # Flow-SDE re-scores the chosen steps in one batched pass, exactly as ``evaluate``.
            scored = self._score(inputs, prefix, replay)
        else:
            # Every step scored: the passes above are the ones ``evaluate`` runs.
            scored = self._score(inputs, prefix, replay, steps)
        actions = self.processor.unnormalize_actions(x[:, : cfg.chunk_size].cpu()).to(device)
        return ActOutput(
            actions=actions.float(), logprob=scored.logprob, value=scored.value, replay=replay
        )

    def _transition(
        self, inputs: Any, prefix: dict[str, Any], x: Tensor, k: Tensor, stochastic: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Mean and std of ``x_{k+1}`` from ``x_k = x`` (``[B, H, D]``) at steps ``k [B]``, and
        the expert's action outputs."""
        out = self._suffix_pass(inputs, prefix, x, self.timesteps(x.device)[k])
        v = self.action_out_proj(out).float()
        mean, std = self._step(x, v, k, out, stochastic)
        return mean, std, out

    def _score(
        self,
        inputs: Any,
        prefix: dict[str, Any],
        replay: dict[str, Tensor],
        steps: list[tuple[Tensor, Tensor, Tensor]] | None = None,
    ) -> EvalOutput:
        """Log-prob, entropy and value of a stored chain (the same code for act and evaluate;
        ``steps``: the per-step transitions ``act`` already computed, Flow-Noise only)."""
        cfg = self.config
        chain = replay["chain"].to(self.device).float()
        b = chain.shape[0]
        expert_value = self.value_head is not None and cfg.value_source == "expert"
        values = []
        if cfg.one_sde_step:
            k = replay["denoise_index"].to(self.device).long()
            rows = torch.arange(b, device=chain.device)
            x, x_next = chain[rows, k], chain[rows, k + 1]
            mean, std, out = self._transition(inputs, prefix, x, k, k >= 0)
            logp = gaussian_logprob(x_next, mean, std)
            entropy = gaussian_entropy(std)
            if expert_value:
                values.append(self._expert_value(out))
        else:
            x0 = chain[:, 0]
            terms = [gaussian_logprob(x0, torch.zeros_like(x0), torch.ones_like(x0))]
            ents = []
            for step in range(cfg.num_steps):
                if steps is not None:
                    mean, std, out = steps[step]
                else:
                    ks = torch.full((b,), step, dtype=torch.long, device=chain.device)
                    mean, std, out = self._transition(inputs, prefix, chain[:, step], ks, ks >= 0)
                terms.append(gaussian_logprob(chain[:, step + 1], mean, std))
                ents.append(gaussian_entropy(std))
                if expert_value:
                    values.append(self._expert_value(out))
            logp = torch.stack(terms, 0).mean(0)
            entropy = torch.stack(ents, 0).mean(0)
        if self.value_head is None:
            value = None
        elif cfg.value_source == "prefix":
            value = self._prefix_value(prefix)
        else:
            value = torch.stack(values, 0).mean(0)
        return EvalOutput(
            logprob=self.reduce(self._crop(logp)),
            entropy=self.reduce(self._crop(entropy)),
            value=value,
        )

    def evaluate(self, obs: Observation, replay: dict[str, Tensor]) -> EvalOutput:
        inputs = self.processor(obs, self.device)
        return self._score(inputs, self._prefix_pass(inputs), replay)

    def loss(
        self,
        obs: Observation,
        actions: Tensor,
        noise: Tensor | None = None,
        time: Tensor | None = None,
    ) -> Tensor:
        """Flow-matching loss ``mean ||v_θ(x_t, t) - (noise - a)||²`` over the given ``K``
        actions (all model dims, as openpi); ``x_t = t noise + (1 - t) a``, ``t ~ Beta``."""
        cfg = self.config
        inputs = self.processor(obs, self.device)
        device = self.device
        a = self.processor.normalize_actions(actions.cpu()).to(device)
        k = a.shape[1]
        if k > cfg.action_horizon:
            raise ValueError(
                f"actions have {k} steps, more than action_horizon={cfg.action_horizon}"
            )
        a = F.pad(a, (0, 0, 0, cfg.action_horizon - k))
        b = a.shape[0]
        noise = torch.randn_like(a) if noise is None else noise.to(device)
        t = sample_time(b, *cfg.time_beta, device=device) if time is None else time.to(device)
        tt = t[:, None, None]
        x_t = tt * noise + (1 - tt) * a
        u = noise - a
        v = self.action_out_proj(self._joint_pass(inputs, x_t, t)).float()
        return F.mse_loss(v[:, :k], u[:, :k])


@register_policy("pi05", pi05=True)
@register_policy("pi0", pi05=False)
class Pi0Policy(FlowMatchingPolicy):
    """π0 (``pi05=False``) and π0.5 (``pi05=True``) as RL policies (see the module docstring)."""

    config_cls = Pi0Config
    config: Pi0Config
    _rl_heads = ("value_head", "noise_head")

    def __init__(
        self,
        config: Pi0Config,
        tokenizer: Any = None,
        checkpoint_dir: str | Path | None = None,
    ) -> None:
        super().__init__(config)
        ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
        cfg = config
        with torch.device(cfg.device), seeded(cfg.seed):
            self.paligemma_with_expert = PaliGemmaWithExpert(cfg)
            width = int(cfg.expert_config["hidden_size"])
            self.action_in_proj = nn.Linear(cfg.max_action_dim, width)
            self.action_out_proj = nn.Linear(width, cfg.max_action_dim)
            if cfg.pi05:
                self.time_mlp_in = nn.Linear(width, width)
                self.time_mlp_out = nn.Linear(width, width)
            else:
                self.state_proj = nn.Linear(cfg.max_state_dim, width)
                self.action_time_mlp_in = nn.Linear(2 * width, width)
                self.action_time_mlp_out = nn.Linear(width, width)
            self._make_rl_heads(width, int(cfg.text_config["hidden_size"]))
        if tokenizer is None:
            tokenizer = Pi0Processor.make_tokenizer(cfg, ckpt)
        self.processor = Pi0Processor(cfg, tokenizer)
        if ckpt is not None:
            self._load_weights(ckpt)
        self._finish_init()
        if cfg.gradient_checkpointing:
            self.enable_gradient_checkpointing()

    def lora_root(self) -> nn.Module:
        return self.paligemma_with_expert

    def lora_target_modules(self) -> str:
        return LORA_TARGETS

    def enable_gradient_checkpointing(self) -> None:
        self.paligemma_with_expert.gradient_checkpointing = True

    # -- embeddings --------------------------------------------------------------------------
    def _prefix(self, inputs: Pi0Inputs) -> tuple[Tensor, Tensor]:
        """Prefix embeddings ``[B, Np, D]`` (images then language) and pad mask ``[B, Np]``."""
        pwe = self.paligemma_with_expert
        device = self.device
        embs, pads = [], []
        for slot in range(inputs.images.shape[1]):
            img = pwe.embed_image(inputs.images[:, slot].to(device))
            embs.append(img)
            pads.append(inputs.image_masks[:, slot, None].to(device).expand(-1, img.shape[1]))
        lang = pwe.embed_language(inputs.tokens.to(device))
        embs.append(lang.to(embs[0].dtype))
        pads.append(inputs.token_mask.to(device))
        return torch.cat(embs, dim=1), torch.cat(pads, dim=1)

    def _suffix(
        self, inputs: Pi0Inputs, x: Tensor, t: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Suffix embeddings, its autoregressive-block flags and π0.5's adaRMS condition."""
        cfg = self.config
        width = int(cfg.expert_config["hidden_size"])
        dtype = self.action_in_proj.weight.dtype
        time_emb = posemb_sincos(t, width, cfg.min_period, cfg.max_period).to(dtype)
        actions = self.action_in_proj(x.to(dtype))
        b, h = x.shape[:2]
        if cfg.pi05:
            cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(time_emb))))
            ar = torch.zeros(b, h, dtype=torch.long, device=x.device)
            ar[:, 0] = 1
            return actions, ar, cond
        state = self.state_proj(inputs.state.to(x.device, dtype))[:, None]
        at = torch.cat([actions, time_emb[:, None].expand(-1, h, -1)], dim=-1)
        at = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(at)))
        ar = torch.zeros(b, h + 1, dtype=torch.long, device=x.device)
        ar[:, :2] = 1
        return torch.cat([state, at], dim=1), ar, None

    # -- model passes ------------------------------------------------------------------------
    def _prefix_pass(self, inputs: Pi0Inputs) -> dict[str, Any]:
        embs, pad = self._prefix(inputs)
        ar = torch.zeros_like(pad, dtype=torch.long)
        mask = make_att_2d_masks(pad, ar)
        positions = pad.long().cumsum(1) - 1
        (out, _), cache = self.paligemma_with_expert([embs, None], mask, positions)
        return {"pad": pad, "cache": cache, "out": out}

    def _suffix_pass(
        self, inputs: Pi0Inputs, prefix: dict[str, Any], x: Tensor, t: Tensor
    ) -> Tensor:
        """The expert's outputs at the ``H`` action tokens ``[B, H, D_expert]`` for states
        ``x [B, H, D]`` at times ``t [B]``, attending to the cached prefix."""
        embs, ar, cond = self._suffix(inputs, x, t)
        pad_p = prefix["pad"]
        pad_s = torch.ones(embs.shape[:2], dtype=torch.bool, device=embs.device)
        full_pad = torch.cat([pad_p, pad_s], dim=1)
        full_ar = torch.cat([torch.zeros_like(pad_p, dtype=torch.long), ar], dim=1)
        mask = make_att_2d_masks(full_pad, full_ar)[:, pad_p.shape[1] :]
        positions = pad_p.long().sum(1, keepdim=True) + pad_s.long().cumsum(1) - 1
        (_, out), _ = self.paligemma_with_expert(
            [None, embs], mask, positions, past=prefix["cache"], cond=cond
        )
        return out[:, -x.shape[1] :]

    def _joint_pass(self, inputs: Pi0Inputs, x: Tensor, t: Tensor) -> Tensor:
        """The expert's outputs at the ``H`` action tokens for ``x`` at ``t``, prefix and suffix
        in one pass (training)."""
        prefix_embs, prefix_pad = self._prefix(inputs)
        suffix_embs, suffix_ar, cond = self._suffix(inputs, x, t)
        suffix_pad = torch.ones(suffix_embs.shape[:2], dtype=torch.bool, device=x.device)
        pad = torch.cat([prefix_pad, suffix_pad], dim=1)
        ar = torch.cat([torch.zeros_like(prefix_pad, dtype=torch.long), suffix_ar], dim=1)
        mask = make_att_2d_masks(pad, ar)
        positions = pad.long().cumsum(1) - 1
        (_, out), _ = self.paligemma_with_expert(
            [prefix_embs, suffix_embs], mask, positions, cond=cond
        )
        return out[:, -x.shape[1] :]

    @classmethod
    def statistics_config(
        cls,
        name: str,
        action: Mapping[str, Any],
        state: Mapping[str, Any] | None,
        counts: Mapping[str, int],
    ) -> dict[str, Any]:
        """openpi's ``norm_stats.json`` layout: ``{"actions": ..., "state": ...}`` with
        ``mean``, ``std``, ``q01``, ``q99`` (π0 normalises by mean/std, π0.5 by quantiles); the
        dataset's name is the asset id they are exported under (openpi's are dataset ids)."""
        keys = ("mean", "std", "q01", "q99")
        stats = {"actions": {k: list(action[k]) for k in keys}}
        if state is not None:
            stats["state"] = {k: list(state[k]) for k in keys}
        return {"norm_stats": stats, "asset_id": name}

    # -- checkpoints -------------------------------------------------------------------------
    def official_state_dict(self) -> dict[str, Tensor]:
        """openpi's ``PI0Pytorch`` state dict as its ``safetensors.torch.save_model`` writes it:
        ``vision_tower.vision_model.`` names (transformers 4.53), the tied token embedding under
        ``paligemma.lm_head.weight`` and the unused expert ``lm_head`` (zeros, see
        :data:`_EXPERT_HEAD`); the RL heads are not part of it."""
        out: dict[str, Tensor] = {}
        merged = self.merged_state_dict(self.paligemma_with_expert)
        for k, v in merged.items():
            k = k.replace(
                "paligemma.model.vision_tower.", "paligemma.model.vision_tower.vision_model."
            )
            out[_OPENPI_PREFIX + k] = v
        out[_TIED_HEAD] = out.pop(_EMBED)
        vocab, dtype = out[_TIED_HEAD].shape[0], out[_TIED_HEAD].dtype
        width = int(self.config.expert_config["hidden_size"])
        out[_EXPERT_HEAD] = torch.zeros(vocab, width, dtype=dtype)
        for name, module in self.named_children():
            if name in ("paligemma_with_expert", *self._rl_heads):
                continue
            for k, v in module.state_dict().items():
                out[f"{name}.{k}"] = v
        return out

    def save_pretrained(self, path: str | Path) -> None:
        """An openpi PyTorch checkpoint folder, which openpi's ``create_trained_policy`` serves
        and this package loads back:

        - ``model.safetensors``: one file (openpi reads no shards) holding exactly the keys of
          :meth:`official_state_dict`;
        - ``config.json``: the fields openpi's converter writes, plus an ``rlinf_vla`` section;
        - ``assets/<asset_id>/norm_stats.json``: the statistics in openpi's layout, under the
          config's ``asset_id`` (a loaded openpi checkpoint's own, or the dataset's name after
          ``rlinf-vla sft``), else :data:`DEFAULT_ASSET_ID`; openpi's serving reads the asset id
          of its training config, so set ``asset_id`` to that one;
        - the tokenizer files, ``rl_heads.safetensors`` (value head, noise net) and with LoRA
          ``lora_adapter/``; openpi ignores these.
        """
        cfg = self.config
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_safetensors_dir(self.official_state_dict(), path, max_shard_bytes=2**62)
        data = {
            "action_dim": cfg.max_action_dim,
            "action_horizon": cfg.action_horizon,
            "paligemma_variant": cfg.paligemma_variant,
            "action_expert_variant": cfg.action_expert_variant,
            "precision": "bfloat16" if cfg.torch_dtype == torch.bfloat16 else "float32",
            "pi05": cfg.pi05,
            "rlinf_vla": {k: v for k, v in cfg.to_dict().items() if k not in _NOT_SAVED},
        }
        (path / "config.json").write_text(json.dumps(data, indent=2))
        if cfg.norm_stats is not None:
            asset_id = cfg.asset_id
            if asset_id is None:
                asset_id = DEFAULT_ASSET_ID
                log.warning(
                    "%s: normalisation statistics written to assets/%s/norm_stats.json; openpi "
                    "serving reads assets/<its training config's asset_id>/: set asset_id to it",
                    path,
                    asset_id,
                )
            write_openpi_norm_stats(path, asset_id, cfg.norm_stats)
        self.processor.tokenizer.save_pretrained(str(path))
        save_rl_heads(self, path, self._rl_heads)
        if self.has_lora:
            self.save_lora_adapter(path / "lora_adapter")

    @classmethod
    def config_from_dir(cls, path: Path, **overrides: Any) -> Pi0Config:
        """Config from openpi's ``config.json`` (``action_dim``, ``action_horizon``, variants),
        lerobot's (``type``, ``chunk_size``, ``max_action_dim``, ...) or ours, with the
        normalisation statistics the folder keeps (:func:`find_norm_stats`; ``norm_stats=``
        skips the search).

        ``discrete_state_input``: the checkpoint's record (ours: the ``rlinf_vla`` section;
        lerobot π0.5 always writes the state into the prompt), else openpi's default (π0.5:
        on), which is logged because openpi's converted checkpoints record nothing.

        Raises:
            FileNotFoundError: the folder keeps no statistics and ``norm_stats`` is unset.
            ValueError: several openpi asset ids and ``asset_id`` is unset.
        """
        kwargs: dict[str, Any] = {}
        file = path / "config.json"
        data = json.loads(file.read_text()) if file.exists() else {}
        ours = "rlinf_vla" in data
        if "type" in data:  # lerobot PI0Config / PI05Config
            kwargs["pi05"] = data["type"] == "pi05"
            for ours_key, theirs in (
                ("action_horizon", "chunk_size"),
                ("max_action_dim", "max_action_dim"),
                ("max_state_dim", "max_state_dim"),
                ("num_steps", "num_inference_steps"),
                ("max_token_len", "tokenizer_max_length"),
                ("paligemma_variant", "paligemma_variant"),
                ("action_expert_variant", "action_expert_variant"),
            ):
                if data.get(theirs) is not None:
                    kwargs[ours_key] = data[theirs]
            if kwargs["pi05"]:
                if data.get("use_proprioceptive_memory"):
                    raise NotImplementedError(
                        f"{path}: lerobot's use_proprioceptive_memory (state through a linear "
                        "projection) is not ported"
                    )
                # lerobot's Pi05PrepareStateTokenizerProcessorStep puts the state in the prompt
                kwargs["discrete_state_input"] = True
        else:
            for ours_key, theirs in (
                ("max_action_dim", "action_dim"),
                ("action_horizon", "action_horizon"),
                ("paligemma_variant", "paligemma_variant"),
                ("action_expert_variant", "action_expert_variant"),
                ("pi05", "pi05"),
                ("discrete_state_input", "discrete_state_input"),
            ):
                if data.get(theirs) is not None:
                    kwargs[ours_key] = data[theirs]
        kwargs.update(data.get("rlinf_vla") or {})
        kwargs = {k: v for k, v in kwargs.items() if k not in _NOT_SAVED}
        if not ours:
            # an openpi or lerobot folder holds the published model: the sizes its config does
            # not record (the vision tower, the value head) are the full preset's, not tiny's
            kwargs["preset"] = "full"
        if "pi05" in overrides and "pi05" in kwargs and overrides["pi05"] != kwargs["pi05"]:
            have = "pi05" if kwargs["pi05"] else "pi0"
            raise CheckpointMismatchError(f"{path} holds a {have} checkpoint; use policy={have}")
        if overrides.get("norm_stats") is None:
            found = find_norm_stats(path, overrides.get("asset_id"))
            if found is not None:
                kwargs["norm_stats"] = found.stats
                if found.normalization is not None:
                    kwargs["normalization"] = found.normalization
                if found.asset_id is not None:
                    kwargs["asset_id"] = found.asset_id  # an export writes them there again
            elif not ours:
                # this package's save_pretrained writes the statistics whenever the policy had
                # them, so only its own checkpoints may lack them
                places = "\n  ".join(NORM_STATS_LOCATIONS)
                raise FileNotFoundError(
                    f"{path} holds no normalisation statistics; looked for\n  {places}\n"
                    "set norm_stats=<a norm_stats.json file, or a folder holding one> (openpi "
                    "layout {'norm_stats': {'state': {...}, 'actions': {...}}}) to the "
                    "statistics the checkpoint was trained with"
                )
        pi05 = bool(overrides.get("pi05", kwargs.get("pi05", False)))
        if pi05 and "discrete_state_input" not in {**kwargs, **overrides}:
            log.warning(
                "%s does not record discrete_state_input: using openpi's default for pi05 "
                "(True, the state in the prompt); openpi's pi05_libero was trained with False, "
                "set discrete_state_input=false for it",
                path,
            )
        known = set(cls.config_cls.__dataclass_fields__)
        kwargs = {k: v for k, v in kwargs.items() if k in known}
        kwargs.update(overrides)
        kwargs["checkpoint"] = str(path)
        return cls.config_cls.from_kwargs(cls.__name__, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str | Path, **overrides: Any) -> Pi0Policy:
        """Load a checkpoint folder, a run's checkpoint, or a Hugging Face model id from the
        local cache (:func:`~rlinf_vla.policies.base.find_checkpoint`)."""
        path = find_checkpoint(path)
        if not any(path.glob("model*.safetensors")):
            raise FileNotFoundError(f"{path} has no model.safetensors (not a π0 checkpoint)")
        return cls(cls.config_from_dir(path, **overrides), checkpoint_dir=path)

    def _load_weights(self, path: Path) -> None:
        raw = load_safetensors_dir(path)
        # lerobot < 0.4 keeps its normalisation buffers in the same file (read by config_from_dir)
        raw = {k: v for k, v in raw.items() if not k.startswith(LEROBOT_BUFFER_PREFIXES)}
        if raw and all(k.startswith("model.") for k in raw):  # lerobot
            raw = {k[len("model.") :]: v for k, v in raw.items()}
        weights: dict[str, Tensor] = {}
        for k, v in raw.items():
            k = k.replace("vision_tower.vision_model.", "vision_tower.")
            if _IGNORED_KEYS.fullmatch(k):
                continue
            weights[k] = v
        self._fix_variant_keys(weights, path)
        expected = {
            k: v
            for k, v in self.state_dict().items()
            if not k.startswith(tuple(f"{h}." for h in self._rl_heads))
        }
        if _EMBED not in weights and _TIED_HEAD in weights:
            weights[_EMBED] = weights[_TIED_HEAD]
        weights.pop(_TIED_HEAD, None)
        expected.pop(_TIED_HEAD, None)
        check_state_dict(expected, weights, str(path))
        self.load_state_dict(weights, strict=False)
        load_rl_heads(self, path, self._rl_heads)

    def _fix_variant_keys(self, weights: dict[str, Tensor], path: Path) -> None:
        """lerobot's fixes: π0 files may name ``action_time_mlp_*`` as ``time_mlp_*`` (told
        apart by the input width); π0.5 files may carry unused plain expert norm weights."""
        cfg = self.config
        width = int(cfg.expert_config["hidden_size"])
        has_time = "time_mlp_in.weight" in weights
        if not cfg.pi05 and has_time and "action_time_mlp_in.weight" not in weights:
            if weights["time_mlp_in.weight"].shape[1] == 2 * width:
                for part in ("in", "out"):
                    for p in ("weight", "bias"):
                        weights[f"action_time_mlp_{part}.{p}"] = weights.pop(f"time_mlp_{part}.{p}")
            else:
                raise CheckpointMismatchError(f"{path} holds a pi05 checkpoint; use policy=pi05")
        if cfg.pi05 and "action_time_mlp_in.weight" in weights:
            raise CheckpointMismatchError(f"{path} holds a pi0 checkpoint; use policy=pi0")
        if cfg.pi05:
            plain = re.compile(
                r"paligemma_with_expert\.gemma_expert\.model\.(layers\.\d+\.(input_layernorm|"
                r"post_attention_layernorm)|norm)\.weight"
            )
            for k in [k for k in weights if plain.fullmatch(k)]:
                del weights[k]


#: Config fields never written to or read from a checkpoint's ``rlinf_vla`` section.
_NOT_SAVED = (*RUN_FIELDS, "asset_id")
