#!/usr/bin/env bash
# scripts/run.sh: install everything (scripts/install.sh), then run the main job on its default config.
#
#   bash scripts/run.sh [ARGS...]    # ARGS go to `rlinf-vla <MAIN_SUBCOMMAND>`
set -euo pipefail

# The main job: `rlinf-vla $MAIN_SUBCOMMAND` on its default config (PPO with the tiny OpenVLA on
# ManiSkill PickCube, collocated on a local Ray; see docs/training.md).
MAIN_SUBCOMMAND="train"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# Installs/updates system packages and .venv (seconds when nothing changed) and exports
# MS_SKIP_ASSET_DOWNLOAD_PROMPT, MUJOCO_GL, PYOPENGL_PLATFORM.
# shellcheck source-path=SCRIPTDIR source=install.sh
source "$ROOT/scripts/install.sh"

echo "[run] rlinf-vla $MAIN_SUBCOMMAND $*"
exec "$ROOT/.venv/bin/rlinf-vla" "$MAIN_SUBCOMMAND" "$@"
