"""SFT of a (tiny) Qwen3-MoE with megatron-core under a chosen TP / PP / EP layout; prints throughput and memory.

    torchrun --nproc_per_node=2 examples/moe_scaling/train_moe.py --ep 2 --steps 20
    torchrun --nproc_per_node=2 examples/moe_scaling/train_moe.py --pp 2 --data gsm8k --gsm8k ../shared/data/gsm8k
    torchrun --nproc_per_node=2 examples/moe_scaling/train_moe.py --tp 2 --model DENSE_HF_DIR  # MoE + TP needs TE

The model is built and loaded with tandemrl.engines.megatron (HF config -> TransformerConfig -> GPTModel,
HF safetensors -> this rank's shard), trained with Megatron DDP + get_megatron_optimizer and the pipeline
schedule, so every layout runs the same code. Data-parallel size is world / (tp * pp); EP splits the
experts over the data-parallel ranks. Rank 0 prints one JSON line of results at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from tandemrl.engines.teardown import destroy_process_groups


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--model", default=None, help="HF dir of a Qwen3-MoE (default: build the tiny one in the cache)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the throughput median")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step and DP rank")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--data", choices=("random", "gsm8k"), default="random")
    ap.add_argument("--gsm8k", default=None, help="dir with train.jsonl (for --data gsm8k and the tiny tokenizer)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def default_model(gsm8k: str | None) -> str:
    """The tiny Qwen3-MoE (4 experts, top-2) of the tests, built once on rank 0 and shared through the cache."""
    from tandemrl.models.make_tiny import ensure_tiny_model

    cache = os.path.join(os.environ.get("TANDEMRL_CACHE") or os.path.expanduser("~/.cache/tandemrl"), "tiny-models")
    path = [ensure_tiny_model(cache, "qwen3_moe", corpus_path=gsm8k) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return str(path[0])


def token_stream(args: argparse.Namespace, model_dir: str, vocab: int, n_tokens: int, dp_rank: int) -> torch.Tensor:
    """This DP rank's tokens: uniform random ids, or GSM8K question+answer texts tokenized back to back."""
    if args.data == "random":
        g = torch.Generator().manual_seed(args.seed * 1000 + dp_rank)
        return torch.randint(0, vocab, (n_tokens,), generator=g)
    from transformers import AutoTokenizer

    if not args.gsm8k:
        raise ValueError("--data gsm8k needs --gsm8k DIR (with train.jsonl)")
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = []
    with open(os.path.join(args.gsm8k, "train.jsonl"), encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i % 64 != dp_rank:  # disjoint rows per DP rank (up to 64 ranks)
                continue
            row = json.loads(line)
            ids += tok(row["question"] + "\n" + row["answer"])["input_ids"] + [tok.eos_token_id]
            if len(ids) >= n_tokens:
                break
    if len(ids) < n_tokens:
        ids = (ids * (n_tokens // max(len(ids), 1) + 1))[:n_tokens]
    return torch.tensor(ids[:n_tokens])


def main() -> None:
    args = parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)

    from tandemrl.engines.megatron.cpu_shims import apply_cpu_shims

    apply_cpu_shims()  # no-op on GPU
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from transformers import AutoConfig

    from tandemrl.engines.megatron.hf_convert import load_hf_weights
    from tandemrl.engines.megatron.model import build_gpt_model, transformer_config_from_hf

    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, expert_model_parallel_size=args.ep
    )
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    model_dir = args.model or default_model(args.gsm8k)
    hf_config = AutoConfig.from_pretrained(model_dir)
    dtype = getattr(torch, args.dtype)
    tf_config = transformer_config_from_hf(hf_config, tp=args.tp, pp=args.pp, ep=args.ep, params_dtype=dtype)
    tf_config.finalize_model_grads_func = finalize_model_grads
    model = build_gpt_model(hf_config, tf_config)
    load_hf_weights(model, model_dir, hf_config)
    n_params = sum(p.numel() for p in model.parameters())
    model = DistributedDataParallel(
        tf_config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        ),
        model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=True,
            clip_grad=1.0,
        ),
        [model],
    )

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mbs, s = args.micro_batch_size, args.seq_len
    per_step = args.micro_batches * mbs * (s + 1)
    stream = token_stream(args, model_dir, hf_config.vocab_size, per_step * args.steps, dp_rank)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    causal = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)[None, None]  # True = masked out
    positions = torch.arange(s, device=device)[None].expand(mbs, s)

    def forward_step(data_iter: Any, gpt: Any) -> tuple[torch.Tensor, Any]:
        chunk = next(data_iter).to(device)
        out = gpt(chunk[:, :-1], positions, causal, labels=chunk[:, 1:])  # per-token vocab-parallel CE [b, s]

        def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach().clone()}

        return out, loss_func

    forward_backward = get_forward_backward_func()
    losses, times = [], []
    for step in range(args.steps):
        batch = stream[step * per_step : (step + 1) * per_step].view(args.micro_batches, mbs, s + 1)
        dist.barrier()
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        opt.zero_grad()
        reduced = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(batch),
            model=[model],
            num_microbatches=args.micro_batches,
            seq_length=s,
            micro_batch_size=mbs,
            forward_only=False,
        )
        ok, grad_norm, _ = opt.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        local = statistics.fmean(float(r["lm loss"]) for r in reduced) if reduced else None
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        vals = [v for v in gathered if v is not None]
        losses.append(sum(vals) / len(vals))
        if dist.get_rank() == 0:
            print(
                f"step {step} loss {losses[-1]:.4f} grad_norm {float(grad_norm):.3f} time {times[-1]:.3f}s", flush=True
            )

    if torch.cuda.is_available():
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    stats: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(stats, (peak_mb, n_params))
    step_time = statistics.median(times[args.warmup :] or times)
    if dist.get_rank() == 0:
        result = {
            "tp": args.tp,
            "pp": args.pp,
            "ep": args.ep,
            "dp": dp_size,
            "world": dist.get_world_size(),
            "data": args.data,
            "tokens_per_step": per_step // (s + 1) * s * dp_size,
            "median_step_s": round(step_time, 4),
            "tokens_per_s": round(per_step // (s + 1) * s * dp_size / step_time, 1),
            "peak_mem_mb_max_rank": round(max(m for m, _ in stats), 1),
            "mem_kind": "cuda_max_allocated" if torch.cuda.is_available() else "cpu_maxrss",
            "params_per_rank": [n for _, n in stats],
            "loss_first": round(losses[0], 4),
            "loss_last": round(losses[-1], 4),
        }
        print("RESULT " + json.dumps(result), flush=True)
    ps.destroy_model_parallel()
    destroy_process_groups()


if __name__ == "__main__":
    main()
