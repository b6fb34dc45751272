"""Rollout, a peer of training: ``controller`` (the ``RolloutController`` the trainer drives),
``executor`` (episodes on a background event loop), ``staleness`` (the off-policyness bound),
``distributed`` (DP-head collection and redistribution of batches) and ``weights`` (pushing
weights to the servers). Import from the submodules."""
