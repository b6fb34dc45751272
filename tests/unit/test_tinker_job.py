"""The launcher job of ``tandemrl tinker-serve`` (``tandemrl.tinker.job``): its config becomes the server's
command line, and what it cannot serve is one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandemrl.configs.loader import read_config
from tandemrl.configs.tinker import TinkerServeConfig
from tandemrl.launchers.launch_config import read_launch_spec, script_config
from tandemrl.tinker.job import serve_argv
from tandemrl.tinker.trainer import check_backend


def _config(*overrides: str) -> TinkerServeConfig:
    config, _ = read_config(["model.path=tiny:qwen2", *overrides], TinkerServeConfig)
    return config


def test_config_becomes_the_serve_command_line() -> None:
    argv = serve_argv(_config("tinker.max_adapters=2", "cluster.fileroot=/r", "trial_name=t"), "127.0.0.1:9")
    assert argv[:4] == ["--model", "tiny:qwen2", "--vllm-addr", "127.0.0.1:9"]
    assert argv[argv.index("--max-adapters") + 1] == "2"
    assert argv[argv.index("--out") + 1] == "/r/logs/tandemrl/t/ckpt"
    assert "--full-weight" not in argv
    assert argv[argv.index("--compute-dtype") + 1] == "float32"
    bf16 = serve_argv(_config("tinker.compute_dtype=bfloat16"), "127.0.0.1:9")
    assert bf16[bf16.index("--compute-dtype") + 1] == "bfloat16"
    assert serve_argv(_config("allocation_mode=vllm:d1+fsdp:d2"), "127.0.0.1:9")[:2] == ["--model", "tiny:qwen2"]
    full = serve_argv(_config("tinker.full_weight=true", "allocation_mode=vllm:d1+deepspeed:d1"), "127.0.0.1:9")
    assert full[full.index("--full-weight") + 1] == "deepspeed"
    meg = serve_argv(_config("tinker.full_weight=true", "allocation_mode=vllm:d1+megatron:d1"), "127.0.0.1:9")
    assert meg[meg.index("--full-weight") + 1] == "megatron"


@pytest.mark.parametrize("names", [[], ["experiment_name=e", "trial_name=t"]])
def test_checkpoints_go_to_the_launchers_run_directory(names: list[str], tmp_path: Path) -> None:
    """The launcher (which reads the YAML without the job's schema) and the job name one run directory, with
    the shipped YAML's names or the user's."""
    overrides = ["model.path=tiny:qwen2", "cluster.fileroot=/r", *names]
    spec = read_launch_spec("examples/tinker_serve.yaml", overrides)
    path, kept = script_config("examples/tinker_serve.yaml", overrides, str(tmp_path / "job.yaml"))
    config, _ = read_config(["--config", str(path), *kept], TinkerServeConfig)
    argv = serve_argv(config, "127.0.0.1:9")
    assert argv[argv.index("--out") + 1] == f"{spec.run_dir}/ckpt"


@pytest.mark.parametrize(
    ("overrides", "addrs", "message"),
    [
        (["allocation_mode=vllm:d1+fsdp:d1t2"], "a:1", "allocation_mode: tinker-serve trains data parallel only"),
        (["allocation_mode=vllm:d1+deepspeed:d2"], "a:1", "allocation_mode: LoRA clients train on fsdp, got 'deep"),
        (["allocation_mode=vllm:d2+fsdp:d1"], "a:1,b:2", "allocation_mode: tinker-serve samples through one"),
        ([], "a:1,b:2", "TANDEMRL_LLM_SERVER_ADDRS: expected one server address"),
    ],
)
def test_what_tinker_serve_cannot_run_is_one_line_naming_the_key(
    overrides: list[str], addrs: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as err:
        serve_argv(_config(*overrides), addrs)
    assert "\n" not in str(err.value)


def test_full_weight_backends() -> None:
    for backend in ("fsdp", "deepspeed", "megatron"):
        check_backend(backend)
    with pytest.raises(ValueError, match="--full-weight: unknown backend 'nope'"):
        check_backend("nope")
