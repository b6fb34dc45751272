"""Generated arithmetic word problems in GSM8K format: a task a tiny model can learn on a CPU.

Rows are ``{"question": ..., "answer": "<worked steps>\\n#### <number>"}``, so the GSM8K
builders, the GSM8K reward and the SFT/GRPO examples all work on them unchanged. The
generator is deterministic: the same seed and difficulty give byte-identical files, and
the test split is held out by its arithmetic, not only its wording: no train row works
the same operation on the same numbers as any test row.

A fraction of the train answers (``direct_fraction``, default one half) are bare
(``#### 165``, no worked steps), as in SFT data of mixed quality. A model fine-tuned on
them answers either way; a tiny model is right far more often when it works the steps, so
RL with a correctness reward has a strategy to discover (the learning check, docs/learning.md).
Test answers are always worked.

    python -m tandemrl.data.arith --out ./runs/data/arith --difficulty 1

writes ``train.jsonl`` and ``test.jsonl``; point ``train_dataset.path`` at that directory.
Scripts that import this module (it registers the name ``arith`` with ``register_dataset``)
also accept a missing path whose last component is ``arith``: it is generated there on
first use with the defaults (a bare ``arith`` goes to the tandemrl cache).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tandemrl.data.gsm8k import get_gsm8k_rl_dataset, get_gsm8k_sft_dataset
from tandemrl.data.loader import register_dataset

if TYPE_CHECKING:
    from datasets import Dataset

NAME = "arith"
DIFFICULTIES = (1, 2, 3)
DEFAULT_DIFFICULTY = 1  # what the learning check (docs/learning.md) uses
DEFAULT_N_TRAIN = 20000
DEFAULT_N_TEST = 500
DEFAULT_DIRECT_FRACTION = 0.5  # share of bare train answers; what the learning check (docs/learning.md) uses
_NAMES = ("Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gia", "Hugo", "Ivy", "Jack", "Kim", "Leo", "Mia", "Noah")
_ITEMS = ("apples", "books", "cards", "coins", "eggs", "marbles", "pens", "shells", "stamps", "toys")


# Answers show column arithmetic, one digit operation at a time ("5+8=13, 3+3+1=7"): a
# model with two layers learns single-digit facts and carries far faster than whole sums.
def add_steps(a: int, b: int) -> str:
    """``a + b`` (0 <= a, b <= 99) worked units then tens, e.g. ``5+8=13, 3+3+1=7, 35+38=73``."""
    units = a % 10 + b % 10
    carry = f"+{units // 10}" if units >= 10 else ""
    tens = a // 10 + b // 10 + units // 10
    return f"{a % 10}+{b % 10}={units}, {a // 10}+{b // 10}{carry}={tens}, {a}+{b}={a + b}"


def sub_steps(a: int, b: int) -> str:
    """``a - b`` (0 <= b <= a <= 99) worked units (borrowing) then tens, e.g. ``11-7=4, 9-4-1=4, 91-47=44``."""
    borrow = int(a % 10 < b % 10)
    units = a % 10 + 10 * borrow - b % 10
    tens = a // 10 - b // 10 - borrow
    minus = f"-{borrow}" if borrow else ""
    return f"{a % 10 + 10 * borrow}-{b % 10}={units}, {a // 10}-{b // 10}{minus}={tens}, {a}-{b}={a - b}"


def mul_steps(a: int, b: int) -> str:
    """``a * b`` (1 <= a <= 9, 0 <= b <= 99) worked units then tens, e.g. ``4*8=32, 4*9+3=39, 4*98=392``."""
    units = a * (b % 10)
    carry = f"+{units // 10}" if units >= 10 else ""
    tens = a * (b // 10) + units // 10
    return f"{a}*{b % 10}={units}, {a}*{b // 10}{carry}={tens}, {a}*{b}={a * b}"


Problem = tuple[str, str, int]  # question, worked steps, result


def _add(rng: random.Random, hi: int) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, hi), rng.randint(2, hi)
    q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
    return q, add_steps(a, b), a + b


def _sub(rng: random.Random, hi: int) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a = rng.randint(3, hi)
    b = rng.randint(2, a - 1)
    q = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
    return q, sub_steps(a, b), a - b


def _mul(rng: random.Random, hi: int) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 9), rng.randint(2, hi)
    q = f"{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?"
    return q, mul_steps(a, b), a * b


def _two_step(rng: random.Random, hi: int) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 9), rng.randint(2, min(hi, 11))
    total = a * b
    d = rng.randint(1, total - 1)
    q = (
        f"{name} buys {a} bags with {b} {item} in each bag and then gives away {d} {item}. "
        f"How many {item} does {name} have left?"
    )
    return q, f"{mul_steps(a, b)}\n{sub_steps(total, d)}", total - d


# Difficulty -> (problem makers, largest operand): each level adds an operation.
_LEVELS: dict[int, tuple[tuple[Callable[[random.Random, int], Problem], ...], int]] = {
    1: ((_add, _sub), 99),
    2: ((_add, _sub, _mul), 99),
    3: ((_add, _sub, _mul, _two_step), 99),
}


def make_problem(rng: random.Random, difficulty: int = DEFAULT_DIFFICULTY) -> dict[str, str]:
    """One {question, answer} row; the answer's steps end with ``#### <result>`` as in GSM8K."""
    if difficulty not in _LEVELS:
        raise ValueError(f"arith difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
    makers, hi = _LEVELS[difficulty]
    question, steps, result = rng.choice(makers)(rng, hi)
    return {"question": question, "answer": f"{steps}\n#### {result}"}


def bare(row: dict[str, str]) -> dict[str, str]:
    """The row with its worked steps dropped: the answer is only ``#### <result>``."""
    return {"question": row["question"], "answer": "#### " + row["answer"].rsplit("#### ", 1)[1]}


def generate_splits(
    n_train: int = DEFAULT_N_TRAIN,
    n_test: int = DEFAULT_N_TEST,
    seed: int = 0,
    difficulty: int = DEFAULT_DIFFICULTY,
    direct_fraction: float = DEFAULT_DIRECT_FRACTION,
) -> dict[str, list[dict[str, str]]]:
    """Train/test rows, test drawn first and its sums then banned; deterministic in every argument.

    Questions are unique across both splits; test sums are unique and never appear in train.
    Each train answer is bare with probability ``direct_fraction``.
    """
    for field, n in (("n_train", n_train), ("n_test", n_test)):
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"arith {field} must be a positive int, got {n!r}")
    if not 0.0 <= direct_fraction <= 1.0:
        raise ValueError(f"arith direct_fraction must be in [0, 1], got {direct_fraction!r}")
    rng = random.Random(f"tandemrl-arith-{seed}-{difficulty}")
    # A test row's answer (its operation on its numbers) is banned from train, so held-out accuracy
    # measures arithmetic the model never saw worked, not the same sum under another name.
    test_answers: set[str] = set()
    questions: set[str] = set()
    splits: dict[str, list[dict[str, str]]] = {"test": [], "train": []}
    budget = 50 * (n_train + n_test)  # the easiest level has ~14k distinct sums and ~10^6 questions
    for split, n in (("test", n_test), ("train", n_train)):
        rows = splits[split]
        while len(rows) < n:
            budget -= 1
            if budget < 0:
                raise ValueError(
                    f"arith difficulty {difficulty}: too few distinct problems for n_test={n_test} unique sums "
                    f"and n_train={n_train} unique questions; lower n_test or n_train"
                )
            row = make_problem(rng, difficulty)
            if row["question"] in questions or row["answer"] in test_answers:
                continue
            if split == "test":
                test_answers.add(row["answer"])
            elif rng.random() < direct_fraction:
                row = bare(row)
            questions.add(row["question"])
            rows.append(row)
    return splits


def write_arith_dataset(
    out_dir: str,
    n_train: int = DEFAULT_N_TRAIN,
    n_test: int = DEFAULT_N_TEST,
    seed: int = 0,
    difficulty: int = DEFAULT_DIFFICULTY,
    direct_fraction: float = DEFAULT_DIRECT_FRACTION,
) -> str:
    """Write ``train.jsonl`` and ``test.jsonl`` into ``out_dir`` (each file replaced atomically)."""
    splits = generate_splits(n_train, n_test, seed, difficulty, direct_fraction)
    out = os.path.expanduser(out_dir)
    os.makedirs(out, exist_ok=True)
    for split, rows in splits.items():
        fd, tmp = tempfile.mkstemp(prefix=f".{split}.", suffix=".jsonl", dir=out)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(tmp, os.path.join(out, f"{split}.jsonl"))
    return out


def default_arith_dir() -> str:
    """Where a bare ``arith`` dataset path is generated: ``${TANDEMRL_CACHE:-~/.cache/tandemrl}/datasets``."""
    root = os.environ.get("TANDEMRL_CACHE") or os.path.join("~", ".cache", "tandemrl")
    return os.path.join(
        os.path.expanduser(root),
        "datasets",
        f"arith-s0-d{DEFAULT_DIFFICULTY}-{DEFAULT_N_TRAIN}-{DEFAULT_N_TEST}-bare{DEFAULT_DIRECT_FRACTION}",
    )


def materialize(path: str) -> str:
    """An existing dataset directory for ``path``, generated with the defaults if it is a missing ``.../arith``."""
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        return local
    if os.path.basename(os.path.normpath(local)).lower() != NAME:
        raise FileNotFoundError(
            f"arith dataset directory not found: {path} (generate it: python -m tandemrl.data.arith --out {path})"
        )
    target = default_arith_dir() if os.path.normpath(local) == NAME else local
    if not all(os.path.isfile(os.path.join(target, f"{s}.jsonl")) for s in ("train", "test")):
        write_arith_dataset(target)
    return target


def get_arith_sft_dataset(path: str, split: str, tokenizer: Any, rank: int, world_size: int, **kw: Any) -> Dataset:
    """SFT samples of the arithmetic set (see ``get_gsm8k_sft_dataset``)."""
    return get_gsm8k_sft_dataset(materialize(path), split, tokenizer, rank, world_size, **kw)


def get_arith_rl_dataset(path: str, split: str, tokenizer: Any, rank: int, world_size: int, **kw: Any) -> Dataset:
    """RL prompts of the arithmetic set (see ``get_gsm8k_rl_dataset``)."""
    return get_gsm8k_rl_dataset(materialize(path), split, tokenizer, rank, world_size, **kw)


register_dataset(NAME, sft_fn=get_arith_sft_dataset, rl_fn=get_arith_rl_dataset)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write a generated arithmetic word-problem dataset (GSM8K format).")
    ap.add_argument("--out", required=True, help="Output directory (train.jsonl and test.jsonl are written).")
    ap.add_argument("--n-train", type=int, default=DEFAULT_N_TRAIN)
    ap.add_argument("--n-test", type=int, default=DEFAULT_N_TEST)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--difficulty", type=int, choices=DIFFICULTIES, default=DEFAULT_DIFFICULTY)
    ap.add_argument(
        "--direct-fraction",
        type=float,
        default=DEFAULT_DIRECT_FRACTION,
        help="Share of train answers given bare ('#### 165', no worked steps).",
    )
    a = ap.parse_args(argv)
    out = write_arith_dataset(a.out, a.n_train, a.n_test, a.seed, a.difficulty, a.direct_fraction)
    print(
        f"wrote {a.n_train} train and {a.n_test} test problems (difficulty {a.difficulty}, seed {a.seed}, "
        f"{a.direct_fraction:.0%} bare train answers) to {out}"
    )


if __name__ == "__main__":
    main()
