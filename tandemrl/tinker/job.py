"""``tandemrl tinker-serve`` as a launcher job: its config (``TinkerServeConfig``) and servers from the launcher.

    python -m tandemrl.launchers.local examples/tinker_serve.py --config examples/tinker_serve.yaml

The launcher starts the inference server that ``allocation_mode`` names and passes its address
in ``TANDEMRL_LLM_SERVER_ADDRS``; this job serves the Tinker API on it until the launcher stops it.
"""

from __future__ import annotations

import os

from tandemrl.configs.loader import read_config
from tandemrl.configs.tinker import TinkerServeConfig
from tandemrl.inference.remote import SERVER_ADDRS_ENV
from tandemrl.tinker import serve


def serve_argv(config: TinkerServeConfig, addrs: str) -> list[str]:
    """The ``tinker-serve`` command line of ``config``; one line naming the key when it cannot be served."""
    alloc = config.allocation  # read_config checked that it parses
    if alloc.gen is None or alloc.gen.strategy.dp != 1:
        raise ValueError(f"allocation_mode: tinker-serve samples through one inference server, got {alloc.spec!r}")
    if alloc.train is None or alloc.train.strategy.dp != alloc.train_world_size:
        raise ValueError(f"allocation_mode: tinker-serve trains data parallel only (e.g. fsdp:d2), got {alloc.spec!r}")
    if not config.tinker.full_weight and "lora" not in alloc.train.features:
        raise ValueError(
            f"allocation_mode: LoRA clients train on fsdp, got {alloc.train.backend!r} (tinker.full_weight: true "
            "trains every weight on it)"
        )
    servers = [a for a in addrs.split(",") if a]
    if len(servers) != 1:
        raise ValueError(f"{SERVER_ADDRS_ENV}: expected one server address from the launcher, got {addrs!r}")
    t = config.tinker
    run_dir = os.path.join(config.cluster.fileroot, "logs", config.experiment_name, config.trial_name)
    argv = ["--model", config.model.path, "--vllm-addr", servers[0], "--host", t.host, "--port", str(t.port)]
    argv += ["--max-lora-rank", str(t.max_lora_rank), "--max-adapters", str(t.max_adapters)]
    argv += ["--out", t.out or os.path.join(run_dir, "ckpt"), "--compute-dtype", t.compute_dtype]
    for flag, value in (("--model-name", t.model_name), ("--api-key", t.api_key), ("--key-file", t.key_file)):
        if value:
            argv += [flag, value]
    if t.full_weight:
        argv += ["--full-weight", alloc.train.backend]
    return argv


def main(argv: list[str]) -> None:
    config, _ = read_config(argv, TinkerServeConfig)
    serve.main(serve_argv(config, os.environ.get(SERVER_ADDRS_ENV, "")))
