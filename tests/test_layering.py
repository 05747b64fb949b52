"""The dependency rules of docs/architecture.md, read from the import statements of every
module (top-level and inside functions; ``TYPE_CHECKING`` imports count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rlinf_vla"

#: subpackage -> the rlinf_vla subpackages it must not import
FORBIDDEN = {
    "algos": {"envs", "policies", "training", "pipelines", "run", "reasoning", "eval", "runtime"},
    "policies": {"envs", "training", "pipelines", "run", "reasoning", "eval"},
    "envs": {"policies", "training", "pipelines", "run", "reasoning", "eval"},
    "training": {"envs", "pipelines", "run", "reasoning", "eval"},
    "run": {"envs", "policies", "training", "pipelines", "reasoning", "eval", "algos"},
    "runtime": {"algos", "envs", "policies", "training", "pipelines", "run", "reasoning"},
    "reasoning": {"pipelines", "envs", "eval"},
}


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every ``import`` / ``from ... import`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
    return found


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "rlinf_vla" and len(parts) > 1 else None


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_subpackage_imports_only_what_the_layering_allows(package):
    broken = [
        f"{path.relative_to(PACKAGE.parent)} imports {module}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for module, _ in _imports(path)
        if _subpackage(module) in FORBIDDEN[package]
    ]
    assert not broken, "\n".join(broken)


def test_no_module_imports_another_modules_private_helper():
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for module, names in _imports(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if module.startswith("rlinf_vla") and module != own and private:
                broken.append(f"{own} imports {private} from {module}")
    assert not broken, "\n".join(broken)
