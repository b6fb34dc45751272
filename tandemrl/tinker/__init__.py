"""A self-hosted Tinker API (``tandemrl tinker-serve``): the ``tinker`` SDK trains and samples on tandemrl.

``trainer`` (many LoRA adapters on one base model), ``sampler`` (vLLM multi-LoRA), ``wire``
(the SDK's proto formats), ``service`` (each call, futures in submission order), ``server``
(the HTTP routes and the per-run API key), ``serve`` (the command). See docs/tinker.md.
"""
