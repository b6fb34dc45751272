"""The Tinker API's overhead: one GRPO step through ``tandemrl tinker-serve`` vs the same step in-process.

Both paths share one LoRA-enabled vLLM server and do the same work per step: publish the
current adapter to vLLM, sample ``--group`` answers for each of ``--prompts`` fixed prompts
(seeded), build importance-sampling datums with group-centred rewards, one forward/backward and
one Adam step on a rank-``--rank`` adapter. The API path goes through the unmodified ``tinker``
SDK over HTTP to a ``tinker-serve`` subprocess; the native path calls the same trainer
(``tandemrl.tinker.trainer.EngineTrainer``) and vLLM client (``tandemrl.tinker.sampler``) in this
process. The steps alternate (API, native, API, ...) so machine load hits both alike; the
median step time of each and their ratio are printed, never asserted. The reward is a fixed
function of the tokens (even token ids count), so both paths see signal on any model.

    python bench/tinker_overhead.py --model tiny:qwen2 --steps 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandemrl.api.net import free_port
from tandemrl.inference.server import launch_server
from tandemrl.inference.server_auth import TOKEN_ENV, new_token
from tandemrl.inference.vllm import VLLMBackend, lora_server_flags
from tandemrl.models.resolve import resolve_model_path
from tandemrl.tinker.sampler import VLLMSampler
from tandemrl.tinker.trainer import EngineTrainer, targets_of
from tandemrl.utils.cli import ArgumentParser

REPO = Path(__file__).resolve().parents[1]


def reward(tokens: list[int]) -> float:
    return sum(t % 2 == 0 for t in tokens) / max(1, len(tokens))


def centred(group: list[float]) -> list[float]:
    mean = sum(group) / len(group)
    return [r - mean for r in group]


def rows(prompt: list[int], tokens: list[int], logprobs: list[float], adv: float) -> dict[str, torch.Tensor]:
    full, n = prompt + tokens, len(prompt) - 1
    return {
        "input_ids": torch.tensor(full[:-1]),
        "target_tokens": torch.tensor(full[1:]),
        "advantages": torch.tensor([0.0] * n + [adv] * len(tokens)),
        "logprobs": torch.tensor([0.0] * n + logprobs),
    }


def api_step(trainer, prompts: list[list[int]], args: argparse.Namespace, step: int) -> None:  # noqa: ANN001
    from tinker import types

    sampler = trainer.save_weights_and_get_sampling_client().result()
    futs = []
    for i, p in enumerate(prompts):
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=step * 100 + i)
        futs.append(sampler.sample(types.ModelInput.from_ints(p), args.group, params))
    data = []
    for p, fut in zip(prompts, futs, strict=True):
        seqs = fut.result().sequences
        for s, a in zip(seqs, centred([reward(list(s.tokens)) for s in seqs]), strict=True):
            d = rows(p, list(s.tokens), list(s.logprobs or []), a)
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(d["input_ids"].tolist()),
                loss_fn_inputs={k: d[k].tolist() for k in ("target_tokens", "advantages", "logprobs")},
            ))  # fmt: skip
    fb = trainer.forward_backward(data, "importance_sampling")
    opt = trainer.optim_step(types.AdamParams(learning_rate=1e-4))
    fb.result()
    opt.result()


async def native_step(
    trainer: EngineTrainer,
    sampler: VLLMSampler,
    out: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    step: int,
) -> None:
    name = f"native-{step}"
    path = os.path.join(out, name)
    trainer.save_for_sampler("native", path)
    await sampler.load_adapter(name, path)
    params = {"max_tokens": args.max_tokens, "temperature": 1.0}
    async with sampler.adapter(name) as served:
        groups = await asyncio.gather(
            *(sampler.sample(p, args.group, {**params, "seed": step * 100 + i}, served) for i, p in enumerate(prompts))
        )
    data = []
    for p, seqs in zip(prompts, groups, strict=True):
        for (tokens, lps, _), a in zip(seqs, centred([reward(s[0]) for s in seqs]), strict=True):
            data.append(rows(p, tokens, lps, a))
    trainer.forward_backward("native", data, "importance_sampling", {}, True)
    trainer.optim_step("native", {"learning_rate": 1e-4})


def start_tinker_serve(model_dir: str, vllm_addr: str, out: str) -> tuple[subprocess.Popen[bytes], str, str]:
    port, key_file = free_port("127.0.0.1"), os.path.join(out, "key")
    cmd = [sys.executable, "-m", "tandemrl.cli", "tinker-serve", "--model", model_dir, "--port", str(port)]
    cmd += ["--vllm-addr", vllm_addr, "--key-file", key_file, "--out", os.path.join(out, "api")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    while not os.path.exists(key_file) or not open(key_file).read():
        if proc.poll() is not None:
            raise RuntimeError("tinker-serve exited before it was ready")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}", open(key_file).read()


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:qwen2")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per path (after one warm-up each)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()
    import tinker

    model_dir = resolve_model_path(args.model, "--model")
    out = tempfile.mkdtemp(prefix="tinker-bench-")
    os.environ.setdefault(TOKEN_ENV, new_token())
    os.environ["TINKER_TELEMETRY"] = "0"
    vllm = launch_server(VLLMBackend(), model_dir, extra={**lora_server_flags(args.rank), "max_loras": 2},
                         log_file=os.path.join(out, "vllm.log"), token=os.environ[TOKEN_ENV])  # fmt: skip
    serve = None
    try:
        vllm.wait_healthy(900.0)
        serve, url, key = start_tinker_serve(model_dir, vllm.address, out)
        api = tinker.ServiceClient(base_url=url, api_key=key)
        api_trainer = api.create_lora_training_client(base_model=model_dir, rank=args.rank, seed=0).result()
        native = EngineTrainer(model_dir, args.rank)
        native.add("native", args.rank, targets_of(True, True), 0)
        sampler = VLLMSampler(vllm.address)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, 200, (args.prompts, 16), generator=g).tolist()
        times: dict[str, list[float]] = {"api": [], "native": []}
        for step in range(args.steps + 1):
            t0 = time.perf_counter()
            api_step(api_trainer, prompts, args, step)
            t1 = time.perf_counter()
            asyncio.run(native_step(native, sampler, out, prompts, args, step))
            t2 = time.perf_counter()
            if step > 0:  # the first step of each warms up
                times["api"].append(t1 - t0)
                times["native"].append(t2 - t1)
        api_s, native_s = statistics.median(times["api"]), statistics.median(times["native"])
        print(f"model {args.model}: {args.prompts} prompts x {args.group} samples x {args.max_tokens} tokens, "
              f"LoRA rank {args.rank}, median of {args.steps} steps")  # fmt: skip
        print(f"  through the Tinker API: {api_s:.3f} s/step   native: {native_s:.3f} s/step   "
              f"ratio {api_s / native_s:.2f}x   load average {os.getloadavg()[0]:.1f}")  # fmt: skip
        sampler.close()
        api.close("success").result()
    finally:
        if serve is not None:
            serve.terminate()
            serve.wait(60)
        vllm.stop()


if __name__ == "__main__":
    main()
