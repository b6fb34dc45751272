"""Command-line evaluation of checkpoints (``python -m tandemrl.eval``); the scoring itself is
``tandemrl.workflows.gsm8k_eval``, which a running trainer calls directly."""
