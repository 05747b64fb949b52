import pytest

from rlinf_vla.config import ConfigError
from rlinf_vla.runtime.placement import PlacementConfig, parse_devices, resolve_placement


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("all", [0, 1, 2, 3, 4, 5, 6, 7]),
        ("0-3", [0, 1, 2, 3]),
        ("0,2,5-6", [0, 2, 5, 6]),
        (" 4 - 5 ", [4, 5]),
        ("3,1,1", [1, 3]),
        (3, [3]),
        ([6, 2], [2, 6]),
    ],
)
def test_parse_devices(spec, expected):
    assert parse_devices(spec, 8) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("0-9", r"device\(s\) \[8, 9\] are beyond the 8 available"),
        ("5-2", "reversed"),
        ("", "empty"),
        ([], "empty"),
        ("gpu0", "cannot parse"),
        (True, "not a device range"),
        (-1, r"\[-1\] are beyond"),
    ],
)
def test_parse_devices_errors_name_the_key(spec, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_devices(spec, 8, key="placement.components.env")
    assert str(info.value).startswith("placement.components.env")


def test_hybrid_placement_resolves():
    cfg = PlacementConfig(
        mode="hybrid", components={"actor": "all", "env": "0-3", "rollout": "4-7"}
    )
    placement = resolve_placement(cfg, 8)
    assert placement.of("env") == [0, 1, 2, 3]
    assert placement.of("rollout") == [4, 5, 6, 7]
    assert placement.of("actor") == list(range(8))
    with pytest.raises(KeyError, match="placed: actor, env, rollout"):
        placement.of("reward")


def test_hybrid_needs_disjoint_env_and_rollout():
    cfg = PlacementConfig(
        mode="hybrid", components={"actor": "all", "env": "0-4", "rollout": "4-7"}
    )
    with pytest.raises(
        ConfigError, match=r"placement.components.env and placement.components.rollout.*\[4\]"
    ):
        resolve_placement(cfg, 8)


def test_hybrid_needs_env_and_rollout():
    with pytest.raises(ConfigError, match=r"missing placement\.components\.rollout"):
        resolve_placement(PlacementConfig(mode="hybrid", components={"actor": "all", "env": 0}), 2)


def test_collocated_needs_the_same_devices():
    ok = resolve_placement(
        PlacementConfig(components={"actor": "all", "env": "0-1", "rollout": [1, 0]}), 2
    )
    assert ok.devices == {"actor": [0, 1], "env": [0, 1], "rollout": [0, 1]}
    with pytest.raises(ConfigError, match=r"placement.components.env=\[0\] differ"):
        resolve_placement(PlacementConfig(components={"actor": "all", "env": 0}), 2)


def test_disaggregated_needs_disjoint_devices():
    ok = resolve_placement(
        PlacementConfig(mode="disaggregated", components={"actor": "0-1", "env": 2, "rollout": 3}),
        4,
    )
    assert ok.of("actor") == [0, 1]
    with pytest.raises(ConfigError, match=r"actor and placement.components.rollout.*\[1\]"):
        resolve_placement(
            PlacementConfig(mode="disaggregated", components={"actor": "0-1", "rollout": 1}), 4
        )


def test_placement_beyond_devices_and_empty():
    with pytest.raises(ConfigError, match=r"placement.components.rollout: device\(s\) \[4, 5\]"):
        resolve_placement(
            PlacementConfig(mode="disaggregated", components={"env": "0-3", "rollout": "4-5"}), 4
        )
    with pytest.raises(ConfigError, match="no component is placed"):
        resolve_placement(PlacementConfig(), 4)
