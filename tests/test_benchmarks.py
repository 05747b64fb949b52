"""Every script in benchmarks/ imports and answers ``--help``: a study that fails at import (a
helper moved to another module) is found here, not hours into a run on another machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# Runs each script as ``python benchmarks/<name>.py --help`` would (its folder on the path, run
# as ``__main__``), all in one fresh interpreter: torch and the package are imported once.
_PROBE = r"""
import contextlib, io, json, runpy, sys, traceback
results = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    sys.path.insert(0, str(__import__("pathlib").Path(path).parent))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code or 0
    except BaseException:
        code = traceback.format_exc()
    finally:
        sys.path.pop(0)
    results[path] = {"code": code, "help": out.getvalue()}
print(json.dumps(results))
"""


def test_every_benchmark_script_imports_and_prints_its_usage() -> None:
    scripts = sorted(str(p) for p in BENCHMARKS.glob("*.py"))
    assert len(scripts) >= 10
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *scripts],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    results = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {Path(p).name: r["code"] for p, r in results.items() if r["code"] != 0}
    assert not failed, failed
    quiet = [Path(p).name for p, r in results.items() if "usage" not in r["help"].lower()]
    assert not quiet, f"no usage line from --help: {quiet}"
