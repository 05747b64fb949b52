#!/usr/bin/env bash
# scripts/gpu_check.sh: on the GPU machine, install the carried packages and run the GPU
# measurements (benchmarks/gpu_check.py) before a deadline.
#
#   GPU_DEADLINE_S=540 bash scripts/gpu_check.sh          # the last device call of .gpu/CALLS.md
#   GPU_CHECK_ARGS='--steps decode,pytest' bash scripts/gpu_check.sh   # more gpu_check.py options
#
# Runs from the repository root after the earlier device calls have left the parts that
# scripts/gpu_prepare.sh made in /tmp/gpu/ (this call carries the last one and SHA256SUMS in
# .gpu/parts/):
#   1. Unless /tmp/site already holds these parts' packages (a repeated call on a warm machine):
#      copies the carried parts to /tmp/gpu/, checks every part against SHA256SUMS (a missing
#      part means the machine went cold between the calls: start again from the first call),
#      unpacks the joined tar in /tmp/gpu/ and installs its wheels with
#      `python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site`.
#   2. Where `ldconfig -p` lists no libEGL.so.1, unpacks the carried EGL loader (.deb files) into
#      / and runs ldconfig; points EGL at NVIDIA's vendor file where the system has none.
#   3. Exports PYTHONPATH=/tmp/site:$PWD, MUJOCO_GL=egl, PYOPENGL_PLATFORM=egl and runs
#      `python3 benchmarks/gpu_check.py --out "$OUT" --deadline-s N`, N being what is left of
#      GPU_DEADLINE_S (counted from this script's start) for the measurements.
#
# Knobs (environment variables)
#   GPU_DEADLINE_S=540      seconds from this script's start by which everything has stopped
#   GPU_CHECK_ARGS=         more arguments for benchmarks/gpu_check.py (e.g. --steps, --dry-run-cpu)
#   OUT                     where results go (returned by the call; default /tmp/gpu-check-out)
#   PYTHON=python3          the interpreter with torch (the machine's /opt/torch/.venv python3)
set -euo pipefail

START=$(date +%s)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEADLINE_S="${GPU_DEADLINE_S:-540}"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-/tmp/gpu-check-out}"
PARTS=/tmp/gpu
SITE=/tmp/site
SUMS="$ROOT/.gpu/parts/SHA256SUMS"
STAMP="$SITE/.rlinf-gpu-parts"

log() { echo "[gpu-check] $*"; }
die() {
    echo "[gpu-check] ERROR: $*" >&2
    exit 1
}
mkdir -p "$OUT" "$PARTS"

# ---- 1. join and install --------------------------------------------------------------------
if [[ -f "$STAMP" && (! -f "$SUMS" || "$(cat "$STAMP")" == "$(sha256sum <"$SUMS" | cut -d' ' -f1)") ]]; then
    log "packages already installed in $SITE ($(find "$SITE" -maxdepth 1 -name '*.dist-info' | wc -l) distributions)"
else
    [[ -f "$SUMS" ]] || die "no .gpu/parts/SHA256SUMS here: carry it in this call (see .gpu/CALLS.md)"
    cp "$SUMS" "$PARTS/SHA256SUMS"
    for p in "$ROOT"/.gpu/parts/gpu.tar.part-*; do
        [[ -f "$p" ]] && cp "$p" "$PARTS/"
    done
    missing=()
    while read -r _ name; do
        [[ -f "$PARTS/$name" ]] || missing+=("$name")
    done <"$PARTS/SHA256SUMS"
    if [[ ${#missing[@]} -gt 0 ]]; then
        die "missing in $PARTS: ${missing[*]} (the machine went cold between the calls, or a call" \
            "was skipped): make the calls of .gpu/CALLS.md again from the first"
    fi
    (cd "$PARTS" && sha256sum --quiet -c SHA256SUMS) || die "a part in $PARTS is damaged; make the calls again"
    t0=$(date +%s)
    rm -rf "$PARTS/wheels" "$PARTS/debs" "$SITE"
    # shellcheck disable=SC2046
    cat $(awk '{ print "'"$PARTS"'/" $2 }' "$PARTS/SHA256SUMS") | tar -x -C "$PARTS"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$PARTS"/wheels/*.whl
    sha256sum <"$PARTS/SHA256SUMS" | cut -d' ' -f1 >"$STAMP"
    log "installed $(find "$PARTS/wheels" -name '*.whl' | wc -l) wheels into $SITE in $(($(date +%s) - t0)) s"
fi

# ---- 2. EGL ---------------------------------------------------------------------------------
if ! ldconfig -p 2>/dev/null | grep -q 'libEGL\.so\.1 '; then
    if compgen -G "$PARTS/debs/*.deb" >/dev/null; then
        for f in "$PARTS"/debs/*.deb; do dpkg -x "$f" /; done
        ldconfig
        log "unpacked the EGL loader ($(find "$PARTS/debs" -name '*.deb' | wc -l) .deb files)"
    else
        log "WARNING: no libEGL.so.1 and no carried EGL loader: MuJoCo's EGL rendering will fail"
    fi
fi
nvidia_egl=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
if [[ -z "${__EGL_VENDOR_LIBRARY_FILENAMES:-}" && -f "$nvidia_egl" ]] &&
    ! compgen -G "/usr/share/glvnd/egl_vendor.d/*nvidia*.json" >/dev/null; then
    export __EGL_VENDOR_LIBRARY_FILENAMES="$nvidia_egl"
fi

# ---- 3. the measurements --------------------------------------------------------------------
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MUJOCO_GL=egl PYOPENGL_PLATFORM=egl PYTHONUNBUFFERED=1 MS_SKIP_ASSET_DOWNLOAD_PROMPT=1
left=$((DEADLINE_S - ($(date +%s) - START)))
log "running benchmarks/gpu_check.py with ${left} s left (deadline ${DEADLINE_S} s)"
# shellcheck disable=SC2086
exec "$PYTHON" benchmarks/gpu_check.py --out "$OUT" --deadline-s "$left" ${GPU_CHECK_ARGS:-}
