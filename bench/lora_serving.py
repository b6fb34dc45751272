"""Generation speed of a CPU vLLM server serving a LoRA adapter vs the same weights merged.

One server is started with ``--enable-lora`` (what a LoRA run by disk updates starts) and asked
for the same completions twice per round: once naming the adapter as the request's ``model``
(vLLM's LoRA kernels run on every token), once naming the base model (the LoRA-enabled server,
no adapter). A second server without ``--enable-lora`` then serves the adapter merged into the
base weights (``W + (alpha/r) B A``, what tandemrl pushes when it serves merged weights). Each
request generates exactly ``--tokens`` tokens (``ignore_eos``), so tokens/s compares equal work.
Figures are printed with the machine line and load, never asserted.

    python bench/lora_serving.py                      # SmolLM2-135M, rank 8, 32 x 64 tokens
    python bench/lora_serving.py --rank 32 --rounds 3
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests
import torch

from tandemrl.configs.engine import LoRAConfig
from tandemrl.inference.server import launch_server
from tandemrl.inference.vllm import VLLMBackend, lora_server_flags
from tandemrl.models.resolve import resolve_model_path
from tandemrl.utils.cli import ArgumentParser

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(model_dir: str, out: str, rank: int) -> None:
    """A PEFT adapter with nonzero A and B on every target linear (a trained adapter's shape and cost)."""
    from transformers import AutoModelForCausalLM

    from tandemrl.engines.lora import write_adapter

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, mod.in_features, generator=gen) * 0.01
            tensors[f"base_model.model.{name}.lora_B.weight"] = (
                torch.randn(mod.out_features, rank, generator=gen) * 0.01
            )
    write_adapter(out, tensors, LoRAConfig(rank=rank, alpha=2.0 * rank, target_modules=list(TARGETS)), model_dir)


def run_batch(addr: str, model: str, prompts: list[str], tokens: int) -> float:
    """Generated tokens per second for ``prompts`` sent concurrently, each generating exactly ``tokens``."""

    def one(prompt: str) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 1.0, "ignore_eos": True}
        r = requests.post(f"http://{addr}/v1/completions", json=body, timeout=1800)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        total = sum(pool.map(one, prompts))
    return total / (time.perf_counter() - start)


def served_name(addr: str) -> str:
    return requests.get(f"http://{addr}/v1/models", timeout=30).json()["data"][0]["id"]


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="adapter/base pairs on the LoRA server (after a warm-up)")
    args = ap.parse_args()
    model_dir = resolve_model_path(args.model, "--model")
    out = tempfile.mkdtemp(prefix="lora-serving-")
    adapter, merged = os.path.join(out, "adapter"), os.path.join(out, "merged")
    write_random_adapter(model_dir, adapter, args.rank)
    from tandemrl.engines.lora import merge_adapter_dir

    merge_adapter_dir(model_dir, adapter, merged)
    prompts = [f"Question {i}: what is {i} plus {2 * i + 7}? Answer:" for i in range(args.prompts)]
    print(f"machine: {platform.machine()} {os.cpu_count()} cores; load before {os.getloadavg()[0]:.2f}")
    figures: dict[str, list[float]] = {
        "adapter (LoRA server)": [],
        "base (LoRA server)": [],
        "merged (plain server)": [],
    }
    srv = launch_server(VLLMBackend(), model_dir, extra=lora_server_flags(args.rank), log_file=f"{out}/lora.log")
    try:
        srv.wait_healthy(900.0)
        requests.post(
            f"http://{srv.address}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapter}, timeout=300
        ).raise_for_status()
        base = served_name(srv.address)
        run_batch(srv.address, "a", prompts[:4], 8)  # warm-up
        for _ in range(args.rounds):
            figures["adapter (LoRA server)"].append(run_batch(srv.address, "a", prompts, args.tokens))
            figures["base (LoRA server)"].append(run_batch(srv.address, base, prompts, args.tokens))
    finally:
        srv.stop()
    srv = launch_server(VLLMBackend(), merged, log_file=f"{out}/merged.log")
    try:
        srv.wait_healthy(900.0)
        name = served_name(srv.address)
        run_batch(srv.address, name, prompts[:4], 8)
        for _ in range(args.rounds):
            figures["merged (plain server)"].append(run_batch(srv.address, name, prompts, args.tokens))
    finally:
        srv.stop()
    ref = statistics.median(figures["merged (plain server)"])
    print(f"{args.prompts} requests x {args.tokens} tokens, rank {args.rank}, model {args.model}")
    for name, vals in figures.items():
        med = statistics.median(vals)
        print(
            f"  {name:24s} {med:8.1f} tokens/s (runs: {', '.join(f'{v:.1f}' for v in vals)}); {med / ref:.3f}x merged"
        )
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
