"""The generated arithmetic dataset: deterministic, disjoint splits, correct worked answers, registered name."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from tandemrl.data import arith
from tandemrl.data.loader import get_custom_dataset, resolve_dataset_fn
from tandemrl.rewards.gsm8k import extract_reference_answer


def _digit_results(steps: str) -> tuple[int, int]:
    """(units result, tens result) of one worked line ``u-op=U, t-op=T, a op b=R``."""
    parts = steps.split(", ")
    return int(parts[0].rsplit("=", 1)[1]), int(parts[1].rsplit("=", 1)[1])


def test_worked_steps_are_right_for_every_operand_pair() -> None:
    for a in range(100):
        for b in range(100):
            units, tens = _digit_results(arith.add_steps(a, b))
            assert tens * 10 + units % 10 == a + b
            assert arith.add_steps(a, b).endswith(f"{a}+{b}={a + b}")
            if b <= a:
                units, tens = _digit_results(arith.sub_steps(a, b))
                assert 0 <= units <= 9 and tens * 10 + units == a - b
    for a in range(1, 10):
        for b in range(100):
            units, tens = _digit_results(arith.mul_steps(a, b))
            assert tens * 10 + units % 10 == a * b


@pytest.mark.parametrize("difficulty", arith.DIFFICULTIES)
def test_answers_end_with_the_value_of_their_last_equation(difficulty: int) -> None:
    rng = random.Random(difficulty)
    for _ in range(300):
        row = arith.make_problem(rng, difficulty)
        final = int(extract_reference_answer(row["answer"]))
        last = row["answer"].split("\n####")[0].splitlines()[-1].rsplit(", ", 1)[-1]
        m = re.fullmatch(r"(\d+)([+\-*])(\d+)=(\d+)", last)
        assert m is not None, last
        a, op, b, right = int(m[1]), m[2], int(m[3]), int(m[4])
        assert right == final == {"+": a + b, "-": a - b, "*": a * b}[op]


def test_splits_are_deterministic_disjoint_and_sized() -> None:
    a = arith.generate_splits(n_train=400, n_test=100, seed=3, difficulty=2)
    b = arith.generate_splits(n_train=400, n_test=100, seed=3, difficulty=2)
    c = arith.generate_splits(n_train=400, n_test=100, seed=4, difficulty=2)
    assert a == b and a != c
    assert len(a["train"]) == 400 and len(a["test"]) == 100
    questions = [r["question"] for split in a.values() for r in split]
    assert len(set(questions)) == len(questions)
    # Held out by arithmetic, bare train answers included: no train question asks for the same
    # operation on the same numbers as a test question.
    test_sums = {_sum_of(r["question"]) for r in a["test"]}
    assert len(test_sums) == 100 and not test_sums & {_sum_of(r["question"]) for r in a["train"]}


def _sum_of(question: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(operation words, numbers) of a question: the arithmetic it asks for, whatever the names."""
    ops = tuple(w for w in ("gets", "gives away", "bags") if w in question)
    return ops, tuple(int(n) for n in re.findall(r"\d+", question))


def _bare_count(rows: list[dict[str, str]]) -> int:
    return sum(r["answer"].startswith("#### ") for r in rows)


def test_a_fraction_of_train_answers_is_bare_and_test_answers_are_worked() -> None:
    splits = arith.generate_splits(n_train=2000, n_test=200, seed=0, difficulty=1, direct_fraction=0.5)
    assert 850 < _bare_count(splits["train"]) < 1150 and _bare_count(splits["test"]) == 0
    for row in splits["train"]:
        if row["answer"].startswith("#### "):
            # The bare answer is the worked one's final line: same result, GSM8K format.
            assert re.fullmatch(r"#### \d+", row["answer"]), row["answer"]
    worked = arith.generate_splits(n_train=300, n_test=50, seed=0, difficulty=1, direct_fraction=0.0)
    assert _bare_count(worked["train"]) == 0
    assert _bare_count(arith.generate_splits(n_train=300, n_test=50, direct_fraction=1.0)["train"]) == 300


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="difficulty"):
        arith.make_problem(random.Random(0), 7)
    with pytest.raises(ValueError, match="n_test"):
        arith.generate_splits(n_train=10, n_test=0)
    with pytest.raises(ValueError, match="direct_fraction"):
        arith.generate_splits(n_train=10, n_test=5, direct_fraction=1.5)


def test_registered_name_generates_missing_dir_and_loads(tmp_path: Path, tiny_model_dir: str) -> None:
    from tandemrl.models.hf import load_hf_tokenizer

    path = tmp_path / "data" / "arith"
    assert resolve_dataset_fn(str(path), "rl") is arith.get_arith_rl_dataset
    assert resolve_dataset_fn(str(path), "sft") is arith.get_arith_sft_dataset
    tok = load_hf_tokenizer(tiny_model_dir)
    # A missing .../arith directory is generated with the defaults on first use.
    ds = get_custom_dataset(str(path), "rl", "test", tok, rank=1, world_size=2, max_samples=10)
    assert (path / "train.jsonl").is_file() and len(ds) == 5
    assert ds[0]["messages"][0]["role"] == "user" and "####" in ds[0]["answer"]
    sft = get_custom_dataset(str(path), "sft", "test", tok, rank=0, world_size=1, max_samples=4)
    assert len(sft) == 4 and sum(sft[0]["loss_mask"]) > 0
    with pytest.raises(FileNotFoundError, match="arith dataset directory not found"):
        arith.materialize(str(tmp_path / "arith" / "nope"))


def test_cli_writes_both_splits(tmp_path: Path) -> None:
    arith.main(
        ["--out", str(tmp_path), "--n-train", "50", "--n-test", "10", "--difficulty", "1", "--direct-fraction", "0"]
    )
    train = [json.loads(line) for line in open(tmp_path / "train.jsonl")]
    assert len(train) == 50 and _bare_count(train) == 0
    assert sum(1 for _ in open(tmp_path / "test.jsonl")) == 10
