"""A pretrained starting point for the tiny OpenVLA on the toy env, made in seconds.

A real OpenVLA starts RL from pretrained vision towers and a vision-language model; the tiny
preset starts from random weights, and from there neither PPO, GRPO nor cloning learns the
image-to-action mapping in a CI budget (docs/training.md, "Learning tests"). The stages below
stand in for that pretraining. None ever rewards an action that fits the scene, so after them
the policy still has to learn to act, which the learning tests then do with RL:

1. :func:`pretrain_vision`: the vision tower and projector learn to localise the scene
   (regressing the agent's and the target's positions from the projected patches);
2. :func:`pretrain_vlm`: with the vision tower frozen (as Prismatic trains its VLMs), the
   language model learns to *describe* the scene after the action prompt: where the target lies
   from the agent, one letter per axis (:func:`relation_chars`), teacher-forced over the whole
   vocabulary;
3. :func:`rest_action_head`: ``lm_head`` alone learns to favour the zero-motion action token
   whatever the scene, so the greedy policy holds still (success 0, a defined starting point
   instead of whatever a random read-out happens to do) while sampling still tries every
   action.

:func:`greedy_success` scores a policy on fixed held-out scenes; :func:`direction_probe`
measures how well the scene can still be read off the language model at the action positions,
to see whether RL kept what this pretraining taught.

Used by the OpenVLA learning tests (``tests/pipelines/test_learning.py``) and
``benchmarks/openvla_learning.py``; docs/training.md, "Learning tests", has the figures.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from rlinf_vla.envs import make_env
from rlinf_vla.pipelines.evaluation import greedy_eval

#: Where the target lies from the agent, per axis, as caption letters (x, then y).
LETTERS = ("lcr", "ucd")
#: Offsets within this distance count as "centre" (``c``) on an axis. Below ``0.1 / sqrt(2)``,
#: so an agent "centred" on both axes already touches the target (success radius 0.1): every
#: caption of a running episode names a direction to move in.
DEAD_ZONE = 0.07


def relation(agent: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Where the target lies from the agent, per axis: ``long [B, 2]`` in {0, 1, 2} (x: left,
    centre, right; y: up, centre, down; image y grows downwards)."""
    d = target - agent
    return (d > DEAD_ZONE).long() - (d < -DEAD_ZONE).long() + 1


def relation_chars(policy, agent: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Token ids ``[B, chunk, 2]`` of the caption: the x letter and the y letter of
    :func:`relation`, repeated once per action step of the chunk."""
    tok = policy.processor.tokenizer
    letters = torch.tensor([[tok(c).input_ids[-1] for c in axis] for axis in LETTERS])
    rel = relation(agent, target)
    pair = torch.stack([letters[0][rel[:, 0]], letters[1][rel[:, 1]]], dim=1)
    return pair[:, None, :].repeat(1, policy.config.chunk_size, 1)


def _fit(
    env_cfg: dict,
    agent_start: str,
    params,
    lr: float,
    steps: int,
    seed: int,
    batch: int,
    loss_fn: Callable,
) -> list[float]:
    """AdamW on ``params`` for ``steps`` steps, each on ``batch`` fresh scenes:
    ``loss_fn(env, obs, gen)`` gives the loss of the scenes just reset (it may step the env
    first). Every random draw comes from ``gen`` (seeded with ``seed``), so the result does not
    depend on what ran before in the process. Returns the loss per step."""
    env = make_env("toy", **{**env_cfg, "num_envs": batch, "agent_start": agent_start})
    opt = torch.optim.AdamW(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    try:
        for _ in range(steps):
            obs = env.reset(reset_ids=torch.randint(0, 2**30, (batch,), generator=gen))
            loss = loss_fn(env, obs, gen)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        env.close()
    return losses


def pretrain_vision(
    policy, env_cfg: dict, steps: int, lr: float = 1e-3, batch: int = 64, walk: int = 6
):
    """Train ``vision_backbone`` + ``projector`` (and a linear head, discarded) to regress
    (agent xy, target xy) from the projected patches of fresh scenes, concatenated in order, the
    agent anywhere (a random cell, then 0-``walk`` random steps). Returns the loss per step.

    The head reads every patch, as the language model does; a head on the *mean* patch (tried
    first) leaves the layout to be inferred from the patch contents and plateaus far higher
    (MSE 0.05 against 0.008 after 1500 steps: positions off by about 0.2, against 0.09)."""
    cfg = policy.config
    size = cfg.image_sizes[0]
    pixels = torch.zeros(1, 3 * len(cfg.image_sizes) * len(cfg.image_keys), size, size)
    with torch.no_grad():
        n_patches = policy.vla.patch_embeddings(pixels).shape[1]
    with torch.random.fork_rng():  # the same head whatever ran before in the process
        torch.manual_seed(12345)
        head = torch.nn.Linear(policy.vla.llm_dim * n_patches, 4)
    params = [
        *policy.vla.vision_backbone.parameters(),
        *policy.vla.projector.parameters(),
        *head.parameters(),
    ]

    def loss_fn(env, obs, gen):
        # A few random steps: the agent also between the grid cells objects start in.
        for _ in range(int(torch.randint(0, walk + 1, (1,), generator=gen))):
            step = torch.rand(batch, 1, env.action_dim, generator=gen) * 2 - 1
            obs = env.chunk_step(step).obs
        target = torch.cat([obs.state, env.target_pos], dim=1)
        feats = policy.vla.patch_embeddings(policy.processor.pixel_values(obs))
        return F.mse_loss(head(feats.flatten(1)), target)

    return _fit(env_cfg, "random", params, lr, steps, 12345, batch, loss_fn)


def pretrain_vlm(
    policy,
    env_cfg: dict,
    steps: int,
    lr: float = 1e-3,
    scenes: str = "walks",
    train: str = "lm",
    batch: int = 64,
    walk: int = 8,
):
    """Teach the language model to caption where the target lies (:func:`relation_chars`),
    after the action prompt, with the cross-entropy over the whole vocabulary. Returns the loss
    per step.

    Args:
        scenes: ``"center"``: the agent at the arena centre (where episodes start);
            ``"paths"``: the agent 0-8 scripted steps of the way to the target (the scenes a
            policy meets later in an episode); ``"walks"``: the same with half of the steps
            random, so that scenes off the straight path are described too (a policy that
            strays there otherwise reads them wrongly and can dither forever);
            ``"random"``: the agent anywhere.
        train: ``"lm"`` updates the language model only (the vision tower and projector stay
            as they are); ``"all"`` the whole model.
    """
    module = policy.vla.language_model if train == "lm" else policy

    def loss_fn(env, obs, gen):
        if scenes in ("paths", "walks"):
            # Part of the way to the target (an env that arrives starts a new scene).
            for _ in range(int(torch.randint(0, walk + 1, (1,), generator=gen))):
                step = env.oracle_actions(1)
                if scenes == "walks":
                    # Half the steps random: scenes off the straight path too.
                    noise = torch.rand(step.shape, generator=gen) * 2 - 1
                    coin = torch.rand(step.shape[0], 1, 1, generator=gen) < 0.5
                    step = torch.where(coin, noise, step)
                obs = env.chunk_step(step).obs
        ids = relation_chars(policy, obs.state, env.target_pos)
        hidden = policy.action_hidden_states(obs, ids)
        logits = policy.vla.language_model.lm_head(hidden).float()
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten().to(logits.device))

    start = "random" if scenes == "random" else "center"
    return _fit(env_cfg, start, module.parameters(), lr, steps, 12345, batch, loss_fn)


def rest_action_head(
    policy,
    env_cfg: dict,
    steps: int = 100,
    lr: float = 1e-2,
    smoothing: float = 0.7,
    batch: int = 64,
):
    """Start the action read-out at rest: ``lm_head`` alone learns, on fresh scenes, to put
    ``1 - smoothing + smoothing / n_bins`` of the action-token probability on the zero-motion
    token at every action position (cross-entropy over the action bins with label smoothing),
    the rest spread evenly. Greedy actions then hold still (success 0), sampled ones still
    explore every bin. Returns the loss per step."""
    cfg = policy.config
    zero = policy.processor.actions_to_tokens(torch.zeros(1, 1, cfg.action_dim))
    zero_index = int(policy.processor.action_tokenizer.to_index(zero).flatten()[0])

    def loss_fn(env, obs, gen):
        shape = (batch, cfg.chunk_size, cfg.action_dim)
        index = torch.randint(0, cfg.n_action_bins, shape, generator=gen)
        ids = policy.processor.action_tokenizer.from_index(index)
        with torch.no_grad():
            hidden = policy.action_hidden_states(obs, ids)
        logits = policy.action_logits(hidden)
        target = torch.full(logits.shape[:-1], zero_index)
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=smoothing)

    params = policy.vla.language_model.lm_head.parameters()
    return _fit(env_cfg, "center", params, lr, steps, 54321, batch, loss_fn)


def direction_probe(policy, env_cfg: dict, scenes: int = 512, steps: int = 300) -> list[float]:
    """Per action position, the held-out accuracy of a linear classifier of :func:`relation`
    (mean over x and y) on the hidden state that predicts that action token, with random action
    tokens fed before it. Chance is about 0.4. Trained on 3/4 of ``scenes`` fresh scenes (the
    agent at the centre), scored on the rest."""
    env = make_env("toy", **{**env_cfg, "num_envs": scenes, "agent_start": "center"})
    try:
        obs = env.reset(reset_ids=torch.arange(10**6, 10**6 + scenes))
        labels = relation(obs.state, env.target_pos)
    finally:
        env.close()
    cfg = policy.config
    gen = torch.Generator().manual_seed(0)
    index = torch.randint(
        0, cfg.n_action_bins, (scenes, cfg.chunk_size, cfg.action_dim), generator=gen
    )
    ids = policy.processor.action_tokenizer.from_index(index)
    with torch.no_grad():
        hidden = policy.action_hidden_states(obs, ids)
    fit, test = slice(0, scenes * 3 // 4), slice(scenes * 3 // 4, scenes)
    accuracy = []
    for pos in range(hidden.shape[1]):
        h = hidden[:, pos].float()
        with torch.random.fork_rng():
            torch.manual_seed(pos)
            head = torch.nn.Linear(h.shape[1], 6)
        opt = torch.optim.Adam(head.parameters(), lr=1e-2)
        for _ in range(steps):
            out = head(h[fit]).view(-1, 2, 3)
            loss = F.cross_entropy(out.flatten(0, 1), labels[fit].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            pred = head(h[test]).view(-1, 2, 3).argmax(-1)
        accuracy.append(round(float((pred == labels[test]).float().mean()), 3))
    return accuracy


def greedy_success(policy, env_cfg: dict, episodes: int = 64) -> float:
    """Greedy success rate of ``policy`` over ``episodes`` held-out scenes (the default
    evaluation reset ids, so every caller scores the same scenes), 32 envs at a time."""
    env = make_env("toy", **{**env_cfg, "num_envs": 32})
    try:
        return greedy_eval(policy, env, episodes).success_rate
    finally:
        env.close()
