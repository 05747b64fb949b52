"""Benchmarks run by ``rlinf-vla bench`` (and the scripts in ``benchmarks/``).

A benchmark is a module of this package that calls :func:`register_benchmark` with its typed
config, a ``run(cfg, cluster, progress)`` function returning a JSON-able dict, and a
``render(result)`` function returning a Markdown table.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlinf_vla.config import ConfigError, check_sections, from_section


@dataclass(frozen=True)
class Benchmark:
    name: str
    config_cls: type
    run: Callable[..., dict[str, Any]]
    render: Callable[[dict[str, Any]], str]


BENCHMARKS: dict[str, Benchmark] = {}


def register_benchmark(name: str, config_cls: type, run: Callable, render: Callable) -> None:
    BENCHMARKS[name] = Benchmark(name, config_cls, run, render)


def get_benchmark(name: str) -> Benchmark:
    """The benchmark ``name``; an unknown name fails listing the known ones."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    if name not in BENCHMARKS:
        raise ConfigError(
            f"benchmark.name: unknown benchmark {name!r} (known: {', '.join(sorted(BENCHMARKS))})"
        )
    return BENCHMARKS[name]


@dataclass
class BenchJob:
    """A validated ``rlinf-vla bench`` job."""

    cluster: Any
    benchmark: Any
    spec: Benchmark
    output_dir: str


def validate(cfg: Any) -> BenchJob:
    """Check the composed ``bench`` config; pure (starts nothing)."""
    from rlinf_vla.runtime.cluster import ClusterConfig

    check_sections(cfg, ("cluster", "benchmark", "output_dir"))
    section = dict(cfg["benchmark"])
    spec = get_benchmark(section.get("name", ""))
    return BenchJob(
        cluster=from_section(ClusterConfig, cfg["cluster"], "cluster"),
        benchmark=from_section(spec.config_cls, section, "benchmark"),
        spec=spec,
        output_dir=str(cfg["output_dir"]),
    )


def run(job: BenchJob) -> dict[str, Any]:
    """Start the cluster, run the benchmark, print its table and write ``<output_dir>/<name>.json``."""
    from rich.console import Console

    from rlinf_vla.runtime import Cluster

    console = Console()
    with Cluster(job.cluster) as cluster:
        console.print(f"[bold]benchmark {job.spec.name}[/bold] on {cluster}")
        result = job.spec.run(
            job.benchmark, cluster, progress=lambda msg: console.print(f"  {msg}")
        )
    out = Path(job.output_dir) / f"{job.spec.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print()
    print(job.spec.render(result))
    print(f"\nresults written to {out}")
    return result
