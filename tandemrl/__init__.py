"""tandemrl: asynchronous RL of LLMs; inference servers and an SPMD trainer run in tandem.

Importing the package is cheap: heavy backends (megatron, deepspeed, vllm, ray) are
imported only by the modules that use them.
"""

__version__ = "0.1.0"
