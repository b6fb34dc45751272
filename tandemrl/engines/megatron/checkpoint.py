"""Recoverable Megatron checkpoints as megatron-core ``dist_checkpointing`` (torch_dist / torch DCP).

Weights come from ``GPTModel.sharded_state_dict()`` and the optimizer state from
``optimizer.sharded_state_dict(model_sd)``: every tensor is saved as a shard of its global
(unsharded) tensor, keyed by layer name, so a checkpoint saved on one data/tensor/pipeline layout
loads on another. The distributed optimizer uses the ``fully_reshardable`` format (Adam moments in
each parameter's own shape rather than in the bucket layout, which depends on TP/PP), so it too
survives a layout change (saving gathers each DP group's optimizer state on its ranks). The engine's
version and LR schedule live next to it (engine_state.py).

Known limit (mcore 0.16.1): 16-bit models whose norms stay fp32 (the local spec without a Float16Module)
cannot save optimizer state: mcore's optimizers map a param group mixing fp32 and 16-bit parameters wrongly.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

CKPT_SUBDIR = "dist_ckpt"
# Layout-free optimizer state; no 'chained_N.' prefix so MoE (chained) and dense optimizers keep their keys.
_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def checkpoint_dir(path: str) -> str:
    """Where ``dist_checkpointing`` writes inside a recoverable checkpoint directory."""
    return os.path.join(path, CKPT_SUBDIR)


def _is_distributed(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in optimizer.chained_optimizers)


def _sharded_state_dict(model: Any, optimizer: Any, with_optim: bool, is_loading: bool) -> dict:
    sd: dict[str, Any] = {"model": model.sharded_state_dict()}
    if with_optim:
        _prime_adam_state(optimizer)
        sd["optimizer"] = optimizer.sharded_state_dict(sd["model"], is_loading=is_loading, metadata=_OPTIM_METADATA)
    return sd


def save_checkpoint(path: str, model: torch.nn.Module, optimizer: Any, with_optim: bool) -> None:
    """Collective: write ``model`` (the GPTModel of this rank's stage) and, if ``with_optim``, the optimizer.

    The torch_dist writer starts a spawn-context multiprocessing manager once per process, which imports
    the main script again: that script needs an ``if __name__ == "__main__"`` guard (as the examples have).
    """
    from megatron.core import dist_checkpointing

    target = checkpoint_dir(path)
    if dist.get_rank() == 0:  # a previous save's shard files (e.g. from more ranks) must not linger
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(target)
    dist.barrier()
    # Read back before loading: the two optimizer kinds' states have different structures.
    content = {"distributed_optimizer": with_optim and _is_distributed(optimizer)}
    sd = _sharded_state_dict(model, optimizer, with_optim, is_loading=False)
    dist_checkpointing.save(sd, target, content_metadata=content)


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: Any, with_optim: bool) -> None:
    """Collective: restore weights (and optimizer state if ``with_optim``), whatever layout saved them."""
    from megatron.core import dist_checkpointing

    target = checkpoint_dir(path)
    if not dist_checkpointing.check_is_distributed_checkpoint(target):
        raise FileNotFoundError(f"{target} is not a complete megatron dist checkpoint (no metadata.json)")
    saved = (dist_checkpointing.load_content_metadata(target) or {}).get("distributed_optimizer")
    if with_optim and saved is not None and saved != _is_distributed(optimizer):
        # mcore would fail with a bare KeyError on the other kind's state structure.
        raise ValueError(
            f"checkpoint {path} holds {'distributed' if saved else 'non-distributed'} optimizer state: set "
            f"TrainEngineConfig.megatron.use_distributed_optimizer={saved} to resume it, or load with with_optim=False"
        )
    state = dist_checkpointing.load(_sharded_state_dict(model, optimizer, with_optim, is_loading=True), target)
    model.load_state_dict(state["model"])
    if with_optim:
        _load_optimizer(optimizer, state["optimizer"])
    elif optimizer is not None:
        optimizer.reload_model_params()  # fp32 main copies of 16-bit weights follow the loaded weights


def _load_optimizer(optimizer: Any, state: dict) -> None:
    """``optimizer.load_state_dict(state)`` per chained optimizer, working around two limits of mcore 0.16.1.

    - Layout: with expert parallelism the expert parameters get their own chained optimizer, so the
      number of optimizers depends on EP. The parameter state is keyed by parameter name and loads into
      any split; the small common state (param groups, step) of every saved optimizer is merged and each
      current optimizer picks its groups from it (megatron matches groups by wd/lr mult and expert flag).
    - torch Adam: ``DistributedOptimizer.load_state_dict`` gives every parameter the same 'step' tensor
      (torch's AdamW increments it once per parameter: each gets its own copy here), then copies the
      fully-reshardable parameter state into every per-parameter key, 'step' included, which that state
      does not have (KeyError). So the parameter state is loaded here with the steps set aside.
    """
    opts = optimizer.chained_optimizers
    # The loaded dict has the current optimizers' structure for sharded tensors and the saved one for the rest.
    saved = (
        [state]
        if "optimizer" in state or "state" in state
        else [state[k] for k in sorted(k for k in state if isinstance(k, int))]
    )
    current = [state] if len(opts) == 1 else [state[i] for i in range(len(opts))]
    distributed = "param_state_sharding_type" in saved[0]
    if not distributed and len(saved) != len(opts):
        raise ValueError(f"checkpoint holds {len(saved)} optimizers, this engine has {len(opts)}: keep the EP size")
    with torch.no_grad():  # fp32 main params of the distributed optimizer are views of leaf model params
        for i, opt in enumerate(opts):
            if distributed:
                assert saved[0]["param_state_sharding_type"] == _OPTIM_METADATA["distrib_optim_sharding_type"]
                groups = [g for c in saved for g in c["optimizer"]["param_groups"]]
                common = {k: v for k, v in saved[0].items() if k != "param_state"}
                common["optimizer"] = {**saved[0]["optimizer"], "param_groups": groups}
                opt.load_state_dict(common)
            else:
                opt.load_state_dict(current[i])
            inner = opt.optimizer
            steps = {p: st.pop("step") for p, st in inner.state.items() if "step" in st}
            if distributed:
                opt.load_parameter_state_from_fully_reshardable(current[i]["param_state"])
            for p, step in steps.items():
                inner.state[p]["step"] = step.clone()


def _prime_adam_state(optimizer: Any) -> None:
    """Give a never-stepped torch Adam the state its first step would create: zero moments, step 0.

    Without Apex/TransformerEngine (always so on CPU) megatron's optimizers wrap torch's AdamW, and
    ``DistributedOptimizer.state_dict()`` (which building any sharded state dict calls) reads the common
    step from the per-parameter states, failing while they are still empty (a save before the first
    step, or any load). AdamW then steps exactly as from an empty state; a load overwrites it anyway.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner, init = getattr(opt, "optimizer", None), getattr(opt, "init_state_fn", None)
        if inner is None or init is None or len(inner.state) > 0:
            continue
        init(inner, getattr(opt, "config", None))
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))
