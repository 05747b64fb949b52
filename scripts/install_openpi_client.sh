#!/usr/bin/env bash
# scripts/install_openpi_client.sh: a small second virtual env, <repo>/.venv-openpi, holding
# PyPI's openpi-client, for the interop tests (tests/interop/) of the openpi-compatible protocol.
#
#   bash scripts/install_openpi_client.sh
#   .venv/bin/python -m pytest tests/interop -q     # finds .venv-openpi by itself
#
# openpi-client pins numpy < 2 (the main env has numpy 2) and imports typing_extensions without
# declaring it, so it cannot share the main env: this one holds only openpi-client, its declared
# dependencies and typing_extensions (about 60 MB, mostly numpy). rlinf-vla is not installed here:
# the tests start `rlinf-vla serve` from the main env and run only openpi's client in this one.
#
# Knobs: RLINF_PYTHON (interpreter, default python3), RLINF_OPENPI_SPEC (default below),
# RLINF_FORCE_INSTALL=1 (redo the pip step). A stamp skips a repeated run; pip's output goes to
# .venv-openpi/install.log.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-openpi"
LOG="$VENV/install.log"
STAMP="$VENV/.rlinf-install-stamp"
SPEC="${RLINF_OPENPI_SPEC:-openpi-client==0.1.2 numpy<2 typing_extensions}"
PY_BASE="${RLINF_PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_PROGRESS_BAR=off

log() { echo "[install-openpi] $*"; }
now() { date +%s; }

want="$({
    cat "$ROOT/scripts/install_openpi_client.sh"
    echo "spec: $SPEC"
} | sha256sum | cut -d' ' -f1)"
if [[ "${RLINF_FORCE_INSTALL:-0}" != 1 && -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    log "ok (cached; $VENV)"
    exit 0
fi

t0=$(now)
[[ -x "$VENV/bin/python" ]] || "$PY_BASE" -m venv "$VENV"
rm -f "$STAMP"
: >"$LOG"
log "installing $SPEC ..."
# shellcheck disable=SC2086
if ! "$VENV/bin/python" -m pip install $SPEC >>"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    echo "[install-openpi] ERROR: pip failed (full log: $LOG)" >&2
    exit 1
fi
"$VENV/bin/python" -c 'import openpi_client.websocket_client_policy, openpi_client.msgpack_numpy' >>"$LOG" 2>&1 || {
    tail -n 20 "$LOG" >&2
    echo "[install-openpi] ERROR: openpi_client does not import in $VENV (full log: $LOG)" >&2
    exit 1
}
echo "$want" >"$STAMP"
version="$("$VENV/bin/python" -m pip show openpi-client 2>/dev/null | sed -n 's/^Version: //p')"
log "ok ($(($(now) - t0)) s; openpi-client $version, $(du -sh "$VENV" 2>/dev/null | cut -f1))"
