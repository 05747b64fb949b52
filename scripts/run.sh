#!/usr/bin/env bash
# scripts/run.sh: install everything (scripts/install.sh), then run the main job on its default config.
#
#   bash scripts/run.sh [ARGS...]    # ARGS (overrides) go after `rlinf-vla train experiment=quickstart`
set -euo pipefail

# The main job: `rlinf-vla train experiment=quickstart`: PPO from a shipped behaviour-cloning
# warm start on ManiSkill PushCube from the camera and proprioception, 20 iterations with a
# greedy evaluation before, half-way and after; it ends with a before / after line and the
# learning curves (<run>/curves.png). See README.md and docs/training.md.
MAIN_SUBCOMMAND="train"
MAIN_ARGS=(experiment=quickstart)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# Installs/updates system packages and .venv (seconds when nothing changed) and exports
# MS_SKIP_ASSET_DOWNLOAD_PROMPT, MUJOCO_GL, PYOPENGL_PLATFORM.
# shellcheck source-path=SCRIPTDIR source=install.sh
source "$ROOT/scripts/install.sh"

echo "[run] rlinf-vla $MAIN_SUBCOMMAND ${MAIN_ARGS[*]} $*"
exec "$ROOT/.venv/bin/rlinf-vla" "$MAIN_SUBCOMMAND" "${MAIN_ARGS[@]}" "$@"
