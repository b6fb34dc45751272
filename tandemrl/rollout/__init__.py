"""Rollout, a peer of training: ``controller`` (the ``RolloutController`` the trainer drives),
``executor`` (batches for the trainer, composing ``feed``: which rows go in, and ``episodes``:
runs and books them on a background event loop), ``staleness`` (the off-policyness bound),
``distributed`` (DP-head collection and redistribution of batches) and ``weights`` (pushing
weights to the servers). Import from the submodules."""
