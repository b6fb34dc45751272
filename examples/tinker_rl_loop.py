"""GRPO-style RL on GSM8K written against the ``tinker`` SDK only (no tandemrl import).

Run it against any Tinker API, e.g. a local ``tandemrl tinker-serve`` (docs/tinker.md):

    tandemrl tinker-serve --model tiny:qwen2 --key-file /tmp/tinker.key &
    TINKER_BASE_URL=http://127.0.0.1:PORT TINKER_API_KEY=$(cat /tmp/tinker.key) \
        python examples/tinker_rl_loop.py --base-model tiny:qwen2 --data ../shared/data/gsm8k

Each iteration: publish the current adapter to a sampler, draw ``--group`` answers per question,
reward 1 for a final number equal to the reference answer, centre the rewards within each group
(the advantage of every token of an answer is its reward minus its group's mean), and take one
``importance_sampling`` step with the sampler's logprobs. Groups whose answers all score the same
carry no signal and are left out; with ``--fill N`` the iteration draws ``--questions`` new questions
at a time (at most ``--max-rounds`` times) until N groups carry signal, and trains on those N (DAPO's
dynamic sampling, what made the main job learn: docs/learning.md). One JSON line per iteration goes
to stdout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
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


class _NoTryAgain(logging.Filter):
    """Drop the SDK's warning each time a result is not ready yet: a long sampling queue (e.g. ``--eval``'s
    questions, sent at once) has each future polled several times."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "because of try_again" not in record.getMessage()


def main() -> None:
    logging.getLogger("tinker.lib.api_future_impl").addFilter(_NoTryAgain())
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
    p.add_argument("--fill", type=int, default=0, help="groups with signal to train on per iteration (0: any)")
    p.add_argument("--max-rounds", type=int, default=8, help="with --fill: most extra draws of --questions")
    p.add_argument("--eval", type=int, default=0, help="greedy accuracy on the first N test questions, before/after")
    p.add_argument(
        "--ratio-base",
        choices=["sampler", "trainer"],
        default="sampler",
        help="the logprobs importance_sampling divides by: the sampler's (at --temperature), or the training "
        "client's own forward (temperature 1: the ratio is then 1 and the step is REINFORCE on the samples)",
    )
    args = p.parse_args()
    if args.fill < 0 or args.max_rounds < 0 or args.eval < 0:
        p.error("--fill, --max-rounds and --eval must be >= 0")

    service = tinker.ServiceClient()
    trainer = service.create_lora_training_client(base_model=args.base_model, rank=args.rank).result()
    tokenizer = trainer.get_tokenizer()
    rounds = 1 + (args.max_rounds if args.fill else 0)
    rows = iter(load_gsm8k(args.data, "train", args.iterations * args.questions * rounds))
    drawn = 0  # questions drawn so far: the sampling seed of each is args.seed + its index
    held_out = load_gsm8k(args.data, "test", args.eval)
    before = evaluate(trainer, tokenizer, held_out, args) if held_out else []
    for it in range(args.iterations):
        start = time.monotonic()
        sampler = trainer.save_weights_and_get_sampling_client().result()
        groups, rewards, questions = [], [], 0
        for _ in range(rounds):
            batch = list(itertools.islice(rows, args.questions))
            found, scored = sample_groups(sampler, tokenizer, batch, drawn, args)
            drawn, questions = drawn + len(batch), questions + len(batch)
            groups, rewards = groups + found, rewards + scored
            if len(batch) < args.questions or len(groups) >= args.fill:
                break
        if args.fill:
            groups = groups[: args.fill] if len(groups) >= args.fill else []  # a full batch or no step
        data = [d for group in groups for d in group]
        loss = None
        if data and args.ratio_base == "trainer":
            data = rebase(trainer, data)
        if data:
            fb = trainer.forward_backward(data, "importance_sampling")
            step = trainer.optim_step(types.AdamParams(learning_rate=args.lr))
            loss = fb.result().metrics.get("loss:sum")
            step.result()
        line = {
            "iteration": it,
            "reward_mean": sum(rewards) / max(len(rewards), 1),
            "questions": questions,
            "samples": len(rewards),
            "trained_datums": len(data),
            "loss": loss,
            "seconds": round(time.monotonic() - start, 2),
        }
        print(json.dumps(line), flush=True)
    if held_out:
        after = evaluate(trainer, tokenizer, held_out, args)
        gained = sum(a and not b for a, b in zip(after, before, strict=True))
        lost = sum(b and not a for a, b in zip(after, before, strict=True))
        print(json.dumps({"eval_n": len(held_out), "accuracy_before": sum(before) / len(before),
                          "accuracy_after": sum(after) / len(after), "gained": gained, "lost": lost,
                          "mcnemar_p": mcnemar_p(gained, lost)}), flush=True)  # fmt: skip
    service.close("success").result()  # the session ends on the server; the client stops its heartbeat


def rebase(trainer, data: list[types.Datum]) -> list[types.Datum]:
    """``data`` with each datum's ``logprobs`` replaced by the training client's own (one ``forward``): the
    Tinker API trains at temperature 1, so sampler logprobs from another temperature are another policy's."""
    outputs = trainer.forward(data, "cross_entropy").result().loss_fn_outputs
    rebased = []
    for d, out in zip(data, outputs, strict=True):
        own = out["logprobs"].tolist()
        inputs = {k: v.tolist() for k, v in d.loss_fn_inputs.items()}
        answer = [a != 0.0 for a in inputs["advantages"]]  # the answer's tokens: the prompt's keep their 0.0
        inputs["logprobs"] = [lp if keep else 0.0 for lp, keep in zip(own, answer, strict=True)]
        rebased.append(types.Datum(model_input=d.model_input, loss_fn_inputs=inputs))
    return rebased


def evaluate(trainer, tokenizer, rows: list[tuple[str, str]], args) -> list[bool]:
    """Whether each question's greedy answer from the current weights is right."""
    sampler = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    futures = [sampler.sample(types.ModelInput.from_ints(prompt_tokens(tokenizer, q)), 1, params) for q, _ in rows]
    return [
        reward(tokenizer.decode(f.result().sequences[0].tokens), a, 0.0) == 1.0
        for f, (_, a) in zip(futures, rows, strict=True)
    ]


def mcnemar_p(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p-value of ``gained`` against ``lost`` discordant questions."""
    n, k = gained + lost, min(gained, lost)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0


def sample_groups(sampler, tokenizer, batch: list[tuple[str, str]], first: int, args) -> tuple[list, list[float]]:
    """Sample ``args.group`` answers to each question (seeds ``args.seed + first + i``); returns the datums
    of each group whose rewards differ (advantage: reward minus the group's mean) and every reward."""
    prompts = [prompt_tokens(tokenizer, q) for q, _ in batch]
    futures = []
    for i, pr in enumerate(prompts):
        params = types.SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed + first + i
        )
        futures.append(sampler.sample(types.ModelInput.from_ints(pr), args.group, params))
    groups, rewards = [], []
    for pr, (_, answer), fut in zip(prompts, batch, futures, strict=True):
        seqs = fut.result().sequences
        scores = [reward(tokenizer.decode(s.tokens), answer, args.number_bonus) for s in seqs]
        rewards += scores
        if all(r == scores[0] for r in scores):
            continue  # no signal in this group
        mean = sum(scores) / len(scores)
        groups.append(
            [datum(pr, list(s.tokens), list(s.logprobs or []), r - mean) for s, r in zip(seqs, scores, strict=True)]
        )
    return groups, rewards


if __name__ == "__main__":
    main()
