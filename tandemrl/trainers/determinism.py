"""Deterministic mode on a trainer rank: deterministic torch kernels and seeded global RNGs.

Called by every training script's entry (``load_script_config``) on every rank when the config
says ``deterministic: true``, before any engine touches a device.
"""

from __future__ import annotations

import os
import random

# cuBLAS needs a fixed workspace to pick reproducible GEMM kernels (CUDA >= 10.2); unused on CPU.
CUBLAS_WORKSPACE = ":4096:8"


def enable_determinism(seed: int) -> None:
    """Deterministic torch algorithms (an op without one raises) and ``seed`` in every global RNG."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    random.seed(seed)
    torch.manual_seed(seed)  # all devices' default generators
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch
        return
    np.random.seed(seed % (1 << 32))
