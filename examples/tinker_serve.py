"""The Tinker API as a launcher job (docs/tinker.md): the launcher starts the vLLM server, this serves the API.

    python -m tandemrl.launchers.local examples/tinker_serve.py --config examples/tinker_serve.yaml

It prints ``TINKER_BASE_URL=... TINKER_API_KEY=...``; Ctrl-C stops the API and the server.
"""

from __future__ import annotations

from tandemrl.tinker.job import main
from tandemrl.utils.cli import run_main

if __name__ == "__main__":
    run_main(main)
