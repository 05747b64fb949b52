from dataclasses import dataclass, field
from typing import Literal

import pytest

from rlinf_vla.config import ConfigError, from_section, to_dict


@dataclass
class Inner:
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class Outer:
    name: str
    mode: Literal["a", "b"] = "a"
    steps: int | None = None
    inner: Inner = field(default_factory=Inner)

    def __post_init__(self):
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


def test_builds_nested_dataclasses_with_defaults():
    cfg = from_section(Outer, {"name": "x", "inner": {"lr": 3}}, "algo")
    assert cfg == Outer(name="x", inner=Inner(lr=3.0))
    assert isinstance(cfg.inner.lr, float)
    assert to_dict(cfg) == {
        "name": "x",
        "mode": "a",
        "steps": None,
        "inner": {"lr": 3.0, "betas": [0.9, 0.999]},
    }


def test_accepts_omegaconf_sections():
    from omegaconf import OmegaConf

    section = OmegaConf.create({"name": "${oc.env:HOME,x}", "steps": 2})
    assert from_section(Outer, section).steps == 2


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"name": "x", "stpes": 1}, r"unknown config key\(s\): algo.stpes"),
        ({"name": "x", "inner": {"lrr": 1}}, r"unknown config key\(s\): algo.inner.lrr"),
        ({}, "missing required config key: algo.name"),
        ({"name": "x", "mode": "c"}, r"algo.mode: 'c' is not one of \['a', 'b'\]"),
        ({"name": "x", "steps": "many"}, "algo.steps: 'many' does not match"),
        ({"name": "x", "steps": True}, "algo.steps"),
        (
            {"name": "x", "inner": {"betas": [0.9, "y"]}},
            r"algo.inner.betas\[1\]: expected a number",
        ),
        ({"name": "x", "steps": 0}, "algo: steps must be >= 1, got 0"),
        ({"name": 3}, "algo.name: expected str"),
    ],
)
def test_errors_name_the_offending_key(section, message):
    with pytest.raises(ConfigError, match=message):
        from_section(Outer, section, "algo")
