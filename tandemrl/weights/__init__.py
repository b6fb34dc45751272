"""The weight flow: how the trainer's weights reach the inference servers.

A push, in order through the modules:

1. ``plan``: the ``WeightUpdateMeta`` of the update (``collective_update``: group address, port, size).
2. ``push``: ``WeightPusher.push`` on every trainer rank; rank 0 asks the servers to load (disk) or
   to join and receive (collective), then streams the engine's exported tensors bucket by bucket.
3. ``wire``: each bucket packed into one flat byte tensor; ``delta``: or sent as its change since the last.
4. ``group``: the process group rank 0 hosts and the servers join; the buckets are broadcast over it.

The server side (``tandemrl.inference.vllm_ext``) joins with ``group`` and unpacks with ``wire``/``delta``.
Imports only ``tandemrl.api`` and ``tandemrl.utils``; this file imports nothing, so the vLLM worker
loads only the modules it uses.
"""
