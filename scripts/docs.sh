#!/usr/bin/env bash
# Build the docs site (MkDocs + mkdocstrings, mkdocs.yml) strictly into site/: a broken link, a
# missing page or an unresolved API reference fails the build. `serve` serves it live instead.
# Extra arguments go to mkdocs (e.g. --site-dir DIR).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${1:-}" == "serve" ]]; then
    shift
    exec .venv/bin/mkdocs serve --strict "$@"
fi
exec .venv/bin/mkdocs build --strict --quiet "$@"
