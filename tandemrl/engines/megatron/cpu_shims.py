"""The only CPU workarounds of the Megatron backend: megatron-core 0.16.1 assumes CUDA in many places.

Applied by the engine/model code before anything Megatron is built, and only when CUDA is absent,
so a GPU run sees stock megatron-core. Measured need for each patch: notes "megatron-core on CPU".
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
from typing import Any

import torch

_APPLIED = False
_DEVICE_FNS = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like")
# megatron-core modules with device="cuda" literals on the training path; imported before patching.
_CUDA_LITERAL_MODULES = (
    "megatron.core.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.data",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
)


class _TorchProxy(types.ModuleType):
    """`torch` as seen by megatron-core modules: the real module except for device-literal-fixing factories."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _FakeStream:
    """Stands in for torch.cuda.Stream/Event: the MoE alltoall dispatcher creates and syncs them."""

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: self  # wait_stream, synchronize, record_event (-> an "event"), record, wait, ...


def _cpu_device(fn: Any) -> Any:
    """Rewrite device='cuda...' literals (optimizer, clip_grads, schedules, found_inf) to the CPU."""

    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        if k.get("device") is not None and "cuda" in str(k["device"]):
            k["device"] = "cpu"
        return fn(*a, **k)

    return wrapper


def apply_cpu_shims() -> None:
    """Patch torch.cuda / megatron-core so TP/PP/EP models, DDP and optimizers run on CPU + gloo (idempotent)."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    _APPLIED = True
    _shim_cuda_runtime()
    _shim_device_literals()
    _shim_moe()
    _shim_uneven_split_collectives()


def _shim_cuda_runtime() -> None:
    """Device queries, RNG state and ``.cuda()`` answer for the CPU; DistributedOptimizer's type check passes."""
    # Base: mcore passes torch.cuda.current_device() as device= everywhere (rotary, embeddings, router, ...),
    # calls .cuda() on modules/tensors and seeds/saves CUDA RNG state in its RNG tracker (used by attention).
    cuda: Any = torch.cuda  # patched at run time: untyped on purpose
    tensor_cls: Any = torch.Tensor
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *a, **k: None
    cuda.manual_seed = lambda seed: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda s, *a, **k: torch.set_rng_state(s)
    cuda.empty_cache = lambda: None
    tensor_cls.cuda = lambda self, *a, **k: self  # also makes nn.Module.cuda() a no-op
    from megatron.core.tensor_parallel import random as mc_random

    mc_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mc_random._set_cuda_rng_state = lambda s, *a, **k: torch.set_rng_state(s)
    # DistributedOptimizer only accepts params whose type() is 'torch.cuda.FloatTensor' (and friends).
    orig_type = torch.Tensor.type

    def _type(self: torch.Tensor, *a: Any, **k: Any) -> Any:
        if a or k:
            return orig_type(self, *a, **k)
        t = orig_type(self)
        return t if t.startswith("torch.cuda.") else t.replace("torch.", "torch.cuda.", 1)

    tensor_cls.type = _type


def _shim_device_literals() -> None:
    """megatron-core's own ``torch.tensor(..., device='cuda')`` calls allocate on the CPU."""
    # Optimizer / schedules / grad buffers / MoE: torch.tensor(..., device='cuda') literals. Patched through a
    # proxy `torch` in megatron's own modules only: wrapping the global torch.tensor breaks transformers' loading
    # (it then leaves non-persistent buffers such as rotary inv_freq uninitialised).
    proxy = _TorchProxy("torch")
    for name in _DEVICE_FNS:
        setattr(proxy, name, _cpu_device(getattr(torch, name)))
    for mod_name in _CUDA_LITERAL_MODULES:
        importlib.import_module(mod_name)
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("megatron.core") and getattr(mod, "torch", None) is torch:
            vars(mod)["torch"] = proxy


def _shim_moe() -> None:
    """The MoE alltoall dispatcher: no TransformerEngine gemm, fake CUDA streams, numpy split sizes."""
    # MoE: mcore 0.16.1 references te_general_gemm without defining it when TransformerEngine is absent.
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.te_general_gemm = None
    cuda: Any = torch.cuda  # patched at run time: untyped on purpose
    # MoE alltoall dispatcher creates CUDA streams/events in __init__ and switches streams around comms.
    fake = _FakeStream()
    cuda.Stream = _FakeStream
    cuda.Event = _FakeStream
    cuda.current_stream = lambda *a, **k: fake
    cuda.default_stream = lambda *a, **k: fake
    cuda.stream = lambda s=None: contextlib.nullcontext()
    # all_to_all_single needs list split sizes; mcore converts only CUDA tensors to numpy.
    orig_move = moe_utils.maybe_move_tensor_to_cpu

    def _move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return orig_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = _move
    token_dispatcher.maybe_move_tensor_to_cpu = _move


def _shim_uneven_split_collectives() -> None:
    """Gathers and reduce-scatters with per-rank split sizes, which gloo lacks."""
    # Expert-TP (and TP + sequence parallel) gathers/reduce-scatters routed tokens with per-rank split sizes;
    # gloo's all_gather needs equal sizes and it has no list reduce_scatter.
    from megatron.core.tensor_parallel import mappings

    orig_gather, orig_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def _gather(input_: torch.Tensor, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False):
        if output_split_sizes is None or group.size() == 1:
            return orig_gather(input_, group, output_split_sizes, use_global_buffer)
        # Pad every rank's rows to the longest, gather equal blocks, keep each rank's real rows.
        longest = max(output_split_sizes)
        padded = input_.new_zeros(longest, *input_.shape[1:])
        padded[: input_.shape[0]] = input_
        blocks = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(blocks, padded.contiguous(), group=group)
        return torch.cat([b[:n] for b, n in zip(blocks, output_split_sizes, strict=True)])

    def _scatter(input_: torch.Tensor, group: Any, input_split_sizes: Any = None, use_global_buffer: bool = False):
        if input_split_sizes is None or group.size() == 1:
            return orig_scatter(input_, group, input_split_sizes, use_global_buffer)
        # Sum the whole tensor over the group, keep this rank's rows.
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        return torch.split(total, list(input_split_sizes), dim=0)[group.rank()].contiguous()

    mappings._gather_along_first_dim = _gather
    mappings._reduce_scatter_along_first_dim = _scatter
