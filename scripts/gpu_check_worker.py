"""torchrun worker of scripts/gpu_check.py: runs the checks it is given, rank 0 writes ``<check>.json``.

Checks (``--plan`` is a JSON list of ``{"name": ..., "check": ...}``; a check is one of):

``sft:<backend>:<tag>``  a few SFT steps of the tiny model on one repeated batch (see ``SFT``);
``parity:<json row>``    one row of the cross-backend parity table (tests/integration/test_backend_parity.py), run by
                         tests/workers/parity_checks.py; the driver compares the rows;
``mfu``                  bf16 MFU of the FSDP2 step (scripts/gpu_check_mfu.py).

Every result holds ``status`` (ok / FAIL), the process group's backend and the engine's device, both
detected (NCCL and cuda:LOCAL_RANK with CUDA, gloo and cpu without). ``--local-spec`` builds Megatron
models with the local (pure torch) layer spec even when TransformerEngine is importable.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "workers"))  # parity_checks and the helpers it imports
sys.path.insert(0, str(Path(__file__).resolve().parent))

# SFT checks: backend -> (allocation prefix, TrainEngineConfig fields, steps).
SFT: dict[str, tuple[str, dict[str, Any], int]] = {
    "fsdp": ("fsdp", {"mixed_precision": "bfloat16"}, 5),  # fp32 master weights, bf16 compute
    "deepspeed": ("deepspeed", {"dtype": "bfloat16", "deepspeed.zero_stage": 3}, 3),
    "megatron": ("megatron", {"dtype": "bfloat16"}, 3),
}
SFT_LR = 1e-3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sft_batch(vocab: int, seed: int, n: int = 8, max_len: int = 128) -> dict[str, torch.Tensor]:
    """A padded batch of ``n`` rows of random ids with varied lengths; the first 4 tokens are the prompt."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max_len // 4, max_len + 1, (n,), generator=g)
    pos = torch.arange(max_len)[None, :]
    am = pos < lens[:, None]
    ids = torch.randint(0, vocab, (n, max_len), generator=g) * am
    return {"input_ids": ids, "attention_mask": am, "loss_mask": (am & (pos >= 4)).int()}


def build_engine(allocation: str, cfg: Any, steps: int) -> Any:
    from tandemrl.api.types import FinetuneSpec
    from tandemrl.configs.backends import parse_allocation
    from tandemrl.engines.registry import make_engine

    component = parse_allocation(allocation).train
    assert component is not None, allocation
    engine = make_engine(component.backend, cfg)
    engine.create_process_group(component.strategy)
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=steps, train_batch_size=1))
    return engine


def run_sft(backend: str, model: str) -> dict[str, Any]:
    """``steps`` optimizer steps on one fixed batch (so the loss must fall); losses, grad norms, s/step."""
    from parity_checks import apply_overrides, dp_slice

    from tandemrl.algorithms.sft import SFTActor
    from tandemrl.configs.engine import MicroBatchSpec, OptimizerConfig, TrainEngineConfig

    prefix, fields, steps = SFT[backend]
    world = dist.get_world_size()
    cfg = TrainEngineConfig(path=model, mb_spec=MicroBatchSpec(n_mbs=2))
    cfg.optimizer = OptimizerConfig(lr=SFT_LR, gradient_clipping=1.0)
    apply_overrides(cfg, fields)
    engine = build_engine(f"{prefix}:d{world}", cfg, steps)
    sft = SFTActor(engine)
    batch = dp_slice(engine, sft_batch(engine.model_config.vocab_size, seed=11, n=8 * world))
    losses, norms, times = [], [], []
    for _ in range(steps):
        sync(engine.device)
        t0 = time.perf_counter()
        stats = sft.train_lm(batch)
        sync(engine.device)
        times.append(time.perf_counter() - t0)
        losses.append(stats["loss"])
        norms.append(stats["grad_norm"])
    params_dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    device = str(engine.device)
    engine.destroy()
    finite = all(math.isfinite(x) for x in losses + norms)
    falls = finite and losses[-1] < losses[0]
    res = {
        "losses": losses,
        "grad_norms": norms,
        "s_per_step": sum(times[1:]) / max(1, len(times) - 1),  # the first step includes warm-up
        "first_step_s": times[0],
        "params_dtype": params_dtype,
        "device": device,
        "fields": fields,
    }
    res["status"] = "ok" if falls else "FAIL"
    if not finite:
        res["reason"] = "non-finite loss or grad norm"
    elif not falls:
        res["reason"] = "loss did not fall on a repeated batch"
    return res


def run_parity(row: dict[str, Any], model: str, out_dir: str) -> dict[str, Any]:
    """One parity-table row (5 SFT + 3 PPO steps, 3 critic steps), fp32, deterministic algorithms."""
    import parity_checks

    torch.use_deterministic_algorithms(True, warn_only=torch.cuda.is_available())
    torch.utils.deterministic.fill_uninitialized_memory = False  # as in the parity worker
    try:
        parity_checks.save_critic_checkpoint(model, os.path.join(out_dir, parity_checks.CRITIC_DIR))
        result: dict[str, Any] = parity_checks.run_case(row, model)
        result.update(parity_checks.run_critic(row, model, out_dir))
    finally:
        torch.use_deterministic_algorithms(False)
    return {"status": "ok", "values": result, "row": row}


def run_check(check: str, args: argparse.Namespace) -> dict[str, Any]:
    kind, _, arg = check.partition(":")
    if kind == "sft":
        return run_sft(arg.split(":")[0], args.model)
    if kind == "parity":
        return run_parity(json.loads(arg), args.model, args.out)
    if kind == "mfu":
        from gpu_check_mfu import run_mfu

        result = run_mfu(args.out, cpu=not torch.cuda.is_available())
        return {"status": "ok", "result": result, "device": result["device"]}
    raise ValueError(f"unknown check {check!r}")


def first_error_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300]


def write(out_dir: str, name: str, result: dict[str, Any]) -> None:
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump(result, f, indent=1)


def main(args: argparse.Namespace) -> None:
    from tandemrl.engines.base import init_default_process_group

    init_default_process_group()
    if args.local_spec:
        import tandemrl.engines.megatron.model as megatron_model

        megatron_model.have_transformer_engine = lambda: False
    with open(args.plan) as f:
        plan = json.load(f)
    for item in plan:
        name, check = item["name"], item["check"]
        t0 = time.perf_counter()
        try:
            result = run_check(check, args)
        except Exception as exc:  # one line for the driver; the traceback stays in the launch log
            traceback.print_exc()
            result = {"status": "FAIL", "reason": first_error_line(exc)}
        result.update(backend=dist.get_backend(), world=dist.get_world_size(), seconds=time.perf_counter() - t0)
        write(args.out, name, result)
        print(f"[gpu_check_worker] {name}: {result['status']} ({result['seconds']:.1f} s)", flush=True)
        if result["status"] == "FAIL" and dist.get_world_size() > 1:
            break  # other ranks may be waiting in a collective: end the launch rather than hang
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--plan", required=True, help='JSON file: [{"name": result name, "check": check}, ...]')
    p.add_argument("--model", required=True, help="the tiny HF model directory")
    p.add_argument("--out", required=True)
    p.add_argument("--local-spec", action="store_true", help="Megatron: the local spec even if TE is installed")
    a = p.parse_args()
    try:
        main(a)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
