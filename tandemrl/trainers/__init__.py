"""Training loops shared by the example scripts (import the submodules; nothing heavy here)."""
