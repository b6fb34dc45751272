"""reasoning-gym's procedural tasks as question/answer rows, written once to a directory the GSM8K builders read.

A dataset config with ``reasoning_gym.tasks`` set (``tandemrl.configs.data.ReasoningGymConfig``) names a weighted
mix of reasoning-gym tasks; ``ensure_written`` generates it into the dataset's ``path`` the first time (the
launcher's input check does this before any process starts, so a wrong task name or task config is one line then):

- ``train.jsonl``: ``size`` rows from reasoning-gym's composite dataset at ``seed``;
- ``test.jsonl``: ``test_size`` rows from the same mix at ``seed + TEST_SEED_OFFSET``, skipping every question that is in the
  training rows (or earlier in the test rows), so the held-out split cannot overlap the training split;
- ``reasoning_gym.json``: the spec and the reasoning-gym version. A directory written from another spec is refused,
  never overwritten.

Each row is ``{"question", "answer", "system", "reasoning_gym", "answer_format"}``: the task's question and oracle
answer, the system prompt (by default reasoning-gym's answer-format instruction, ``<answer>...</answer>``), the entry
as reasoning-gym made it (JSON text: question, answer, metadata with the task's name in ``source_dataset``), which
``tandemrl.rewards.reasoning_gym`` hands to the task's own ``score_answer``, and where the reward finds the
completion's answer (``ReasoningGymConfig.answer``). Every test row's oracle answer is
checked to score 1 after that round trip, so a task whose verifier needs more than its entry is refused by name.

    python -m tandemrl.data.reasoning_gym --out DIR --task basic_arithmetic --task chain_sum:2 [--size N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandemrl.configs.data import DatasetConfig, ReasoningGymConfig

SPEC_FILE = "reasoning_gym.json"
TASK_KEYS = ("name", "weight", "config")
# reasoning-gym's item i at seed s is drawn from Random(s + i) (a task's from its own seed s + k + 1), so seed s + 1
# repeats seed s shifted by one row: the test rows come from a seed this far away instead
TEST_SEED_OFFSET = 1_000_000_007
# test rows drawn per wanted row before the mix is called too small to hold out test_size distinct questions
_TEST_DRAWS = 20


@dataclass(frozen=True)
class Task:
    """One task of the mix: a reasoning-gym dataset name, its sampling weight and its config."""

    name: str
    weight: float = 1.0
    config: dict[str, Any] = field(default_factory=dict)


def _import(where: str) -> Any:
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError(f"{where}: reasoning-gym is not installed ({err}); it is in requirements/cpu.lock") from None
    return reasoning_gym


def parse_tasks(tasks: list[Any], where: str) -> list[Task]:
    """``tasks`` entries (a name, or a mapping with name/weight/config) as Tasks; raises one line naming the entry."""
    rg = _import(where)
    known = rg.factory.DATASETS
    out: list[Task] = []
    for i, item in enumerate(tasks):
        at = f"{where}.tasks[{i}]"
        raw = dict(item) if hasattr(item, "keys") else {"name": item}
        extra = sorted(set(raw) - set(TASK_KEYS))
        if extra:
            raise ValueError(f"{at}: unknown key(s) {extra}; a task takes {list(TASK_KEYS)}")
        name, weight, config = raw.get("name"), raw.get("weight", 1.0), raw.get("config") or {}
        if not isinstance(name, str) or name not in known:
            near = [k for k in sorted(known) if isinstance(name, str) and (name in k or k in name)][:5]
            hint = f" (close: {', '.join(near)})" if near else f" ({len(known)} tasks: reasoning_gym.factory.DATASETS)"
            raise ValueError(f"{at}.name: {name!r} is not a reasoning-gym task{hint}")
        if not isinstance(weight, int | float) or weight <= 0:
            raise ValueError(f"{at}.weight: {weight!r} must be a positive number")
        if not hasattr(config, "keys"):
            raise ValueError(f"{at}.config: must be a mapping of the task's config fields, got {config!r}")
        config = {str(k): _plain(v) for k, v in dict(config).items()}
        if any(k in config for k in ("seed", "size")):
            raise ValueError(f"{at}.config: seed and size are set by {where}.seed/size, not per task")
        try:
            rg.create_dataset(name, **config, size=1, seed=0)
        except (TypeError, ValueError, AssertionError) as err:
            raise ValueError(f"{at}.config: reasoning-gym refused it for {name!r}: {err}") from None
        if any(t.name == name for t in out):
            raise ValueError(f"{at}.name: {name!r} is listed twice")
        out.append(Task(name, float(weight), config))
    if not out:
        raise ValueError(f"{where}.tasks: empty; name at least one reasoning-gym task")
    return out


def _plain(value: Any) -> Any:
    """OmegaConf containers as plain lists/dicts (reasoning-gym configs take tuples/lists of numbers)."""
    if hasattr(value, "keys"):
        return {str(k): _plain(v) for k, v in dict(value).items()}
    if isinstance(value, list | tuple) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def system_prompt(name_or_text: str) -> str:
    """A name in reasoning-gym's ``SYSTEM_PROMPTS``, else the text itself."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(name_or_text, name_or_text)


def spec(config: ReasoningGymConfig, where: str) -> dict[str, Any]:
    """What the files are generated from (and are checked against on reuse)."""
    from importlib.metadata import version

    tasks = parse_tasks(list(config.tasks), where)
    return {
        "tasks": [{"name": t.name, "weight": t.weight, "config": t.config} for t in tasks],
        "seed": int(config.seed),
        "size": int(config.size),
        "test_size": int(config.test_size),
        "system_prompt": system_prompt(config.system_prompt),
        "answer": str(config.answer),
        "reasoning_gym": version("reasoning-gym"),
    }


def _entries(tasks: list[dict[str, Any]], seed: int, size: int) -> Iterator[dict[str, Any]]:
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    specs = [DatasetSpec(name=t["name"], weight=t["weight"], config=dict(t["config"])) for t in tasks]
    mix = CompositeDataset(CompositeConfig(size=size, seed=seed, datasets=specs))
    for i in range(size):
        yield mix[i]


def _row(entry: dict[str, Any], system: str, answer_format: str) -> dict[str, Any]:
    text = json.dumps(entry, default=_json_default, sort_keys=True)
    row = {"question": entry["question"], "answer": str(entry["answer"]), "system": system, "reasoning_gym": text}
    return {**row, "answer_format": answer_format}


def _json_default(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def generate(spec_: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, held-out rows) of a ``spec``; raises if the mix cannot hold out ``test_size`` new questions
    or a task's verifier does not accept its own oracle answer from the written entry."""
    from reasoning_gym import get_score_answer_fn

    tasks, system, answer_format = spec_["tasks"], spec_["system_prompt"], spec_["answer"]
    train = [_row(e, system, answer_format) for e in _entries(tasks, spec_["seed"], spec_["size"])]
    seen = {row["question"] for row in train}
    test: list[dict[str, Any]] = []
    budget = spec_["test_size"] * _TEST_DRAWS
    for entry in _entries(tasks, spec_["seed"] + TEST_SEED_OFFSET, budget):
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        row = _row(entry, system, answer_format)
        task = entry["metadata"].get("source_dataset")
        if get_score_answer_fn(task)(row["answer"], json.loads(row["reasoning_gym"])) != 1.0:
            raise ValueError(
                f"reasoning-gym task {task!r}: its verifier does not give its own answer {row['answer']!r} full "
                "score from the written entry, so its rows cannot be scored; leave it out of the mix"
            )
        test.append(row)
        if len(test) == spec_["test_size"]:
            return train, test
    raise ValueError(
        f"reasoning-gym mix {[t['name'] for t in tasks]}: only {len(test)} of {budget} test draws have a question "
        f"that is not in the {len(train)} training rows, fewer than test_size {spec_['test_size']}; make the tasks "
        "harder (their config) or size smaller"
    )


def _write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _write(out: str, spec_: dict[str, Any]) -> None:
    """Generate ``spec_`` into a new directory beside ``out`` and rename it to ``out``, so a reader never sees half
    a dataset; where another process got there first (ranks started without the launcher), its copy stays."""
    train, test = generate(spec_)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out)}-")
    try:
        _write_jsonl(os.path.join(tmp, "train.jsonl"), train)
        _write_jsonl(os.path.join(tmp, "test.jsonl"), test)
        with open(os.path.join(tmp, SPEC_FILE), "w") as f:
            json.dump(spec_, f, indent=1, sort_keys=True)
        os.chmod(tmp, 0o755)
        os.rename(tmp, out)  # replaces an empty directory; fails on a non-empty one
    except OSError:
        if not os.path.isfile(os.path.join(out, SPEC_FILE)):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _held_spec(out: str) -> dict[str, Any] | None:
    spec_file = os.path.join(out, SPEC_FILE)
    if not os.path.isfile(spec_file):
        return None
    with open(spec_file) as f:
        return dict(json.load(f))


def ensure_written(config: DatasetConfig, where: str) -> bool:
    """Generate the reasoning-gym rows of ``config`` into its path unless that path already holds them; True if
    it wrote them. A path holding rows of another spec, or other files, is refused in one line."""
    rg_config = config.reasoning_gym
    if not rg_config.enabled:
        return False
    wanted = spec(rg_config, f"{where}.reasoning_gym")
    out = os.path.expanduser(config.path)
    if not (os.path.isabs(out) or out.startswith(".") or os.path.isdir(out)):
        raise ValueError(
            f"{where}.path: {config.path!r} is read as a hub id; reasoning-gym rows are written to a local directory: "
            "give an absolute or ./relative path"
        )
    held = _held_spec(out)
    wrote = False
    if held is None:
        if os.path.isdir(out) and os.listdir(out):
            raise ValueError(f"{where}.path: {out} holds files not written by reasoning-gym ({SPEC_FILE} missing)")
        _write(out, wanted)
        held, wrote = _held_spec(out), True
    if held != wanted:
        diff = sorted(k for k in set(held or {}) | set(wanted) if (held or {}).get(k) != wanted.get(k))
        raise ValueError(
            f"{where}.path: {out} holds reasoning-gym rows of another spec (differs in {', '.join(diff)}); "
            "delete it or choose another path"
        )
    return wrote


def main(argv: list[str] | None = None) -> None:
    from tandemrl.configs.data import ReasoningGymConfig

    p = argparse.ArgumentParser(prog="python -m tandemrl.data.reasoning_gym", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory to write train.jsonl, test.jsonl and the spec")
    p.add_argument("--task", action="append", required=True, help="a reasoning-gym task, NAME or NAME:WEIGHT")
    p.add_argument("--size", type=int, default=ReasoningGymConfig.size)
    p.add_argument("--test-size", type=int, default=ReasoningGymConfig.test_size)
    p.add_argument("--seed", type=int, default=ReasoningGymConfig.seed)
    p.add_argument("--system-prompt", default=ReasoningGymConfig.system_prompt)
    args = p.parse_args(argv)
    tasks = []
    for item in args.task:
        name, _, weight = item.partition(":")
        tasks.append({"name": name, "weight": float(weight)} if weight else name)
    rg = ReasoningGymConfig(
        tasks=tasks, seed=args.seed, size=args.size, test_size=args.test_size, system_prompt=args.system_prompt
    )
    from tandemrl.configs.data import DatasetConfig

    wrote = ensure_written(DatasetConfig(path=args.out, type="rl", reasoning_gym=rg), "reasoning_gym")
    print(f"{'wrote' if wrote else 'kept'} {args.size} train and {args.test_size} test rows in {args.out}")


if __name__ == "__main__":
    main()
