"""tandemrl: asynchronous RL of LLMs; inference servers and an SPMD trainer run in tandem.

Importing the package is cheap: heavy backends (megatron, deepspeed, vllm, ray) are
imported only by the modules that use them.
"""

from tandemrl.api.renamed import install_module_notices

__version__ = "0.1.0"
install_module_notices()  # an import of a renamed module fails with the line naming the new one
