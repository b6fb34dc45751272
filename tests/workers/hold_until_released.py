"""A trainer that holds its run until ``<cluster.fileroot>/release`` exists (the run-lock tests' live run)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __name__ == "__main__":
    root = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("cluster.fileroot="))
    release = Path(root) / "release"
    print("holding the run", flush=True)
    while not release.exists():
        time.sleep(0.05)
    print("released", flush=True)
