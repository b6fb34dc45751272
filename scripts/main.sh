#!/usr/bin/env bash
# Install (or reuse) the pinned environment, then run the main job -- GRPO on GSM8K with
# the embedded defaults (tiny Qwen2 built on first use, one vLLM server, FSDP trainer) --
# on the local GSM8K copy (no network at run time). Extra args are config overrides.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
data="${TANDEMRL_GSM8K:-$root/../shared/data/gsm8k}"
export WANDB_SILENT=true TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m tandemrl.launchers.local examples/gsm8k_grpo.py \
  --config examples/gsm8k_grpo.yaml train_dataset.path="$data" "$@"
