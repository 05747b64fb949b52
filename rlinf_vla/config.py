"""Typed component configs: convert a config section into a validated dataclass.

Every component owns a dataclass with its defaults and checks (``__post_init__``). The CLI
composes YAML with Hydra, then each section crosses into its component through
:func:`from_section`, which rejects unknown keys by their full dotted name and checks value
types, so a typo can never become a silent default. Nothing here starts any process.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

#: Field metadata: ``field(metadata={NONFINITE_OK: True})`` lets a float key take ``inf`` /
#: ``nan`` (where its docstring gives them a meaning); every other float key refuses them.
NONFINITE_OK = "nonfinite_ok"
#: Field metadata: what the key expects, added to a type error (``"a mapping suite -> steps"``).
EXPECTS = "expects"


class ConfigError(ValueError):
    """An invalid configuration; the message names the offending keys."""


class RunAborted(RuntimeError):
    """A run stopped on purpose (e.g. too many non-finite updates); the message says why."""


class SectionErrors:
    """Builds independent config sections, keeping each one's :class:`ConfigError`, so that a
    config with several mistakes names all of them at once.

    Example::

        errors = SectionErrors()
        algo = errors.build(lambda: from_section(AlgoConfig, cfg["algo"], "algo"))
        runner = errors.build(lambda: from_section(RunnerConfig, cfg["runner"], "runner"))
        errors.raise_any()  # one ConfigError naming every bad section
    """

    def __init__(self) -> None:
        self.messages: list[str] = []

    def build(self, make: Callable[[], T]) -> T:
        """``make()``, or ``None`` (typed as its result) after recording its ``ConfigError``."""
        try:
            return make()
        except ConfigError as e:
            self.messages.append(str(e))
            return None  # type: ignore[return-value]  # raise_any() raises before any use

    def add(self, message: str) -> None:
        """Record a problem found outside :meth:`build` (e.g. a check across sections)."""
        self.messages.append(message)

    def raise_any(self) -> None:
        """Raise one :class:`ConfigError` holding every recorded message (none: return)."""
        if len(self.messages) == 1:
            raise ConfigError(self.messages[0])
        if self.messages:
            listed = "".join(f"\n  - {m}" for m in self.messages)
            raise ConfigError(f"{len(self.messages)} problems:{listed}")


def device_problem(value: str, key: str) -> str | None:
    """Why ``value`` (a torch device name set as ``key``) is not a device of this machine, or
    ``None`` when it is (``auto`` and ``cpu`` always are). A device the machine lacks is
    refused, never replaced by another."""
    if value in ("auto", "cpu"):
        return None
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        return f"{key}={value!r} is not a torch device (e.g. cpu, cuda, cuda:1)"
    if device.type != "cuda":
        return None
    count = torch.cuda.device_count()
    if count == 0:
        return f"{key}={value}: this machine has no CUDA GPU (torch sees none); use cpu or auto"
    if device.index is not None and device.index >= count:
        return f"{key}={value}: this machine has {count} GPU(s), cuda:0..cuda:{count - 1}"
    return None


def check_at_least(obj: Any, section: str, keys: tuple[str, ...], minimum: int) -> None:
    """Raise :class:`ConfigError` naming every one of ``keys`` (attributes of ``obj``) whose value
    is below ``minimum``; ``None`` values (unset optional settings) pass."""
    bad = [
        f"{section}.{key} must be >= {minimum}, got {getattr(obj, key)}"
        for key in keys
        if getattr(obj, key) is not None and getattr(obj, key) < minimum
    ]
    if bad:
        raise ConfigError("; ".join(bad))


def from_section(cls: type[T], section: Mapping[str, Any] | None, path: str = "") -> T:
    """Build the dataclass ``cls`` from a mapping (a dict or an OmegaConf ``DictConfig``).

    Args:
        cls: a dataclass type; nested dataclass fields are built recursively.
        section: the values; missing keys take the dataclass defaults.
        path: the dotted name of the section (``"cluster"``), used in error messages.

    Values must match the field annotations: a string is not a list (``image_keys=main`` is
    refused, not split into letters), and float keys refuse ``inf`` / ``nan`` unless the field
    allows them (:data:`NONFINITE_OK`).

    Raises:
        ConfigError: unknown keys, missing required keys, wrong value types, or a
            ``__post_init__`` check that failed (its message is prefixed with ``path``).
    """
    section = _to_plain(section) if section is not None else {}
    if not isinstance(section, dict):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping, got {section!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(section) - set(fields))
    if unknown:
        names = ", ".join(_join(path, k) for k in unknown)
        raise ConfigError(f"unknown config key(s): {names} (known: {', '.join(sorted(fields))})")
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, f in fields.items():
        key = _join(path, name)
        if name not in section:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing required config key: {key}")
            continue
        values[name] = _convert_field(f, hints[name], section[name], key)
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path or cls.__name__}: {e}") from None


def check_values(cls: type, values: Mapping[str, Any] | None, path: str) -> None:
    """Check the values of the fields of dataclass ``cls`` that ``values`` sets against their
    annotations, as :func:`from_section` does, without building ``cls`` (for configs that
    their component builds itself from keywords, e.g. a policy's or an env's). Keys ``cls``
    lacks are left to the component (which names them).

    Raises:
        ConfigError: naming every key whose value has the wrong type or is not finite.
    """
    values = _to_plain(values) if values is not None else {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping, got {values!r}")
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):  # an annotation that cannot be resolved: not checked
        return
    bad = []
    for f in dataclasses.fields(cls):
        if f.init and f.name in values and f.name in hints:
            try:
                _convert_field(f, hints[f.name], values[f.name], _join(path, f.name))
            except ConfigError as e:
                bad.append(str(e))
    if bad:
        raise ConfigError("; ".join(bad))


def to_dict(obj: Any) -> Any:
    """A dataclass config back to plain dicts/lists (for saving a resolved config)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    return obj


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _to_plain(value: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - hydra is a core dependency
        return value
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _convert_field(f: dataclasses.Field, tp: Any, value: Any, key: str) -> Any:
    """:func:`_convert` with the field's metadata: what it expects, whether inf / nan are ok."""
    try:
        return _convert(tp, value, key, f.metadata.get(NONFINITE_OK, False))
    except ConfigError as e:
        expects = f.metadata.get(EXPECTS)
        raise ConfigError(f"{e} ({key} is {expects})" if expects else str(e)) from None


def _convert(tp: Any, value: Any, key: str, nonfinite_ok: bool = False) -> Any:
    """Check ``value`` against the annotation ``tp``; build nested dataclasses."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if (
        isinstance(value, float)
        and not math.isfinite(value)
        and not nonfinite_ok
        and (tp is float or float in typing.get_args(tp))
    ):
        raise ConfigError(f"{key}: must be a finite number, got {value}")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, key, nonfinite_ok)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} does not match {_type_name(tp)}")
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_section(tp, value, key)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            # A string is refused, not split into characters: ``[main]``, not ``main``.
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_convert(item_tp, v, f"{key}[{i}]", nonfinite_ok) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        _, val_tp = typing.get_args(tp) or (Any, Any)
        return {k: _convert(val_tp, v, f"{key}.{k}", nonfinite_ok) for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
        return value
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def config_fields(config: Any) -> dict[str, Any]:
    """A dataclass config's fields as a dict (its nested values left as they are)."""
    import dataclasses

    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def named_section(section: Any, path: str) -> tuple[str, dict[str, Any]]:
    """A registry-named section (``env``, ``policy``, ...) as its ``name`` and the rest of its
    keys; ``path`` names the section in the error of a missing name."""
    from omegaconf import OmegaConf

    values = (
        OmegaConf.to_container(section, resolve=True)
        if not isinstance(section, dict)
        else dict(section)
    )
    if "name" not in values:
        raise ConfigError(f"{path}.name is missing")
    return values.pop("name"), values


def check_sections(cfg: Any, known: Any) -> None:
    """A command's config holds only the top-level keys (its sections) it reads (``known``).

    Raises:
        ConfigError: naming the unknown keys and the known ones.
    """
    unknown = sorted(set(cfg) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown config key(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
