"""Declarative placement: which devices each component's workers run on.

A placement names, per component, a range of global device indices (``"all"``, ``"0-3"``,
``"0,2,5-7"``, an int or a list of ints). The execution mode constrains how the ranges may
overlap:

- ``collocated``: every component on the same devices (they take turns, offloading).
- ``disaggregated``: every component on its own devices (no two share a device).
- ``hybrid``: ``env`` and ``rollout`` on disjoint devices (so they can run in a pipeline);
  other components (the actor) anywhere, typically on all devices.
- ``local``: every component on one device, in one process (threads instead of Ray workers,
  :mod:`rlinf_vla.runtime.local`).

:func:`resolve_placement` checks a :class:`PlacementConfig` against the device count and
returns a :class:`Placement`. It is pure: nothing is launched.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

from rlinf_vla.config import ConfigError

DeviceSpec = str | int | list[int]
MODES = ("collocated", "disaggregated", "hybrid", "local")


@dataclass
class PlacementConfig:
    """The ``placement`` section of a run config.

    Attributes:
        mode: how the components share devices (see the module docstring).
        components: component name -> device range, e.g. ``{"actor": "all", "env": "0-3",
            "rollout": "4-7"}``.
    """

    mode: Literal["collocated", "disaggregated", "hybrid", "local"] = "collocated"
    components: dict[str, str | int | list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """A validated placement: ``devices[component]`` is a sorted list of global device indices."""

    mode: str
    devices: dict[str, list[int]]
    num_devices: int

    def of(self, component: str) -> list[int]:
        """The devices of ``component``; a clear error for a component not in the placement."""
        if component not in self.devices:
            known = ", ".join(sorted(self.devices))
            raise KeyError(f"component {component!r} has no placement (placed: {known})")
        return self.devices[component]


def parse_devices(spec: DeviceSpec, num_devices: int, key: str = "devices") -> list[int]:
    """Parse a device range into a sorted list of distinct indices in ``[0, num_devices)``.

    Examples (with 8 devices): ``"all"`` -> 0..7, ``"0-3"`` -> [0, 1, 2, 3],
    ``"0,2,5-6"`` -> [0, 2, 5, 6], ``3`` -> [3], ``[1, 2]`` -> [1, 2].

    Raises:
        ConfigError: malformed text, a reversed range, an empty range, or indices beyond the
            available devices; the message names ``key``.
    """
    if isinstance(spec, bool):
        raise ConfigError(f"{key}: {spec!r} is not a device range")
    if isinstance(spec, int):
        indices = [spec]
    elif isinstance(spec, list | tuple):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in spec):
            raise ConfigError(f"{key}: {spec!r} must list integer device indices")
        indices = list(spec)
    elif isinstance(spec, str):
        indices = _parse_text(spec.strip(), num_devices, key)
    else:
        raise ConfigError(f"{key}: {spec!r} is not a device range")
    if not indices:
        raise ConfigError(f"{key}: the device range {spec!r} is empty")
    bad = sorted(i for i in indices if i < 0 or i >= num_devices)
    if bad:
        raise ConfigError(
            f"{key}: device(s) {bad} are beyond the {num_devices} available device(s) "
            f"(valid indices 0-{num_devices - 1})"
        )
    return sorted(set(indices))


def _parse_text(text: str, num_devices: int, key: str) -> list[int]:
    if text == "all":
        return list(range(num_devices))
    indices: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        try:
            start, end = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ConfigError(
                f"{key}: cannot parse {text!r}; use 'all', '0-3', '0,2,5-7' or an integer"
            ) from None
        if end < start:
            raise ConfigError(f"{key}: the range {part!r} is reversed")
        indices.extend(range(start, end + 1))
    return indices


def resolve_placement(cfg: PlacementConfig, num_devices: int) -> Placement:
    """Validate ``cfg`` for a cluster with ``num_devices`` devices.

    Raises:
        ConfigError: naming the offending ``placement.*`` keys.
    """
    if num_devices < 1:
        raise ConfigError("placement: the cluster has no devices")
    if cfg.mode not in MODES:
        raise ConfigError(f"placement.mode: {cfg.mode!r} is not one of {list(MODES)}")
    if not cfg.components:
        raise ConfigError("placement.components: no component is placed")
    devices = {
        name: parse_devices(spec, num_devices, f"placement.components.{name}")
        for name, spec in cfg.components.items()
    }
    if cfg.mode == "local":
        if len({tuple(d) for d in devices.values()}) != 1 or len(next(iter(devices.values()))) != 1:
            raise ConfigError(
                "placement: mode 'local' runs every component in one process on one device, but "
                + ", ".join(f"placement.components.{n}={d}" for n, d in devices.items())
                + " are not one and the same device"
            )
    elif cfg.mode == "collocated":
        first, *rest = devices
        differ = [n for n in rest if devices[n] != devices[first]]
        if differ:
            raise ConfigError(
                "placement: mode 'collocated' puts every component on the same devices, but "
                + ", ".join(f"placement.components.{n}={devices[n]}" for n in differ)
                + f" differ from placement.components.{first}={devices[first]}"
            )
    elif cfg.mode == "disaggregated":
        for a, b in itertools.combinations(devices, 2):
            _require_disjoint(devices, a, b, "disaggregated")
    elif cfg.mode == "hybrid":
        missing = [n for n in ("env", "rollout") if n not in devices]
        if missing:
            raise ConfigError(
                "placement: mode 'hybrid' pipelines env and rollout on disjoint devices; "
                f"missing placement.components.{missing[0]}"
            )
        _require_disjoint(devices, "env", "rollout", "hybrid")
    return Placement(mode=cfg.mode, devices=devices, num_devices=num_devices)


def _require_disjoint(devices: dict[str, list[int]], a: str, b: str, mode: str) -> None:
    shared = sorted(set(devices[a]) & set(devices[b]))
    if shared:
        raise ConfigError(
            f"placement: mode {mode!r} needs placement.components.{a} and "
            f"placement.components.{b} on disjoint devices, but both use {shared}"
        )
