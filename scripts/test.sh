#!/usr/bin/env bash
# scripts/test.sh: install everything (scripts/install.sh), lint, then run the test suite.
#
#   bash scripts/test.sh [PYTEST_ARGS...]    # default: -q
#   RLINF_SKIP_LINT=1 bash scripts/test.sh   # skip `ruff check` / `ruff format --check`
#   RLINF_TEST_VLLM=0 bash scripts/test.sh   # skip the vLLM stage (see below)
#   RLINF_TEST_OPENPI=0 bash scripts/test.sh # skip the openpi-client stage (see below)
#   RLINF_TEST_WORKERS=2 bash scripts/test.sh # the main suite in 2 pytest-xdist processes (see below)
#
# Without PYTEST_ARGS (the full run, as CI does) two more stages follow: the interop tests with
# PyPI's openpi-client (tests/interop/, run from the main env against `rlinf-vla serve`; the
# client lives in .venv-openpi, which scripts/install_openpi_client.sh makes, since it pins
# numpy < 2), then the tests of math-grpo's vLLM rollout backend (tests/reasoning/test_vllm.py)
# in .venv-vllm, the env scripts/install_vllm.sh makes (vLLM's CPU build pins its own torch and
# transformers).
#
# Order of a full run: lint (seconds), then the main test suite; the two extra envs install in the
# background meanwhile (about 1 and 7 minutes on a 2-core machine, half of it waiting on
# downloads; their output is printed when their stage starts), and their stages run after it.
# The main suite runs in one process (RLINF_TEST_WORKERS=0, the default). Most of its time is
# compute-bound training runs, each with several worker processes of its own: on a 2-core machine
# two pytest-xdist processes (RLINF_TEST_WORKERS=2: `-n 2 --dist loadfile`, the longest files
# first, see tests/conftest.py) took as long in all (59 min against 51 min in one process, on the
# same machine) and made each run three times slower, so that timed assertions and the learning
# tests' deadlines failed. With PYTEST_ARGS, pytest runs as given.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# shellcheck source-path=SCRIPTDIR source=install.sh
source "$ROOT/scripts/install.sh"

VENV="$ROOT/.venv"

# ---- lint -------------------------------------------------------------------------------------
if [[ "${RLINF_SKIP_LINT:-0}" == 1 ]]; then
    echo "[test] lint: skipped (RLINF_SKIP_LINT=1)"
else
    lint_paths=()
    for p in rlinf_vla tests benchmarks; do
        [[ -e "$p" ]] && lint_paths+=("$p")
    done
    lint_rc=0
    echo "[test] lint: ruff check ${lint_paths[*]}"
    "$VENV/bin/ruff" check "${lint_paths[@]}" || lint_rc=1
    echo "[test] lint: ruff format --check ${lint_paths[*]}"
    "$VENV/bin/ruff" format --check "${lint_paths[@]}" || lint_rc=1
    if [[ $lint_rc -ne 0 ]]; then
        echo "[test] FAILED: lint (fix with: .venv/bin/ruff check --fix ${lint_paths[*]} &&" \
            ".venv/bin/ruff format ${lint_paths[*]}; or skip with RLINF_SKIP_LINT=1)" >&2
        exit 1
    fi
    echo "[test] lint: ok"
fi

# ---- the extra envs, installed in the background during the main tests -----------------------
full_run=0
if [[ $# -eq 0 ]]; then
    full_run=1
fi
extra_installs=()
if [[ $full_run -eq 1 && "${RLINF_TEST_OPENPI:-1}" != 0 ]]; then
    extra_installs+=(install_openpi_client.sh)
fi
if [[ $full_run -eq 1 && "${RLINF_TEST_VLLM:-1}" != 0 ]]; then
    extra_installs+=(install_vllm.sh)
fi
installs_pid=""
if [[ ${#extra_installs[@]} -gt 0 ]]; then
    installs_dir="$(mktemp -d)"
    # One after the other (two pips at once would only compete), in a session of their own so
    # that an early exit of this script stops them: see stop_installs.
    setsid bash -c '
        dir="$1"
        shift
        for script in "$@"; do
            log="$dir/${script%.sh}.out"
            start=$(date +%s)
            rc=0
            bash "$0/scripts/$script" >"$log" 2>&1 || rc=$?
            echo "$rc $(($(date +%s) - start))" >"$log.rc"
        done' "$ROOT" "$installs_dir" "${extra_installs[@]}" &
    installs_pid=$!
    echo "[test] installing in the background: ${extra_installs[*]}"
fi
stop_installs() {
    if [[ -n "$installs_pid" ]] && kill -0 "$installs_pid" 2>/dev/null; then
        kill -- "-$installs_pid" 2>/dev/null || true
    fi
    [[ -z "$installs_pid" ]] || rm -rf "$installs_dir"
}
trap stop_installs EXIT
# wait_install <script>: wait for the background install of <script>; print its log; its rc.
wait_install() {
    local out="$installs_dir/${1%.sh}.out" rc seconds
    while [[ ! -f "$out.rc" ]]; do
        if ! kill -0 "$installs_pid" 2>/dev/null && [[ ! -f "$out.rc" ]]; then
            echo "[test] the background install of $1 stopped without a result" >&2
            return 1
        fi
        sleep 2
    done
    cat "$out"
    read -r rc seconds <"$out.rc"
    echo "[test] $1: exit $rc after $seconds s (in the background)"
    return "$rc"
}

# ---- tests ------------------------------------------------------------------------------------
if [[ $full_run -eq 1 ]]; then
    # The slowest tests, printed at the end: the suite's share of CI's time is watched from them.
    set -- -q --durations=40 --durations-min=15
    if [[ "${RLINF_TEST_WORKERS:-0}" != 0 ]]; then
        set -- "$@" -n "${RLINF_TEST_WORKERS}" --dist loadfile --no-loadscope-reorder
        # Each process gets its share of the cores as torch threads (and so do the CPU slots of
        # the runs it starts, which OMP_NUM_THREADS caps): two processes that each compute with
        # every core fight over them and finish later than with one thread each.
        if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
            OMP_NUM_THREADS=$(($(nproc) / RLINF_TEST_WORKERS))
            export OMP_NUM_THREADS=$((OMP_NUM_THREADS > 0 ? OMP_NUM_THREADS : 1))
            echo "[test] OMP_NUM_THREADS=$OMP_NUM_THREADS (the cores shared among the test processes)"
            threads_set_here=1
        fi
    fi
    # tests/interop runs in its own stage below, once .venv-openpi exists.
    if [[ "${RLINF_TEST_OPENPI:-1}" != 0 ]]; then
        set -- "$@" --ignore=tests/interop
    fi
fi
echo "[test] pytest $*"
rc=0
"$VENV/bin/python" -m pytest "$@" || rc=$?
if [[ "${threads_set_here:-0}" == 1 ]]; then
    unset OMP_NUM_THREADS # the later stages run alone
fi
if [[ $rc -eq 5 ]]; then
    # Exit 5 = "no tests collected": fine only while the repo has no test files at all.
    if [[ -z "$(find tests -type f \( -name 'test_*.py' -o -name '*_test.py' \) -print -quit 2>/dev/null)" ]]; then
        echo "[test] ok: there are no test files under tests/ yet, so nothing ran (pytest exit 5 accepted)"
        exit 0
    fi
    echo "[test] FAILED: pytest collected no tests although tests/ has test files (exit 5)" >&2
    exit 5
fi
if [[ $rc -ne 0 ]]; then
    echo "[test] FAILED: pytest exit code $rc" >&2
    exit "$rc"
fi

# ---- openpi-client stage ---------------------------------------------------------------------
if [[ $full_run -eq 1 && "${RLINF_TEST_OPENPI:-1}" != 0 ]]; then
    openpi_t0=$(date +%s)
    wait_install install_openpi_client.sh || {
        echo "[test] FAILED: installing .venv-openpi (skip this stage with RLINF_TEST_OPENPI=0)" >&2
        exit 1
    }
    echo "[test] pytest tests/interop (openpi-client from .venv-openpi)"
    rc=0
    RLINF_REQUIRE_OPENPI=1 "$VENV/bin/python" -m pytest -q tests/interop || rc=$?
    if [[ $rc -ne 0 ]]; then
        echo "[test] FAILED: the openpi interop tests, pytest exit code $rc" >&2
        exit "$rc"
    fi
    echo "[test] openpi-client stage: ok ($(($(date +%s) - openpi_t0)) s)"
elif [[ $full_run -eq 1 ]]; then
    echo "[test] openpi-client stage: skipped (RLINF_TEST_OPENPI=0)"
fi

# ---- vLLM stage -------------------------------------------------------------------------------
if [[ $full_run -eq 1 && "${RLINF_TEST_VLLM:-1}" != 0 ]]; then
    vllm_t0=$(date +%s)
    wait_install install_vllm.sh || {
        echo "[test] FAILED: installing .venv-vllm (skip this stage with RLINF_TEST_VLLM=0)" >&2
        exit 1
    }
    echo "[test] pytest tests/reasoning/test_vllm.py (in .venv-vllm)"
    rc=0
    "$ROOT/.venv-vllm/bin/python" -m pytest -q tests/reasoning/test_vllm.py || rc=$?
    if [[ $rc -ne 0 ]]; then
        echo "[test] FAILED: the vLLM tests, pytest exit code $rc" >&2
        exit "$rc"
    fi
    echo "[test] vLLM stage: ok ($(($(date +%s) - vllm_t0)) s)"
elif [[ $full_run -eq 1 ]]; then
    echo "[test] vLLM stage: skipped (RLINF_TEST_VLLM=0)"
fi
echo "[test] ok"
