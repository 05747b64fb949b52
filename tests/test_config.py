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


def test_check_at_least_names_every_offending_key_and_skips_unset_ones():
    from types import SimpleNamespace

    from rlinf_vla.config import check_at_least

    obj = SimpleNamespace(a=0, b=5, c=-2, d=None)
    with pytest.raises(ConfigError) as e:
        check_at_least(obj, "runner", ("a", "b", "c", "d"), 1)
    assert str(e.value) == "runner.a must be >= 1, got 0; runner.c must be >= 1, got -2"
    check_at_least(obj, "runner", ("b", "d"), 1)  # 5 and None pass
    check_at_least(obj, "runner", ("a",), 0)


def test_section_errors_collect_every_sections_error_and_raise_them_together():
    from rlinf_vla.config import SectionErrors

    errors = SectionErrors()
    good = errors.build(lambda: from_section(Outer, {"name": "x"}, "algo"))
    assert good == Outer(name="x")
    errors.raise_any()  # nothing recorded yet
    assert errors.build(lambda: from_section(Outer, {"name": "x", "steps": 0}, "algo")) is None
    errors.build(lambda: from_section(Inner, {"lr": "fast"}, "optim"))
    with pytest.raises(ConfigError) as e:
        errors.raise_any()
    assert str(e.value) == (
        "2 problems:\n"
        "  - algo: steps must be >= 1, got 0\n"
        "  - optim.lr: expected a number, got 'fast'"
    )
    one = SectionErrors()
    one.build(lambda: from_section(Inner, {"lr": "fast"}, "optim"))
    with pytest.raises(ConfigError) as e:
        one.raise_any()
    assert str(e.value) == "optim.lr: expected a number, got 'fast'"
