"""Where the trainer/server logprob gap of a model comes from: each precision on each side, measured.

A vLLM engine (in this process, the flags tandemrl's servers use: processed logprobs, eager on CPU) samples
``--prompts`` held-out arithmetic questions ``--samples`` times at ``--temperature``, in three server
precisions: bf16, bf16 with an fp32 output head (``hf_overrides: {head_dtype: float32}``), fp32. The
trainer's model (``tandemrl.engines.hf_model.build_hf_model``) scores every sampled token in three
precisions: fp32; bf16 parameters over fp32 buffers (what FSDP2's mixed precision computes); the same with
``head_dtype: float32``. Each of the 9 pairs prints the mean and largest |trainer - server| logprob and the
mean k3 estimate of KL(server || trainer): the ``offpolicy/kl_k3`` a training run logs.

    python bench/consistency_gap.py                      # SmolLM2-135M-Instruct, the main job's T=0.6
    python bench/consistency_gap.py --temperature 1.0

The generation time of each server precision is printed too (a second, timed pass over the same prompts):
a timing, so run it on a quiet machine. Results: docs/consistency.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from tandemrl.algorithms.offpolicy import mismatch_token_stats
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.engines.hf_model import build_hf_model
from tandemrl.models.functional import gather_logprobs
from tandemrl.models.resolve import resolve_model_path
from tandemrl.utils.cli import ArgumentParser
from tandemrl.utils.machine import measured_on

SERVERS = {"bf16": ("bfloat16", None), "bf16+fp32 head": ("bfloat16", "float32"), "fp32": ("float32", None)}
TRAINERS = {"fp32": (False, None), "bf16": (True, None), "bf16+fp32 head": (True, "float32")}
Rows = list[tuple[list[int], list[int], list[float]]]  # (prompt ids, sampled ids, server logprobs)


def prompts(tokenizer_path: str, questions: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    with questions.open() as f:
        qs = [json.loads(line)["question"] for _, line in zip(range(n), f, strict=False)]
    chats = [[{"role": "user", "content": q}] for q in qs]
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def sample(
    model: str, dtype: str, head: str | None, ids: list[list[int]], args: argparse.Namespace
) -> tuple[Rows, float]:
    """The server's samples with their logprobs, and the seconds of a second, timed pass over the same prompts."""
    from vllm import LLM, SamplingParams

    overrides = {"hf_overrides": {"head_dtype": head}} if head else {}
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, seed=0, logprobs_mode="processed_logprobs",
              max_model_len=1024, **overrides)  # fmt: skip
    params = SamplingParams(n=args.samples, temperature=args.temperature, max_tokens=args.new_tokens, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    rows = [
        (p, list(c.token_ids), [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)])
        for p, o in zip(ids, outs, strict=True)
        for c in o.outputs
    ]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    del llm
    return rows, seconds


def trainer(model: str, bf16: bool, head: str | None) -> torch.nn.Module:
    net, _ = build_hf_model(TrainEngineConfig(path=model, head_dtype=head), torch.device("cpu"))
    if bf16:  # FSDP2's MixedPrecisionPolicy(param_dtype=bf16) casts the parameters, not the buffers
        for p in net.parameters():
            p.data = p.data.to(torch.bfloat16)
    return net.eval()


@torch.no_grad()
def score(net: torch.nn.Module, rows: Rows, temperature: float) -> torch.Tensor:
    """The trainer's logprob of every sampled token, in ``rows`` order (one sequence per forward: no padding)."""
    out = []
    for p, toks, _ in rows:
        ids = torch.tensor([p + toks])
        logits = net(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + len(toks)]
        out.append(gather_logprobs(logits, torch.tensor(toks), temperature))
    return torch.cat(out)


def main() -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--questions", default="runs/data/arith/test.jsonl", help="JSONL with a 'question' field")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.6)
    args = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    questions = Path(args.questions)
    if not questions.is_file():
        sys.exit(f"--questions: {questions} not found (python -m tandemrl.data.arith --out runs/data/arith writes it)")
    model = resolve_model_path(args.model)
    ids = prompts(model, questions, args.prompts)
    sampled = {}
    for name, (dtype, head) in SERVERS.items():
        sampled[name], seconds = sample(model, dtype, head, ids, args)
        n = sum(len(r[1]) for r in sampled[name])
        print(f"server {name}: {n} tokens sampled; a second pass generated them in {seconds:.1f} s", flush=True)
    print(f"\n| server \\ trainer (T={args.temperature}) | " + " | ".join(TRAINERS) + " |")
    print("| --- |" + " --- |" * len(TRAINERS))
    table = {s: [] for s in SERVERS}
    for bf16, head in TRAINERS.values():
        net = trainer(model, bf16, head)
        for sname, rows in sampled.items():
            mine, theirs = score(net, rows, args.temperature), torch.tensor([x for r in rows for x in r[2]])
            gap = (mine - theirs).abs()
            k3 = mismatch_token_stats(mine, theirs, torch.ones_like(gap, dtype=torch.bool))["kl_k3"]
            table[sname].append(f"{gap.mean():.1e} / {gap.max():.2f} / **{k3.mean():.1e}**")
    for sname, cells in table.items():
        print(f"| {sname} | " + " | ".join(cells) + " |")
    print("\ncells: mean |gap| / largest |gap| / mean KL k3")


if __name__ == "__main__":
    with measured_on("consistency_gap"):
        main()
