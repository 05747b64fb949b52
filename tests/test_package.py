"""Packaging promises: cheap, lazy imports and the shipped config files."""

import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).parents[1]
SIMULATORS = ["mani_skill", "sapien", "libero", "robosuite", "mujoco", "gymnasium"]


def _python(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    ).stdout


def test_import_works_without_any_simulator():
    # Mapping a module to None makes importing it fail, as if it were not installed.
    out = _python(
        "import sys\n"
        f"sys.modules.update(dict.fromkeys({SIMULATORS!r}))\n"
        "import rlinf_vla, rlinf_vla.runtime, rlinf_vla.algos, rlinf_vla.cli, rlinf_vla.types\n"
        "import importlib, importlib.util\n"
        "for name in ['rlinf_vla.envs', 'rlinf_vla.policies']:\n"
        "    if importlib.util.find_spec(name): importlib.import_module(name)\n"
        "print('ok')\n"
    )
    assert out.strip() == "ok"


def test_top_level_import_is_cheap():
    out = _python(
        "import sys, rlinf_vla; print(sorted(m for m in ('torch', 'ray', 'hydra') if m in sys.modules))"
    )
    assert out.strip() == "[]"


def test_extras_and_entry_point():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {"maniskill", "libero", "math", "robot", "dev", "all"} <= set(
        meta["optional-dependencies"]
    )
    assert meta["scripts"]["rlinf-vla"] == "rlinf_vla.cli:main"


def test_config_files_are_package_data():
    configs = ROOT / "rlinf_vla" / "configs"
    shipped = sorted(p.relative_to(configs).as_posix() for p in configs.rglob("*.yaml"))
    assert "bench.yaml" in shipped
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["rlinf_vla"]
    assert all(any(Path("configs", f).match(p) for p in patterns) for f in shipped)
