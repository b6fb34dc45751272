#!/usr/bin/env bash
# Install (or reuse) the pinned environment, then run the whole test suite.
# --stress (or TANDEMRL_STRESS=1): a background process burns one CPU core for the whole run,
# to show that no test depends on timing; it is stopped when pytest ends, however it ends.
# --fast: only the unit tier (`-m unit`, the files in tests/unit: no server, process group or launcher),
# a few minutes, for work in progress; CI (.ci/run) runs every tier.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
args=()
stress="${TANDEMRL_STRESS:-0}"
for a in "$@"; do
    if [[ "$a" == "--stress" ]]; then
        stress=1
    elif [[ "$a" == "--fast" ]]; then
        args+=(-m unit)
    else
        args+=("$a")
    fi
done
bash "$root/scripts/setup_env.sh"
cd "$root"
export WANDB_SILENT=true TOKENIZERS_PARALLELISM=false
if [[ "$stress" != "0" ]]; then
    bash -c 'while :; do :; done' &
    burner=$!
    trap 'kill "$burner" 2>/dev/null || true' EXIT
    echo "stress: pid $burner burns one CPU core during the tests"
fi
# The layer contracts of pyproject.toml [tool.importlinter] (docs/architecture.md).
.venv/bin/lint-imports --no-cache
# The type checker, pyproject.toml [tool.mypy] (strict on api, algorithms, rollout, weights; cache: .mypy_cache).
.venv/bin/mypy
# No path given: pytest runs its testpaths (tests/); paths given: only those.
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 ${args[@]+"${args[@]}"}
