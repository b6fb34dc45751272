#!/usr/bin/env bash
# GPU check of the training backends (FSDP2, DeepSpeed ZeRO-3, Megatron, the parity table, bf16 MFU):
# one "CHECK <name> ok|skip|FAIL ..." line per check, exit status 1 if any FAILs. See scripts/gpu_check.py.
#
#   bash scripts/gpu_check.sh                 # on a machine with NVIDIA GPUs
#   bash scripts/gpu_check.sh --cpu           # CPU dry run (gloo; what needs CUDA skips)
#   bash scripts/gpu_check.sh --only fsdp2_   # a subset, by name prefix
#
# Python: $PYTHON, else the repository's .venv, else python3.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false WANDB_SILENT=true PYTHONUNBUFFERED=1
exec "$py" "$root/scripts/gpu_check.py" "$@"
