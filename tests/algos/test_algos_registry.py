"""The registries: lookup errors, and a contract test that calls every registered entry."""

from __future__ import annotations

import ast
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import rlinf_vla.algos as algos
from rlinf_vla.algos import (
    ADVANTAGES,
    AGGREGATIONS,
    ALGORITHMS,
    KL_ESTIMATORS,
    LOSSES,
    Registry,
    UnknownNameError,
    compute_advantages,
    compute_loss,
)

ALGOS_DIR = Path(algos.__file__).parent


def test_unknown_name_lists_known_names_sorted():
    with pytest.raises(UnknownNameError) as info:
        ADVANTAGES["gea"]
    message = str(info.value)
    assert message == (
        "unknown advantage estimator 'gea' (did you mean 'gae'?); "
        "known: gae, grpo, reinforce_pp, rloo"
    )
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match="known: entropy, kl, ppo, value"):
        compute_loss("a2c")


def test_register_add_and_duplicates():
    reg: Registry = Registry("thing")

    @reg.register("b")
    def b() -> int:
        return 2

    reg.add("a", 1)
    assert reg["b"] is b and reg["a"] == 1
    assert reg.names() == ["a", "b"] and list(reg) == ["a", "b"] and len(reg) == 2
    assert "a" in reg and "c" not in reg
    with pytest.raises(ValueError, match="already registered"):
        reg.add("a", 3)
    with pytest.raises(KeyError, match="known: none"):
        Registry("empty")["x"]


# ------------------------------------------------------------------------------------------
# Every registered entry, called with small tensors. A new entry needs an example here.
# ------------------------------------------------------------------------------------------

Tb, Bb, G = 4, 6, 3


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


ADVANTAGE_EXAMPLES: dict[str, Callable[[], dict]] = {
    "gae": lambda: {
        "rewards": _rand(Tb, Bb),
        "values": _rand(Tb + 1, Bb),
        "terminated": _rand(Tb, Bb) > 1.0,
        "truncated": _rand(Tb, Bb) > 1.0,
        "final_values": _rand(Tb, Bb),
        "gamma": 0.99,
        "lam": 0.95,
    },
    "grpo": lambda: {"scores": _rand(Bb), "group_size": G},
    "rloo": lambda: {"scores": _rand(Bb), "group_size": G},
    "reinforce_pp": lambda: {"rewards": _rand(Tb, Bb), "mask": _rand(Tb, Bb) > -1.0},
}

N, L = 3, 5
LOSS_EXAMPLES: dict[str, Callable[[], dict]] = {
    "ppo": lambda: {
        "logprob": _rand(N, L).requires_grad_(),
        "old_logprob": _rand(N, L) * 0.1,
        "advantages": _rand(N, L),
        "mask": _rand(N, L) > -1.0,
        "clip_high": 0.28,
        "dual_clip": 3.0,
    },
    "value": lambda: {
        "values": _rand(N, L).requires_grad_(),
        "old_values": _rand(N, L),
        "returns": _rand(N, L),
        "mask": _rand(N, L) > -1.0,
        "clip": 0.2,
        "huber_delta": 1.0,
    },
    "entropy": lambda: {"entropy": _rand(N, L).abs().requires_grad_(), "mask": torch.ones(N, L)},
    "kl": lambda: {
        "logprob": _rand(N, L).requires_grad_(),
        "ref_logprob": _rand(N, L),
        "mask": torch.ones(N, L, dtype=torch.bool),
    },
}


def test_every_entry_has_an_example():
    assert set(ADVANTAGE_EXAMPLES) == set(ADVANTAGES.names())
    assert set(LOSS_EXAMPLES) == set(LOSSES.names())


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_advantage_contract(name):
    kwargs = ADVANTAGE_EXAMPLES[name]()
    before = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    adv, ret = compute_advantages(name, **kwargs)
    shape = (kwargs.get("rewards", kwargs.get("scores"))).shape
    assert adv.shape == shape and ret.shape == shape
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert not adv.requires_grad and not ret.requires_grad
    for k, v in before.items():  # pure: inputs untouched
        torch.testing.assert_close(kwargs[k], v)


@pytest.mark.parametrize("name", LOSSES.names())
@pytest.mark.parametrize("agg", AGGREGATIONS.names())
def test_loss_contract(name, agg):
    kwargs = LOSS_EXAMPLES[name]()
    grad_input = next(v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.requires_grad)
    loss, metrics = compute_loss(name, **kwargs, agg=agg)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert grad_input.grad is not None and torch.isfinite(grad_input.grad).all()
    assert metrics
    for key, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0, key
        assert not value.requires_grad, key


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_kl_estimator_contract(name):
    log_ratio = _rand(N, L)
    assert KL_ESTIMATORS[name](log_ratio).shape == (N, L)


def test_presets_name_registered_pieces():
    for name in ALGORITHMS.names():
        preset = ALGORITHMS[name]
        if preset.imitation:  # dagger: no estimator and no policy-gradient loss
            assert preset.advantage is None
            continue
        assert preset.advantage in ADVANTAGES and preset.policy_loss in LOSSES


# ------------------------------------------------------------------------------------------
# Shapes documented, imports isolated
# ------------------------------------------------------------------------------------------

SHAPE = re.compile(r"\[[A-Za-z0-9_*+\-, .']+\]")


def _tensor_functions():
    modules = [algos.advantages, algos.losses, algos.granularity, algos.masked, algos.dapo]
    for module in modules:
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("_") or fn.__module__ != module.__name__:
                continue
            params = inspect.signature(fn).parameters.values()
            if any("Tensor" in str(p.annotation) for p in params):
                yield f"{module.__name__}.{name}", fn


@pytest.mark.parametrize(("qualname", "fn"), list(_tensor_functions()))
def test_every_tensor_function_documents_shapes(qualname, fn):
    assert fn.__doc__ and SHAPE.search(fn.__doc__), f"{qualname} does not state its shapes"


def test_algos_imports_only_torch_and_stdlib():
    # yaml: the algorithms' preset files (rlinf_vla/configs/algo/*.yaml)
    allowed = set(sys.stdlib_module_names) | {"torch", "yaml"}
    for path in ALGOS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                roots, names = [(node.module or "").split(".")[0]], [node.module or ""]
            else:
                continue
            for root, name in zip(roots, names, strict=True):
                inside = name == "rlinf_vla.algos" or name.startswith("rlinf_vla.algos.")
                assert root in allowed or inside, f"{path.name} imports {name}"
