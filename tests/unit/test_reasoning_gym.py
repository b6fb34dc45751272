"""reasoning-gym tasks as rows and reward (tandemrl/data/reasoning_gym.py, tandemrl/rewards/reasoning_gym.py), with the
real reasoning-gym package: the written splits are deterministic and cannot overlap, task names and configs are
checked in one line, the loader keeps the system prompt and the entry, and the reward is the task's own verifier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandemrl.configs.data import DatasetConfig, ReasoningGymConfig
from tandemrl.data import reasoning_gym as rg_data
from tandemrl.data.gsm8k import get_gsm8k_rl_dataset
from tandemrl.rewards.reasoning_gym import reasoning_gym_reward_fn, score_entry
from tandemrl.workflows.gsm8k_eval import score_completion, summarize

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
MIX = [{"name": "chain_sum", "weight": 3, "config": SMALL}, "leg_counting"]


def _config(path: Path, tasks: list | None = None, **kw) -> DatasetConfig:
    rg = ReasoningGymConfig(tasks=MIX if tasks is None else tasks, size=kw.pop("size", 300), test_size=60, **kw)
    return DatasetConfig(path=str(path), type="rl", reasoning_gym=rg)


def _rows(path: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (path / f"{split}.jsonl").read_text().splitlines()]


def test_written_splits_are_deterministic_disjoint_and_mixed_by_weight(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert rg_data.ensure_written(_config(a), "train_dataset")
    assert not rg_data.ensure_written(_config(a), "train_dataset")  # the same spec: kept, not rewritten
    rg_data.ensure_written(_config(b), "train_dataset")
    rg_data.ensure_written(_config(c, seed=1), "train_dataset")
    for split in ("train", "test"):
        assert (a / f"{split}.jsonl").read_bytes() == (b / f"{split}.jsonl").read_bytes()
        assert (a / f"{split}.jsonl").read_bytes() != (c / f"{split}.jsonl").read_bytes()
    train, test = _rows(a, "train"), _rows(a, "test")
    assert len(train) == 300 and len(test) == 60
    test_questions = {r["question"] for r in test}
    assert len(test_questions) == 60 and not test_questions & {r["question"] for r in train}
    tasks = [json.loads(r["reasoning_gym"])["metadata"]["source_dataset"] for r in train]
    assert set(tasks) == {"chain_sum", "leg_counting"} and tasks.count("chain_sum") > 2 * tasks.count("leg_counting")
    # chain_sum's config reached the generator: two terms of at most two digits
    sums = [json.loads(r["reasoning_gym"])["metadata"] for r in train if "chain_sum" in r["reasoning_gym"]]
    assert {m["num_terms"] for m in sums} == {2} and max(m["num_digits"] for m in sums) <= 2
    assert all(r["system"] == rg_data.system_prompt("default") and "<answer>" in r["system"] for r in train)


def test_a_mix_too_small_to_hold_out_its_test_split_is_refused(tmp_path: Path) -> None:
    one_digit_sums = [{"name": "chain_sum", "config": {**SMALL, "max_digits": 1}}]  # 10 x 10 questions in all
    with pytest.raises(ValueError, match="only .* test draws have a question that is not in the 300 training rows"):
        rg_data.ensure_written(_config(tmp_path / "d", one_digit_sums), "train_dataset")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    ("tasks", "message"),
    [
        (["chain_summ"], r"train_dataset.reasoning_gym.tasks\[0\].name: 'chain_summ' is not a reasoning-gym task"),
        ([{"name": "chain_sum", "wieght": 2}], r"tasks\[0\]: unknown key\(s\) \['wieght'\]"),
        ([{"name": "chain_sum", "weight": 0}], r"tasks\[0\].weight: 0 must be a positive number"),
        ([{"name": "chain_sum", "config": {"min_terms": 0}}], r"tasks\[0\].config: reasoning-gym refused it"),
        ([{"name": "chain_sum", "config": {"size": 5}}], r"tasks\[0\].config: seed and size are set by"),
        (["chain_sum", "chain_sum"], r"tasks\[1\].name: 'chain_sum' is listed twice"),
    ],
)
def test_bad_tasks_are_one_line_naming_the_entry(tmp_path: Path, tasks: list, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        rg_data.ensure_written(_config(tmp_path / "d", tasks), "train_dataset")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "d").exists()


def test_a_path_of_another_spec_or_other_files_or_a_hub_id_is_refused(tmp_path: Path, monkeypatch) -> None:
    rg_data.ensure_written(_config(tmp_path / "d"), "train_dataset")
    with pytest.raises(ValueError, match=r"holds reasoning-gym rows of another spec \(differs in size\)"):
        rg_data.ensure_written(_config(tmp_path / "d", size=200), "train_dataset")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "train.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="holds files not written by reasoning-gym"):
        rg_data.ensure_written(_config(tmp_path / "e"), "train_dataset")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="'openai/gsm8k' is read as a hub id"):
        rg_data.ensure_written(_config(Path("openai/gsm8k")), "train_dataset")


def test_the_reward_is_the_tasks_verifier_on_the_last_answer_tag(tmp_path: Path) -> None:
    rg_data.ensure_written(_config(tmp_path, [{"name": "chain_sum", "config": SMALL}]), "train_dataset")
    row = _rows(tmp_path, "test")[0]
    gold = row["answer"]
    assert gold == str(eval(json.loads(row["reasoning_gym"])["metadata"]["expression"]))  # noqa: S307 (digits, +, -)
    entry = row["reasoning_gym"]
    assert score_entry(f"so <answer>1</answer> no, <answer> {gold} </answer>", entry) == (1.0, gold)
    assert score_entry(f"the answer is {gold}", entry) == (0.0, None)  # no tag: reasoning-gym's format is required
    # chain_sum's own rule: a number equal as a decimal is right; text containing the answer earns its share
    assert score_entry(f"<answer>{gold}.00</answer>", entry)[0] == 1.0
    assert score_entry(f"<answer>x{gold}</answer>", entry)[0] == pytest.approx(len(gold) / (len(gold) + 1))
    assert reasoning_gym_reward_fn(None, f"<answer>{gold}</answer>", None, None, reasoning_gym=entry, id=0) == 1.0
    # answer_format last_number (rows written with answer: last_number): the tag first, else the last number
    assert score_entry(f"9 + 1 = {gold}.", entry, "last_number") == (1.0, gold)
    assert score_entry(f"<answer>{gold}</answer> and 12345", entry, "last_number") == (1.0, gold)
    assert score_entry(f"{gold} is not it, 9999", entry, "last_number") == (0.0, "9999")
    assert (
        reasoning_gym_reward_fn(None, f"= {gold}", None, None, reasoning_gym=entry, answer_format="last_number") == 1.0
    )
    with pytest.raises(ValueError, match="answer_format: 'number' is not one of tag, last_number"):
        score_entry(gold, entry, "number")
    # the held-out scoring: correct only at full score, the gold answer the row's
    right = score_completion(7, f"<answer>{gold}</answer>", gold, entry)
    part = score_completion(8, f"<answer>x{gold}</answer>", gold, entry)
    assert (right.correct, right.extracted, right.gold, part.correct) == (True, gold, gold, False)
    assert right.task == part.task == "chain_sum"


def test_held_out_results_count_each_task_of_a_mix(tmp_path: Path) -> None:
    rg_data.ensure_written(_config(tmp_path), "train_dataset")
    rows = _rows(tmp_path, "test")[:12]
    # right on every chain_sum row but the first, wrong on every leg_counting row
    sums = [i for i, r in enumerate(rows) if '"chain_sum"' in r["reasoning_gym"]]
    legs = [i for i, r in enumerate(rows) if '"leg_counting"' in r["reasoning_gym"]]
    assert sums and legs
    scored = [
        score_completion(
            i, f"<answer>{r['answer']}</answer>" if i in sums[1:] else "no", r["answer"], r["reasoning_gym"]
        )
        for i, r in enumerate(rows)
    ]
    result = summarize(scored, 8, True, 0.0)
    assert result.by_task() == {"chain_sum": (len(sums) - 1, len(sums)), "leg_counting": (0, len(legs))}
    first = "chain_sum" if sums[0] == 0 else "leg_counting"
    assert list(result.by_task())[0] == first  # in order of first appearance
    assert result.tasks_line().startswith(f"{first} ")
    assert result.to_dict()["by_task"]["chain_sum"] == {"correct": len(sums) - 1, "n": len(sums)}
    gsm8k = summarize([score_completion(0, "#### 3", "#### 3")], 8, True, 0.0)
    assert gsm8k.by_task() == {} and gsm8k.tasks_line() == ""


def test_the_rl_loader_keeps_the_system_prompt_and_the_entry(tmp_path: Path, tiny_model_dir: str) -> None:
    from transformers import AutoTokenizer

    rg_data.ensure_written(_config(tmp_path), "train_dataset")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ds = get_gsm8k_rl_dataset(str(tmp_path), "test", tokenizer, rank=0, world_size=1, max_samples=5)
    rows, written = ds.to_list(), _rows(tmp_path, "test")[:5]
    assert [r["id"] for r in rows] == list(range(5))
    for row, raw in zip(rows, written, strict=True):
        assert row["messages"] == [
            {"role": "system", "content": raw["system"]},
            {"role": "user", "content": raw["question"]},
        ]
        assert (row["reasoning_gym"], row["answer"]) == (raw["reasoning_gym"], raw["answer"])
        assert row["answer_format"] == raw["answer_format"] == "tag"
