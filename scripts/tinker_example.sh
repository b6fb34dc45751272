#!/usr/bin/env bash
# The Tinker example end to end on this machine: install (or reuse) the pinned environment, generate the
# arithmetic problems (as scripts/main.sh does), start `tandemrl tinker-serve` on SmolLM2-135M-Instruct, run
# examples/tinker_rl_loop.py (the `tinker` SDK only) against it with the settings measured in docs/tinker.md
# ("The example learns"), then stop the server. Prints the held-out accuracy before and after with the exact
# McNemar p. Extra args go to the example and override its settings here (e.g. --iterations 3 --eval 50).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
start=$(date +%s)
bash "$root/scripts/setup_env.sh"
cd "$root"
export WANDB_SILENT=true TOKENIZERS_PARALLELISM=false
data="${TANDEMRL_ARITH:-$root/runs/data/arith}"
[[ -f "$data/test.jsonl" ]] || .venv/bin/python -m tandemrl.data.arith --out "$data" --difficulty 1
logs="$root/runs/tinker_example"
mkdir -p "$logs"
: > "$logs/serve.log"
.venv/bin/tandemrl tinker-serve --model smollm2-135m --port 0 --compute-dtype bfloat16 \
  --key-file "$logs/api.key" > "$logs/serve.log" 2>&1 &
serve=$!
# SIGTERM lets tinker-serve stop its vLLM server and trainer ranks; nothing is left running on any exit
trap 'kill -TERM $serve 2>/dev/null; wait $serve 2>/dev/null || true' EXIT
until grep -q '^TINKER_BASE_URL=' "$logs/serve.log"; do
  kill -0 $serve 2>/dev/null || { echo "tinker-serve exited before serving; its log: $logs/serve.log" >&2; exit 1; }
  sleep 2
done
url=$(grep -m1 '^TINKER_BASE_URL=' "$logs/serve.log" | cut -d' ' -f1 | cut -d= -f2)
echo "tinker-serve at $url after $(( $(date +%s) - start )) s (log: $logs/serve.log)"
TINKER_BASE_URL="$url" TINKER_API_KEY="$(cat "$logs/api.key")" .venv/bin/python examples/tinker_rl_loop.py \
  --base-model smollm2-135m --data "$data" --iterations 15 --questions 16 --group 8 --max-tokens 128 \
  --temperature 0.6 --ratio-base trainer --rank 8 --lr 5e-4 --fill 4 --max-rounds 4 --eval 500 "$@"
echo "done in $(( $(date +%s) - start )) s"
