#!/usr/bin/env bash
# Install (or reuse) the pinned environment, then run the main job with its embedded
# defaults on the local GSM8K copy (no network at run time). Extra args are config overrides.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
data="${TANDEMRL_GSM8K:-$root/../shared/data/gsm8k}"
export WANDB_SILENT=true TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
exec .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 examples/gsm8k_sft.py \
  --config examples/gsm8k_sft.yaml train_dataset.path="$data" "$@"
