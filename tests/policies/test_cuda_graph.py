"""CUDA-graph replay of a step function, and π0's graphed denoising loop (GPU only)."""

from __future__ import annotations

import pytest
import torch

import rlinf_vla.policies.pi0.model as pi0_model
from rlinf_vla.policies.cuda_graph import GraphedStep
from tests.policies.conftest import make_obs
from tests.policies.test_pi0 import CAMERAS, build

pytestmark = pytest.mark.gpu


def test_replay_computes_the_function_on_new_inputs_and_returns_copies():
    x0 = torch.zeros(4, 3, device="cuda")
    k0 = torch.zeros(4, dtype=torch.long, device="cuda")
    w = torch.arange(3.0, device="cuda")  # read by the graph, not an argument
    step = GraphedStep(lambda x, k: (x * 2 + k[:, None] + w, x.sum(-1)), x0, k0)
    x1 = torch.randn(4, 3, device="cuda")
    k1 = torch.tensor([1, 2, 3, 4], device="cuda")
    a, s = step(x1, k1)
    assert torch.equal(a, x1 * 2 + k1[:, None] + w)
    assert torch.equal(s, x1.sum(-1))
    b, _ = step(a, k1)  # the next replay must not overwrite what the first returned
    assert torch.equal(a, x1 * 2 + k1[:, None] + w)
    assert torch.equal(b, a * 2 + k1[:, None] + w)


@pytest.mark.parametrize("name", ["pi0", "pi05"])
def test_pi0_act_replays_one_graph_and_matches_the_eager_chain(name, monkeypatch):
    captured = []

    class Spy(GraphedStep):
        def __init__(self, *args, **kw):
            captured.append(1)
            super().__init__(*args, **kw)

    monkeypatch.setattr(pi0_model, "GraphedStep", Spy)
    policy = build(name, device="cuda", dtype="float32")
    policy.eval()
    obs = make_obs(batch=3, cameras=CAMERAS, state_dim=8)
    torch.manual_seed(1)
    graphed = policy.act(obs)
    assert captured == [1]  # one capture for the whole chain of this call
    policy.config.cuda_graphs = False
    torch.manual_seed(1)
    eager = policy.act(obs)
    assert captured == [1]
    # The same noise through the same kernels: the chains agree to float32 rounding.
    torch.testing.assert_close(graphed.replay["chain"], eager.replay["chain"], rtol=1e-5, atol=1e-5)
    assert torch.equal(graphed.replay["denoise_index"], eager.replay["denoise_index"])
    # The log-prob is scored eagerly, as evaluate scores it: the first PPO ratio is exactly 1.
    ev = policy.evaluate(obs, graphed.replay)
    assert torch.equal(ev.logprob, graphed.logprob)
