"""``tandemrl tinker-serve``: the Tinker training and sampling API on this machine (docs/tinker.md).

    tandemrl tinker-serve --model tiny:qwen2 [--port 8080] [--vllm-addr HOST:PORT] [--key-file PATH] [--full-weight fsdp]

Trains on a tandemrl engine: LoRA adapters of many clients on one FSDP2 model (the base loaded
once), and samples through a vLLM server: the one at ``--vllm-addr`` (started with ``--enable-lora``
and runtime adapter loading unless ``--serve merged``), or one it starts itself. Under torchrun every
rank trains (data parallel: each takes a share of every batch) and rank 0 serves the API
(``tandemrl.tinker.ranks``). A fresh API key is made for the run
(``--api-key`` to choose one); it is printed with the base URL and written to ``--key-file``
(mode 0600). With ``--full-weight BACKEND`` it trains every weight of the model instead, for one
training client at a time, on that tandemrl engine (``fsdp``, ``deepspeed`` or ``megatron``). Point the unmodified ``tinker`` SDK at it with ``TINKER_BASE_URL`` and ``TINKER_API_KEY``.

SIGTERM or Ctrl-C stops it without waiting for a training call that is running: unfinished calls
fail (``tinker-serve is stopping``), the HTTP server and the vLLM server it started stop, and the
process exits, leaving the abandoned call's thread behind.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import tempfile
from typing import TYPE_CHECKING

from tandemrl.api.inference import serves_adapter
from tandemrl.api.net import free_port, port_problem
from tandemrl.models.resolve import resolve_model_path
from tandemrl.tinker.ranks import follow
from tandemrl.tinker.routes import TinkerServer, new_api_key
from tandemrl.tinker.sampler import VLLMError
from tandemrl.tinker.service import TinkerService
from tandemrl.tinker.trainer import EngineTrainer, check_backend
from tandemrl.utils.cli import first_line

if TYPE_CHECKING:
    from tandemrl.inference.server import ServerProcess

logger = logging.getLogger("tandemrl.tinker")
DRAIN_S = 5.0  # at a stop, how long clients have to fetch their failed calls
WORKER_WAIT_S = 2.0  # at a stop, how long a running training call may take to finish


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tandemrl tinker-serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="base model: HF directory, hub id, tiny:qwen2 or smollm2-135m")
    p.add_argument("--model-name", default="", help="name clients pass as base_model (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=0, help="port (0: a free one)")
    p.add_argument("--vllm-addr", default="", help="host:port of a LoRA-enabled vLLM server; empty starts one")
    p.add_argument("--max-lora-rank", type=int, default=8, help="largest adapter rank a client may ask for")
    p.add_argument("--max-adapters", type=int, default=4, help="most live LoRA training clients")
    p.add_argument("--out", default="", help="checkpoint directory (default: a temporary one)")
    p.add_argument("--api-key", default="", help="the key clients must send (default: a fresh one; starts with tml-)")
    p.add_argument("--key-file", default="", help="also write the key here (mode 0600)")
    p.add_argument(
        "--full-weight",
        default="",
        choices=["", "fsdp", "deepspeed", "megatron"],
        help="train all weights (one client at a time) on this engine instead of LoRA adapters: fsdp, deepspeed "
        "(ZeRO-2) or megatron (tensor and pipeline parallel 1); data parallel over the torchrun world",
    )
    p.add_argument(
        "--compute-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype of the training forward and backward (weights, AdamW state and logprobs stay fp32); bfloat16 "
        "ran an example iteration in 42 s vs 47 s on 2 CPU cores (docs/tinker.md)",
    )
    p.add_argument("--vllm-log", default="", help="log file of the vLLM server it starts")
    p.add_argument(
        "--serve",
        default="auto",
        choices=["auto", "adapter", "merged"],
        help="how LoRA samplers reach vLLM: adapter (vLLM multi-LoRA, one name per save), merged (each adapter "
        "merged into the base and loaded whole, one at a time), auto: adapter with CUDA, merged without (vLLM's CPU "
        "LoRA path generates at 0.46x the merged weights' speed, docs/lora.md)",
    )
    p.add_argument(
        "--session-timeout",
        type=float,
        default=60.0,
        help="seconds without a heartbeat or call after which a session ends and its training clients are unloaded "
        "(the SDK heartbeats every 10 s while its program runs; 0: never)",
    )
    return p.parse_args(argv)


def serves_merged(serve: str, full_weight: str) -> bool:
    """Whether LoRA samplers are served as merged weights (``--serve``, decided as ``lora.serve``); never with
    ``--full-weight``."""
    import torch

    return not full_weight and not serves_adapter(serve, on_gpu=torch.cuda.is_available())


def _start_vllm(model_dir: str, max_rank: int, max_adapters: int, log: str, lora: bool) -> ServerProcess:
    import torch

    from tandemrl.inference.registry import get_backend
    from tandemrl.inference.server import launch_server
    from tandemrl.tinker.sampler import SAMPLER_BACKEND

    backend = get_backend(SAMPLER_BACKEND)
    extra = {**backend.lora_flags(max_rank), "max_loras": max_adapters} if lora else {}
    if not torch.cuda.is_available():  # clients may seed samples: a seeded split prefill kills vLLM's CPU worker
        extra.update(backend.deterministic_flags)
    proc = launch_server(backend, model_dir, extra=extra, log_file=log or None)
    proc.wait_healthy(900.0)
    return proc


async def _serve(args: argparse.Namespace, trainer: EngineTrainer, vllm_addr: str) -> bool:
    """Serve until SIGTERM/SIGINT; True if a training call was still running when it stopped."""
    key = args.api_key or new_api_key()
    out = args.out or tempfile.mkdtemp(prefix="tandemrl-tinker-")
    service = TinkerService(
        trainer,
        args.model_name or args.model,
        vllm_addr,
        out,
        args.max_adapters,
        session_timeout=args.session_timeout,
        merged=serves_merged(args.serve, args.full_weight),
    )
    await service.start()
    server = TinkerServer(service, key)
    port = await server.start(args.host, args.port or free_port(args.host))
    if args.key_file:
        fd = os.open(args.key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key)
    print(f"TINKER_BASE_URL=http://{args.host}:{port} TINKER_API_KEY={key}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    expiry = asyncio.ensure_future(service.expire_forever())
    try:
        await stop.wait()
    finally:
        expiry.cancel()
        failed = service.fail_pending()
        logger.info("tinker-serve: stopping; %d unfinished calls failed", failed)
        await service.drain(DRAIN_S)
        await server.stop()
    return service.close(WORKER_WAIT_S)


def _exit_on_sigterm(_sig: int, _frame: object) -> None:
    raise SystemExit(128 + signal.SIGTERM)  # until the API serves: unwind, so the vLLM server is stopped


def main(argv: list[str] | None = None) -> None:
    args = _args(sys.argv[1:] if argv is None else argv)
    _log_to_stdout()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    proc, abandoned = None, False
    try:
        if args.api_key and not args.api_key.startswith("tml-"):
            raise ValueError("--api-key: the tinker SDK accepts only keys that start with 'tml-'")
        problem = port_problem(args.port, args.host)
        if problem is not None:  # before the model loads and a vLLM server starts
            raise ValueError(f"--port: {problem}")
        if args.full_weight:
            check_backend(args.full_weight)
        model_dir = resolve_model_path(args.model, "--model")
        compute = None if args.compute_dtype == "float32" else args.compute_dtype
        trainer = EngineTrainer(model_dir, args.max_lora_rank, args.full_weight, compute)  # every rank
        if trainer.rank != 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a follower blocks in a collective: die at once
            follow(trainer)
            return
        vllm_addr = args.vllm_addr
        if not vllm_addr:
            lora = not args.full_weight and not serves_merged(args.serve, args.full_weight)
            proc = _start_vllm(model_dir, args.max_lora_rank, args.max_adapters, args.vllm_log, lora)
            vllm_addr = proc.address
        abandoned = asyncio.run(_serve(args, trainer, vllm_addr))
    except (ValueError, FileNotFoundError, VLLMError) as err:
        print(f"error: {first_line(err)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        if proc is not None:
            proc.stop()
    if abandoned:  # the worker thread is still in a call that cannot be interrupted: leave without it
        logger.info("tinker-serve: stopped without waiting for the running training call")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _log_to_stdout() -> None:
    """The ``tandemrl.tinker`` logger (each training call's start and end, the stop) on stdout."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


if __name__ == "__main__":
    main()
