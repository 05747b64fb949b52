from dataclasses import dataclass, field
from typing import Literal

import pytest

from rlinf_vla.config import EXPECTS, NONFINITE_OK, ConfigError, check_values, from_section, to_dict


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


@dataclass
class Typed:
    names: tuple[str, ...] = ("main",)
    ids: list[int] | None = None
    scale: float = 1.0
    limit: float | None = None
    weights: dict[str, float] = field(default_factory=dict)
    horizon: float = field(default=1.0, metadata={NONFINITE_OK: True})
    steps: dict[str, int] = field(default_factory=dict, metadata={EXPECTS: "a mapping a -> n"})


@pytest.mark.parametrize(
    ("section", "message"),
    [
        # a string is not split into letters: the key is named
        ({"names": "main"}, "pol.names: expected a list, got 'main'"),
        ({"ids": "12"}, "pol.ids: '12' does not match"),
        # inf / nan in any float key, also inside lists, mappings and optional floats
        ({"scale": float("inf")}, "pol.scale: must be a finite number, got inf"),
        ({"scale": float("nan")}, "pol.scale: must be a finite number, got nan"),
        ({"limit": float("-inf")}, "pol.limit: must be a finite number, got -inf"),
        ({"weights": {"a": float("nan")}}, "pol.weights.a: must be a finite number"),
        # what a key expects, from its field metadata
        ({"steps": 60}, r"pol.steps: expected a mapping, got 60 \(pol.steps is a mapping a -> n\)"),
    ],
)
def test_wrong_shapes_and_non_finite_numbers_are_refused_naming_the_key(section, message):
    with pytest.raises(ConfigError, match=message):
        from_section(Typed, section, "pol")
    with pytest.raises(ConfigError, match=message):  # the same check without building
        check_values(Typed, section, "pol")


def test_a_key_that_allows_inf_takes_it_and_lists_of_strings_stay_lists():
    cfg = from_section(Typed, {"horizon": float("inf"), "names": ["main", "wrist"]}, "pol")
    assert cfg.horizon == float("inf")
    assert cfg.names == ("main", "wrist")
    check_values(Typed, {"horizon": float("inf"), "names": ["main"], "other": 1}, "pol")


def test_check_values_names_every_bad_key_at_once():
    with pytest.raises(ConfigError) as e:
        check_values(Typed, {"names": "main", "scale": float("inf"), "ids": [1]}, "policy")
    assert str(e.value) == (
        "policy.names: expected a list, got 'main'; policy.scale: must be a finite number, got inf"
    )
