"""GRPO-style RL on GSM8K written against the ``tinker`` SDK only (no tandemrl import).

Run it against any Tinker API, e.g. a local ``tandemrl tinker-serve`` (docs/tinker.md):

    tandemrl tinker-serve --model tiny:qwen2 --key-file /tmp/tinker.key &
    TINKER_BASE_URL=http://127.0.0.1:PORT TINKER_API_KEY=$(cat /tmp/tinker.key) \
        python examples/tinker_rl_loop.py --base-model tiny:qwen2 --data ../shared/data/gsm8k

Each iteration: publish the current adapter to a sampler, draw ``--group`` answers per question,
reward 1 for a final number equal to the reference answer, centre the rewards within each group
(the advantage of every token of an answer is its reward minus its group's mean), and take one
``importance_sampling`` step with the sampler's logprobs. Groups whose answers all score the same
carry no signal and are left out. One JSON line per iteration goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import tinker
from tinker import types

NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def load_gsm8k(path: str, split: str, n: int) -> list[tuple[str, str]]:
    rows = []
    with open(os.path.join(path, f"{split}.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            rows.append((row["question"], row["answer"].split("####")[-1].strip().replace(",", "")))
            if len(rows) == n:
                break
    return rows


def reward(text: str, answer: str, number_bonus: float) -> float:
    """1 for the right final number; ``number_bonus`` for an answer that ends in some other number."""
    numbers = NUMBER.findall(text)
    if not numbers:
        return 0.0
    return 1.0 if numbers[-1].replace(",", "").rstrip(".") == answer else number_bonus


def prompt_tokens(tokenizer, question: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(f"Question: {question}\nAnswer:", add_special_tokens=False)["input_ids"]


def datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    """Input all but the last token; targets shifted by one; only the answer's targets carry the advantage."""
    full = prompt + tokens
    n_prompt = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "logprobs": [0.0] * n_prompt + list(logprobs),
            "advantages": [0.0] * n_prompt + [advantage] * len(tokens),
        },
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-model", required=True)
    p.add_argument("--data", required=True, help="directory with GSM8K train.jsonl")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--questions", type=int, default=4, help="questions per iteration")
    p.add_argument("--group", type=int, default=4, help="answers per question")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=4e-5)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--number-bonus", type=float, default=0.0, help="reward of a wrong but numeric final answer")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per question: seed + index)")
    args = p.parse_args()

    service = tinker.ServiceClient()
    trainer = service.create_lora_training_client(base_model=args.base_model, rank=args.rank).result()
    tokenizer = trainer.get_tokenizer()
    rows = load_gsm8k(args.data, "train", args.iterations * args.questions)
    for it in range(args.iterations):
        start = time.monotonic()
        sampler = trainer.save_weights_and_get_sampling_client().result()
        batch = rows[it * args.questions : (it + 1) * args.questions]
        prompts = [prompt_tokens(tokenizer, q) for q, _ in batch]
        futures = []
        for i, pr in enumerate(prompts):
            seed = args.seed + it * args.questions + i
            params = types.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=seed)
            futures.append(sampler.sample(types.ModelInput.from_ints(pr), args.group, params))
        data, rewards = [], []
        for pr, (_, answer), fut in zip(prompts, batch, futures, strict=True):
            seqs = fut.result().sequences
            group = [reward(tokenizer.decode(s.tokens), answer, args.number_bonus) for s in seqs]
            rewards += group
            mean = sum(group) / len(group)
            if all(r == group[0] for r in group):
                continue  # no signal in this group
            data += [
                datum(pr, list(s.tokens), list(s.logprobs or []), r - mean) for s, r in zip(seqs, group, strict=True)
            ]
        loss = None
        if data:
            fb = trainer.forward_backward(data, "importance_sampling")
            step = trainer.optim_step(types.AdamParams(learning_rate=args.lr))
            loss = fb.result().metrics.get("loss:sum")
            step.result()
        line = {
            "iteration": it,
            "reward_mean": sum(rewards) / len(rewards),
            "samples": len(rewards),
            "trained_datums": len(data),
            "loss": loss,
            "seconds": round(time.monotonic() - start, 2),
        }
        print(json.dumps(line), flush=True)
    service.close("success").result()  # the session ends on the server; the client stops its heartbeat


if __name__ == "__main__":
    main()
