"""Score an HF checkpoint directory on GSM8K: greedy answers from a real vLLM server, the training reward.

    python -m tandemrl.eval MODEL_DIR [--data DIR] [--split test] [--n 200] [--max-new-tokens 256]
        [--out FILE] [--chat-template | --no-chat-template] [--server-url URL] [--dtype auto]

Without ``--server-url`` it starts a vLLM server on MODEL_DIR (loopback, a free port, a per-run
token), scores the first N questions of the split, and stops the server on every exit path
(done, error, Ctrl-C, SIGTERM/SIGHUP; the server's lifeline covers SIGKILL). It prints the
accuracy with a 95% Wilson score interval and writes a JSON report, by default
``./gsm8k-eval-<model dir name>-<split>-n<N>.json`` in the working directory (a checkpoint
directory is left untouched). The scoring is ``tandemrl.workflows.gsm8k_eval.evaluate_gsm8k``.
Bad input (a missing model directory or split file, N above the split's size) is one
``error:`` line and exit code 2, before any server starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tandemrl.utils.cli import USER_ERRORS, ArgumentParser, first_line, signals_interrupt

_REPO = Path(__file__).resolve().parents[2]
DATA_ENV = "TANDEMRL_GSM8K"
_EPILOG = """\
Without --server-url a vLLM server is started on MODEL (loopback, free port) and stopped on
every exit path. Answers are scored with the GSM8K training reward (tandemrl.rewards.gsm8k).
The JSON report holds the settings, n, correct, accuracy, the interval and, per question,
index, generated text, extracted answer, gold answer and correct. Exit codes: 0 done,
2 bad input (one error line, before any server starts), 1 server or request failure,
130 interrupted."""


def default_data_dir() -> str:
    """``$TANDEMRL_GSM8K``, else ``../shared/data/gsm8k`` next to the repository (as ``scripts/main.sh``)."""
    return os.environ.get(DATA_ENV) or str(_REPO.parent / "shared" / "data" / "gsm8k")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = ArgumentParser(
        prog="python -m tandemrl.eval",
        description="Greedy GSM8K accuracy (95% Wilson score interval) of an HF checkpoint, through a vLLM server.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="HF checkpoint directory (config.json, weights, tokenizer)")
    p.add_argument(
        "--data",
        default=None,
        help=f"GSM8K directory with <split>.jsonl (default: ${DATA_ENV} or {_REPO.parent / 'shared/data/gsm8k'})",
    )
    p.add_argument("--split", default="test", help="split file to read (default: test)")
    p.add_argument("--n", type=int, default=200, help="score the first N questions of the split (default: 200)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="generation budget per question (default: 256)")
    p.add_argument(
        "--out", default=None, help="JSON report path (default: ./gsm8k-eval-<model dir name>-<split>-n<N>.json)"
    )
    p.add_argument(
        "--chat-template",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prompt with the tokenizer's chat template, as GRPO training does (default: when the tokenizer has one); "
        "--no-chat-template sends the bare question",
    )
    p.add_argument(
        "--server-url",
        default=None,
        help="score against this running vLLM server (host:port or http://host:port) instead of starting one; "
        "its token, if any, is read from $TANDEMRL_SERVER_TOKEN",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight at once (default: all N)")
    p.add_argument("--dtype", default="auto", help="vLLM --dtype of the started server (default: auto)")
    p.add_argument("--server-log", default=None, help="log file of the started server (default: a temp file, printed)")
    p.add_argument(
        "--server-timeout", type=float, default=900.0, help="seconds for the started server to become healthy"
    )
    args = p.parse_args(argv)
    for name in ("n", "max_new_tokens", "concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return args


def default_out(model: str, split: str, n: int) -> str:
    return f"gsm8k-eval-{Path(model).resolve().name}-{split}-n{n}.json"


def preflight(args: argparse.Namespace) -> tuple[Any, list[dict[str, Any]], str]:
    """(tokenizer, the first N rows, report path), or a one-line error naming the bad input."""
    from datasets.utils.logging import disable_progress_bar

    from tandemrl.configs.data import DatasetConfig
    from tandemrl.data.gsm8k import get_gsm8k_rl_dataset
    from tandemrl.data.loader import check_dataset_inputs
    from tandemrl.models.hf import load_hf_tokenizer

    if not os.path.isdir(args.model):
        raise FileNotFoundError(f"model directory not found: {args.model}")
    from tandemrl.inference.backend import dtype_problem
    from tandemrl.inference.vllm import VLLMBackend

    problem = dtype_problem(VLLMBackend, "vLLM", args.dtype) if args.server_url is None else None
    if problem is not None:
        raise ValueError(f"--dtype: {problem}")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise FileNotFoundError(f"{args.model} is not an HF checkpoint directory (no config.json)")
    data = args.data or default_data_dir()
    if not os.path.isdir(data):
        raise FileNotFoundError(f"GSM8K directory not found: {data} (set --data or ${DATA_ENV})")
    available = check_dataset_inputs(DatasetConfig(path=data, type="rl", split=args.split, max_samples=args.n))
    if available is not None and available < args.n:
        raise ValueError(f"--n {args.n}: split {args.split!r} of {data} has only {available} questions")
    tokenizer = load_hf_tokenizer(args.tokenizer or args.model)
    disable_progress_bar()  # datasets' map bars would bury the report lines
    ds = get_gsm8k_rl_dataset(data, args.split, tokenizer, rank=0, world_size=1, max_samples=args.n)
    out = args.out or default_out(args.model, args.split, args.n)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--out {out}: directory {parent} is not writable")
    return tokenizer, ds.to_list(), out


def score_on_new_server(args: argparse.Namespace, tokenizer: Any, rows: list[dict[str, Any]]) -> Any:
    """Start a vLLM server on the model, score, and stop it whatever happens."""
    from tandemrl.inference.registry import get_backend
    from tandemrl.inference.server import launch_server
    from tandemrl.inference.server_auth import TOKEN_ENV, new_token

    os.environ[TOKEN_ENV] = new_token()  # the server requires it; this process's client sends it
    server = launch_server(
        get_backend("vllm"),
        args.model,
        extra={"dtype": args.dtype},
        log_file=args.server_log,
        token=os.environ[TOKEN_ENV],
    )
    try:
        print(
            f"[eval] vLLM server pid {server.proc.pid} starting on {server.address} (log {server.log_file})", flush=True
        )
        waited = server.wait_healthy(args.server_timeout)
        print(f"[eval] server healthy after {waited:.0f} s", flush=True)
        return score(args, server.address, tokenizer, rows)
    finally:
        server.stop()


def score(args: argparse.Namespace, url: str, tokenizer: Any, rows: list[dict[str, Any]]) -> Any:
    from tandemrl.workflows.gsm8k_eval import evaluate_gsm8k

    return evaluate_gsm8k(url, tokenizer, rows, args.max_new_tokens, args.chat_template, args.concurrency)


def write_report(path: str, args: argparse.Namespace, result: Any, wall_seconds: float) -> None:
    """The JSON report (written atomically): run settings, totals, and every question."""
    report = {
        "model": os.path.abspath(args.model),
        "data": os.path.abspath(args.data or default_data_dir()),
        "split": args.split,
        "server_url": args.server_url,
        "prompt_format": "chat_template" if result.chat_template else "plain_question",
        "wall_seconds": wall_seconds,
        **result.to_dict(),
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    with signals_interrupt():
        try:
            tokenizer, rows, out = preflight(args)
            prompt = "bare question" if args.chat_template is False else "chat template if the tokenizer has one"
            print(
                f"[eval] {args.model}: split {args.split!r}, questions 0..{args.n - 1}, "
                f"max_new_tokens {args.max_new_tokens}, prompt: {prompt}",
                flush=True,
            )
            if args.server_url:
                result = score(args, args.server_url, tokenizer, rows)
            else:
                result = score_on_new_server(args, tokenizer, rows)
            wall = time.monotonic() - start
            write_report(out, args, result, wall)
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr, flush=True)
            return 130
        except USER_ERRORS as err:
            print(f"error: {first_line(err)}", file=sys.stderr, flush=True)
            return 2
        except Exception as err:  # a server that would not start, a failed request
            print(f"error: {first_line(err, with_type=True)}", file=sys.stderr, flush=True)
            return 1
    fmt = "chat template" if result.chat_template else "bare question"
    print(f"[eval] {result.summary()} (prompt: {fmt}; generation+scoring {result.seconds:.1f} s)", flush=True)
    print(f"[eval] report: {out} (wall {wall:.1f} s)", flush=True)
    return 0


def main() -> None:
    raise SystemExit(run(sys.argv[1:]))
