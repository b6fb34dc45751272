"""Catalogue of bad configs and bad data: each gives one line naming the key, file or row.

Config and data checks run in-process (fast); a few go through the real local launcher to show
that the error is the last thing it prints, that nothing was started (or, for an error raised on
a trainer rank, that every process of the run is gone) and that an earlier checkpoint is untouched.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import psutil
import pytest
from utils import REPO_ROOT, launch

from tandemrl.configs import GRPOConfig, SFTConfig
from tandemrl.configs.checks import CHECK_ONLY_ENV, InputsChecked
from tandemrl.configs.data import DatasetConfig
from tandemrl.configs.loader import ConfigError
from tandemrl.data.loader import check_dataset_inputs, dataset_from_config
from tandemrl.data.rows import load_split
from tandemrl.models.hf import load_hf_tokenizer, model_context_length
from tandemrl.trainers.entry import load_script_config as load_config
from tandemrl.trainers.saver import Saver
from tandemrl.utils import stats_tracker

SFT_YAML = str(REPO_ROOT / "examples" / "gsm8k_sft.yaml")
GOOD = {"question": "Tom has 3 apples and buys 2 more. How many apples does he have?", "answer": "3+2=5\n#### 5"}


def _write_rows(path: Path, rows: list[Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path / "train.jsonl"


def _one_line(err: BaseException) -> str:
    msg = str(err)
    assert "\n" not in msg, msg
    return msg


# ----------------------------------------------------------------------------- config (in-process)


@pytest.mark.parametrize(
    ("yaml_body", "override", "expected"),
    [
        ({"actor": {"lr": 1.0}}, None, "Unknown config key 'actor.lr' in {yaml}"),
        ({"gconfig": {"n_samples": "four"}}, None, "Config key 'gconfig.n_samples' in {yaml} expects int, got 'four'"),
        ({"weight_update_mode": "nfs"}, None, "'weight_update_mode' in {yaml} expects one of collective, disk"),
        ({"train_dataset": {"on_too_long": "truncate"}}, None, "'train_dataset.on_too_long' in {yaml} expects one of"),
        ({"train_dataset": {"batch_size": -8}}, None, "'train_dataset.batch_size' in {yaml} must be >= 1, got -8"),
        ({"gconfig": {"max_new_tokens": 0}}, None, "'gconfig.max_new_tokens' in {yaml} must be >= 1, got 0"),
        ({}, "rollout.max_head_offpolicyness=-1", "'rollout.max_head_offpolicyness' on the command line"),
        ({}, "rollout.max_dropped_share=1.5", "('rollout.max_dropped_share=1.5') must be <= 1.0, got 1.5"),
        ({}, "rollout.drop_window=0", "('rollout.drop_window=0') must be >= 1, got 0"),
        ({"allocation_mode": "vllm:d1+fsdp:d2"}, "train_dataset.batch_size=7", "must be a multiple of 2"),
        ({"gconfig": {"n_samples": 4}}, "actor.group_size=3", "'actor.group_size' on the command line"),
        ({}, "actor.ppo_n_minibatches=9", "'actor.ppo_n_minibatches' on the command line"),
        ({}, "actor.ppo_n_minibatches=3", "('actor.ppo_n_minibatches=3') must divide the 8 groups of group_size"),
        ({}, "gconfig.temperature=-1", "('gconfig.temperature=-1') must be >= 0.0, got -1.0"),
        ({}, "gconfig.top_p=0", "('gconfig.top_p=0') must be > 0.0, got 0.0"),
        ({}, "actor.eps_clip=-0.2", "('actor.eps_clip=-0.2') must be > 0.0, got -0.2"),
        ({}, "actor.temperature=0", "('actor.temperature=0') must be > 0.0, got 0.0"),
        ({}, "total_train_steps=-1", "('total_train_steps=-1') must be >= 1, got -1"),
        ({}, "rollout.server_addrs=[127.0.0.1:99999]", "holds '127.0.0.1:99999', which has a port outside 1-65535"),
        (
            {},
            "rollout.server_addrs=[localhost]",
            "('rollout.server_addrs=[localhost]') holds 'localhost', which is not",
        ),
    ],
)
def test_bad_config_is_one_line_naming_key_and_source(
    tmp_path: Path, yaml_body: dict[str, Any], override: str | None, expected: str
) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps({"allocation_mode": "vllm:d1+fsdp:d1", **yaml_body}))  # JSON is YAML
    argv = ["--config", str(path)] + ([override] if override else [])
    with pytest.raises(ConfigError) as err:
        load_config(argv, GRPOConfig)
    assert expected.format(yaml=path) in _one_line(err.value)


def test_staleness_and_group_messages_say_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match=r"must be >= 0, got -1$"):
        load_config(["rollout.max_head_offpolicyness=-1"], GRPOConfig)
    with pytest.raises(ConfigError, match=r"must divide each rank's batch of 32 sequences, got 3 "):
        load_config(["allocation_mode=vllm:d1+fsdp:d1", "gconfig.n_samples=4", "actor.group_size=3"], GRPOConfig)
    # Interpolated defaults (group_size: ${gconfig.n_samples}) and divisible sizes pass.
    cfg, _ = load_config(["--config", str(REPO_ROOT / "examples/gsm8k_grpo.yaml")], GRPOConfig)
    assert cfg.actor.group_size == cfg.gconfig.n_samples


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.path=", "model.path: empty; set it to an HF model directory"),
        ("model.path=/no/such/model", "model.path: model directory not found: /no/such/model"),
        ("train_dataset.path=/no/such/data", "train_dataset.path: dataset directory not found: /no/such/data"),
        ("valid_dataset.split=nosplit", "valid_dataset.path: dataset split file not found: "),
    ],
)
def test_missing_model_or_dataset_is_named_in_the_pre_flight(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: str, gsm8k_dir: str, override: str, expected: str
) -> None:
    monkeypatch.setenv(CHECK_ONLY_ENV, "1")
    base = [f"model.path={tiny_model_dir}", f"train_dataset.path={gsm8k_dir}", f"valid_dataset.path={gsm8k_dir}"]
    with pytest.raises(InputsChecked):  # all good: load_config stops the script here
        load_config(["--config", SFT_YAML, *base], SFTConfig)
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        load_config(["--config", SFT_YAML, *base, override], SFTConfig)
    assert expected in _one_line(err.value)


def test_rl_inputs_the_run_could_not_use_are_named_in_the_pre_flight(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path
) -> None:
    """A GRPO allocation without servers, a tokenizer directory that is missing and a model directory
    without tokenizer files (transformers would build an empty tokenizer from it) fail in the pre-flight."""
    monkeypatch.setenv(CHECK_ONLY_ENV, "1")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_model_dir) / name, bare / name)
    base = ["--config", str(REPO_ROOT / "examples" / "gsm8k_grpo.yaml"), f"train_dataset.path={gsm8k_dir}"]
    base.append(f"actor.engine.path={tiny_model_dir}")
    with pytest.raises(InputsChecked):
        load_config(base, GRPOConfig)
    for override, expected in (
        ("allocation_mode=fsdp:d1", "allocation_mode: 'fsdp:d1' has no inference component, but GRPOConfig"),
        (f"tokenizer_path={tmp_path}/none", f"tokenizer_path: tokenizer directory not found: {tmp_path}/none"),
        (f"tokenizer_path={bare}", f"tokenizer_path: {bare} has no tokenizer (none of tokenizer.json"),
        (f"actor.engine.path={bare}", f"actor.engine.path: {bare} has no tokenizer (none of tokenizer.json"),
    ):
        with pytest.raises((ValueError, FileNotFoundError)) as err:
            load_config([*base, override], GRPOConfig)
        assert _one_line(err.value).startswith(expected), err.value
    with pytest.raises(InputsChecked):  # the tokenizer from elsewhere: the bare model is fine
        load_config([*base, f"actor.engine.path={bare}", f"tokenizer_path={tiny_model_dir}"], GRPOConfig)


# ----------------------------------------------------------------------------- data (in-process)


def test_row_without_answer_names_file_and_row(tmp_path: Path) -> None:
    file = _write_rows(tmp_path / "d", [GOOD, GOOD, {"question": "How many?"}, GOOD])
    for check in (lambda: check_dataset_inputs(DatasetConfig(path=str(tmp_path / "d"))),):
        with pytest.raises(ValueError) as err:
            check()
        assert _one_line(err.value) == f"{file}: row 2: required field 'answer' is missing"
    file = _write_rows(tmp_path / "e", [{"answer": "#### 1"}])
    with pytest.raises(ValueError, match=r"train\.jsonl: row 0: required field 'question' is missing$"):
        check_dataset_inputs(DatasetConfig(path=str(tmp_path / "e")))
    # max_samples limits the check to the rows the run uses.
    check_dataset_inputs(DatasetConfig(path=str(tmp_path / "d"), max_samples=2))


def test_invalid_json_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text(json.dumps(GOOD) + "\n\n" + '{"question": "a", "answer": }\n')
    with pytest.raises(ValueError) as err:
        load_split(str(tmp_path), "train")
    assert _one_line(err.value).startswith(f"{tmp_path / 'train.jsonl'}: line 3: invalid JSON (")
    (tmp_path / "train.jsonl").write_text(json.dumps(GOOD) + "\n[1, 2]\n")
    with pytest.raises(ValueError, match=r"train\.jsonl: line 2: expected a JSON object, got list$"):
        load_split(str(tmp_path), "train")


def test_empty_file_is_named(tmp_path: Path) -> None:
    for content in ("", "\n  \n"):
        (tmp_path / "train.jsonl").write_text(content)
        with pytest.raises(ValueError) as err:
            load_split(str(tmp_path), "train")
        assert _one_line(err.value).startswith(f"{tmp_path / 'train.jsonl'}: empty (no JSON rows)")


def test_non_utf8_byte_names_file_line_and_offset(tmp_path: Path) -> None:
    data = (json.dumps(GOOD) + "\n").encode() + b'{"question": "caf\xe9 au lait?", "answer": "#### 1"}\n'
    (tmp_path / "train.jsonl").write_bytes(data)
    offset = data.index(b"\xe9")
    for check in (
        lambda: load_split(str(tmp_path), "train"),
        lambda: check_dataset_inputs(DatasetConfig(str(tmp_path))),
    ):
        with pytest.raises(ValueError) as err:
            check()
        assert _one_line(err.value) == (
            f"{tmp_path / 'train.jsonl'}: line 2: byte 0xe9 at byte offset {offset} is not valid UTF-8 "
            "(save the file as UTF-8)"
        )


@pytest.fixture(scope="module")
def tok(tiny_model_dir: str) -> Any:
    return load_hf_tokenizer(tiny_model_dir)


def _long_prompt_dir(tmp_path: Path, n_good: int = 7, at: int = 3) -> Path:
    """GOOD rows with one question far longer than the tiny model's 2048-token context at row ``at``."""
    rows = [dict(GOOD) for _ in range(n_good)]
    rows.insert(at, {"question": "how many apples are left " * 600, "answer": "#### 1"})
    _write_rows(tmp_path / "long", rows)
    return tmp_path / "long"


@pytest.mark.parametrize("dataset_type", ["rl", "sft"])
def test_prompt_over_model_context_is_dropped_and_counted(
    tmp_path: Path, tiny_model_dir: str, tok: Any, capsys: pytest.CaptureFixture[str], dataset_type: str
) -> None:
    """max_length=null: the model's context (max_position_embeddings) is the limit, not a crash later."""
    path = _long_prompt_dir(tmp_path)
    context = model_context_length(tiny_model_dir)
    assert context == 2048
    stats_tracker.export_all()  # start from an empty tracker
    config = DatasetConfig(path=str(path), type=dataset_type, max_length=None)
    ds = dataset_from_config(config, tok, 0, 1, context)
    assert len(ds) == 7
    lines = [line for line in capsys.readouterr().out.splitlines() if "dropped" in line]
    assert lines == [f"{path / 'train.jsonl'}: dropped 1 of 8 rows longer than the model context of 2048 tokens"]
    assert stats_tracker.export_all()["data/train/dropped_too_long"] == 1
    # Rank 1 drops the same rows (equal shards) without printing again.
    assert len(dataset_from_config(config, tok, 1, 2, context)) == 3
    assert "dropped" not in capsys.readouterr().out


def test_max_length_drop_prints_the_count_once(tmp_path: Path, tok: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = _long_prompt_dir(tmp_path)
    ds = dataset_from_config(DatasetConfig(path=str(path), type="rl", max_length=64), tok, 0, 1, 2048)
    assert len(ds) == 7
    out = capsys.readouterr().out
    assert f"{path / 'train.jsonl'}: dropped 1 of 8 rows longer than max_length=64 tokens" in out


def test_too_long_prompt_in_error_mode_names_file_row_and_lengths(tmp_path: Path, tok: Any) -> None:
    path = _long_prompt_dir(tmp_path, at=5)
    for max_length, limit in ((None, "the model context of 2048"), (64, "max_length=64")):
        config = DatasetConfig(path=str(path), type="rl", max_length=max_length, on_too_long="error")
        with pytest.raises(ValueError) as err:
            dataset_from_config(config, tok, 0, 1, 2048)
        msg = _one_line(err.value)
        assert msg.startswith(f"{path / 'train.jsonl'}: row 5: ") and f"tokens, longer than {limit} (1 of 8 rows" in msg
        n = int(msg.split("row 5: ")[1].split()[0])
        assert n > 2048


# ----------------------------------------------------------------------------- through the launcher


def _launch(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """The local launcher with stdout and stderr merged, as a user sees them in a terminal."""
    return launch(args, timeout, merged=True)


def _previous_checkpoint(model_dir: str, fileroot: Path, experiment: str) -> dict[str, str]:
    """A checkpoint an earlier run of the same trial left (the model files); returns their hashes."""
    ckpt = Path(Saver.get_save_path(str(fileroot), experiment, "trial0", 0, 9, 9))
    shutil.copytree(model_dir, ckpt)
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ckpt.rglob("*")) if p.is_file()}


def _assert_checkpoint_intact(hashes: dict[str, str]) -> None:
    from transformers import AutoModelForCausalLM

    now = {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in hashes}
    assert now == hashes
    ckpt = Path(next(iter(hashes))).parent
    assert sorted(str(p) for p in ckpt.rglob("*") if p.is_file()) == sorted(hashes)
    AutoModelForCausalLM.from_pretrained(ckpt)  # still loadable


def _assert_no_process_of(marker: str) -> None:
    """No process whose command line names this run's directory is left (bounded wait for exits)."""
    procs = []
    for p in psutil.process_iter():
        try:
            if marker in " ".join(p.cmdline()):
                procs.append(p)
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(procs, timeout=60)
    assert not alive, [p.cmdline() for p in alive]


def _sft_args(model_dir: str, data_dir: str, fileroot: Path, *extra: str) -> list[str]:
    return [
        "examples/gsm8k_sft.py",
        "--config",
        "examples/gsm8k_sft.yaml",
        f"model.path={model_dir}",
        f"train_dataset.path={data_dir}",
        f"valid_dataset.path={data_dir}",
        f"cluster.fileroot={fileroot}",
        *extra,
    ]


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("unknown_key", "error: Unknown config key 'model.optimizer.learning_rate' on the command line"),
        ("missing_answer", "error: {data}/train.jsonl: row 1: required field 'answer' is missing"),
        ("non_utf8", "error: {data}/train.jsonl: line 2: byte 0xff at byte offset "),
    ],
)
def test_launcher_stops_before_starting_anything(
    tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path, fault: str, expected: str
) -> None:
    """The pre-flight checks the script's own config schema and its data files before any server/trainer."""
    data = tmp_path / "data"
    _write_rows(data, [GOOD] * 4)
    shutil.copy(Path(gsm8k_dir) / "test.jsonl", data / "test.jsonl")
    extra: list[str] = []
    if fault == "unknown_key":
        extra = ["model.optimizer.learning_rate=1e-3"]
    elif fault == "missing_answer":
        _write_rows(data, [GOOD, {"question": "How many?"}, GOOD])
    else:
        (data / "train.jsonl").write_bytes((json.dumps(GOOD) + "\n").encode() + b'{"question": "\xff"}\n')
    fileroot = tmp_path / "runs"
    hashes = _previous_checkpoint(tiny_model_dir, fileroot, "gsm8k-sft")
    proc = _launch(_sft_args(tiny_model_dir, str(data), fileroot, *extra), timeout=300)
    assert proc.returncode == 2, proc.stdout
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith(expected.format(data=data)), proc.stdout[-3000:]
    assert "[launcher]" not in proc.stdout and not (fileroot / "logs").exists()
    _assert_checkpoint_intact(hashes)
    _assert_no_process_of(str(tmp_path))


def test_yaml_syntax_error_is_the_launchers_one_line(tmp_path: Path) -> None:
    """The launcher reads the YAML itself (allocation_mode, paths): a syntax error is one line with its place."""
    path = tmp_path / "exp.yaml"
    path.write_text("experiment_name: x\ngconfig:\n  n_samples: [4\n  max_new_tokens: 3\n")
    proc = _launch(["examples/gsm8k_grpo.py", "--config", str(path)], timeout=120)
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout.strip() == (
        f"error: Cannot parse YAML file {path} at line 4 column 17: expected ',' or ']', but got ':'"
    ), proc.stdout


def test_bad_data_under_a_tiny_model_is_named_in_data_words(gsm8k_dir: str, tmp_path: Path) -> None:
    """``tiny:qwen2`` trains its tokenizer on the run's data: the launcher checks that data first, so a file
    without one usable row is reported as a data error (file, row, field), not as a tokenizer that cannot train."""
    data = tmp_path / "data"
    _write_rows(data, [{"prompt": "2+3?", "response": "5"}] * 4)
    shutil.copy(Path(gsm8k_dir) / "test.jsonl", data / "test.jsonl")
    args = ["examples/gsm8k_grpo.py", "--config", "examples/gsm8k_grpo.yaml", f"train_dataset.path={data}"]
    proc = _launch([*args, "actor.engine.path=tiny:qwen2", f"cluster.fileroot={tmp_path / 'runs'}"], timeout=300)
    assert proc.returncode == 2, proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert last == f"error: {data}/train.jsonl: row 0: required field 'question' is missing", last


@pytest.mark.slow
def test_error_on_a_rank_is_the_launchers_last_line(tiny_model_dir: str, gsm8k_dir: str, tmp_path: Path) -> None:
    """A prompt over max_length with on_too_long=error is found on the trainer ranks (it needs the tokenizer):
    the launcher ends with that rank's error and the log path; torchrun's ChildFailedError report (with the
    traceback) is in the log, not on the console."""
    data = _long_prompt_dir(tmp_path, n_good=15, at=9)
    shutil.copy(Path(gsm8k_dir) / "test.jsonl", data / "test.jsonl")
    fileroot = tmp_path / "runs"
    hashes = _previous_checkpoint(tiny_model_dir, fileroot, "gsm8k-sft")
    extra = ["train_dataset.on_too_long=error", "train_dataset.batch_size=4", "valid_dataset.max_samples=4"]
    proc = _launch(_sft_args(tiny_model_dir, str(data), fileroot, *extra), timeout=600)
    assert proc.returncode != 0, proc.stdout[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert "ChildFailedError" not in proc.stdout
    log = fileroot / "logs" / "gsm8k-sft" / "trial0" / "trainer.log"
    first, second = lines[-2:]  # the rank's one line and where the full output is
    assert first.startswith("[launcher] trial trial0 failed: trainer rank ")
    assert first.split(": ", 1)[1].split(": ", 1)[1].startswith(f"ValueError: {data / 'train.jsonl'}: row 9: "), first
    assert "tokens, longer than max_length=384 (1 of 16 rows are; on_too_long=drop skips them)" in first
    assert second == f"[launcher] full output: {log}"
    assert (
        "Root Cause (first observed failure)" in log.read_text() and "Traceback" in log.read_text()
    )  # torchrun's report
    assert "row 9" in log.read_text()
    _assert_checkpoint_intact(hashes)
    _assert_no_process_of(str(tmp_path))


@pytest.mark.slow
def test_an_unexpected_error_on_a_rank_keeps_its_traceback_off_the_console(tiny_model_dir: str, tmp_path: Path) -> None:
    """A model file cut in half (a broken download) fails on the ranks with safetensors' own error, not a
    user-input error: each rank prints one ``error:`` line, the launcher ends with the first rank's error and
    the log path, and the traceback is in trainer.log only."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    data = tmp_path / "data"
    _write_rows(data, [GOOD] * 16)
    shutil.copy(data / "train.jsonl", data / "test.jsonl")
    fileroot = tmp_path / "runs"
    proc = _launch(_sft_args(str(model), str(data), fileroot), timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:]
    log = fileroot / "logs" / "gsm8k-sft" / "trial0" / "trainer.log"
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    rank_lines = [line for line in proc.stdout.splitlines() if line.startswith("[trainer] error: ")]
    assert rank_lines and all("SafetensorError: " in line and f"(traceback in {log})" in line for line in rank_lines)
    first, second = proc.stdout.strip().splitlines()[-2:]
    assert first.startswith("[launcher] trial trial0 failed: trainer rank "), first
    assert "SafetensorError: " in first and second == f"[launcher] full output: {log}"
    text = log.read_text()
    assert "Traceback" in text and "SafetensorError" in text and "Root Cause (first observed failure)" in text
    _assert_no_process_of(str(tmp_path))
