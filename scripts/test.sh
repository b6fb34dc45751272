#!/usr/bin/env bash
# Install (or reuse) the pinned environment, then run the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
export WANDB_SILENT=true TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider --durations=15 "$@"
