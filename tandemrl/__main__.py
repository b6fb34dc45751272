"""``python -m tandemrl``: the same as the ``tandemrl`` command (tandemrl/cli.py)."""

from tandemrl.cli import main

main()
