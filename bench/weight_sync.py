"""Collective weight sync to a real vLLM server over loopback: whole buckets vs delta (xor, sparse).

One trainer process (FSDPEngine, world 1) pushes its weights to a vLLM server it starts, by
``RolloutController.push_weights`` with a gloo weight-update group on 127.0.0.1. Each
timed delta update follows one real AdamW step (SFT loss on random tokens, ``--lr``), so
the delta carries what one optimizer step changes. Figures come from the pusher's own
``weight_sync/*`` record (rank 0's wall time of the whole push: export, pack, encode,
broadcast and the server's in-place load). Also printed: the export+pack time alone, and
the fraction of elements one step changes in the fp32 export and in a bf16 cast of it.
Nothing is asserted.

    python bench/weight_sync.py                        # ~100M Qwen2 (built once, cached), ~5 min
    python bench/weight_sync.py --send-dtype bfloat16  # cast to bf16 before sending
    python bench/weight_sync.py --hidden 512 --layers 8 --intermediate 1536  # the tests' 25M model
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "gsm8k"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tandemrl.utils.cli import ArgumentParser

    ap = ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="GSM8K dir the model's tokenizer is built from.")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--server-dtype", default="bfloat16", help="dtype the server keeps (it casts on load).")
    ap.add_argument("--send-dtype", default=None, help="WeightUpdateMeta.dtype (e.g. bfloat16); default: fp32.")
    ap.add_argument("--bucket-mb", type=int, default=512, help="WeightUpdateMeta.bucket_size_mb.")
    ap.add_argument("--lr", type=float, default=1e-5, help="AdamW lr of the step before each delta update.")
    ap.add_argument("--rounds", type=int, default=3, help="Timed updates per mode.")
    ap.add_argument(
        "--in-flight", type=int, default=None, help="Broadcasts queued at once (tandemrl.weights.push.MAX_IN_FLIGHT)."
    )
    ap.add_argument("--modes", nargs="+", default=["none", "xor", "sparse"], choices=["none", "xor", "sparse"])
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    return a


def build_model(a: argparse.Namespace) -> str:
    from tandemrl.models.make_tiny import ensure_tiny_model

    root = os.environ.get("TANDEMRL_CACHE") or os.path.join("~", ".cache", "tandemrl")
    kw = {"hidden": a.hidden, "layers": a.layers, "intermediate": a.intermediate, "heads": a.heads}
    kw["kv_heads"] = a.kv_heads
    corpus = a.data if os.path.isdir(a.data) else None
    return ensure_tiny_model(Path(root).expanduser() / "tiny-models", "qwen2", corpus_path=corpus, **kw)


def init_single_process_group() -> None:
    """World 1 without torchrun."""
    from tandemrl.api.net import free_port

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def snapshot(engine: Any) -> list[Any]:
    return [t.detach().clone() for _, t in engine.iter_hf_params()]


def changed_fraction(before: list[Any], after: list[Any], dtype: Any) -> float:
    import torch

    ints = {2: torch.int16, 4: torch.int32}
    n = changed = 0
    for x, y in zip(before, after, strict=True):
        bx, by = x.to(dtype).view(ints[dtype.itemsize]), y.to(dtype).view(ints[dtype.itemsize])
        changed += int((bx != by).sum())
        n += x.numel()
    return changed / n


def pack_seconds(engine: Any, bucket_mb: int) -> float:
    """Export and pack every bucket, sending nothing."""
    from tandemrl.weights.push import bucket_plan
    from tandemrl.weights.wire import pack_bucket

    start = time.perf_counter()
    params = engine.iter_hf_params()
    for bucket in bucket_plan(engine.hf_param_specs(), bucket_mb):
        pack_bucket([next(params) for _ in bucket])
    return time.perf_counter() - start


def sft_step(engine: Any, vocab: int, seed: int) -> None:
    import torch

    from tandemrl.algorithms.sft import SFTActor

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (8, 128), generator=g)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids, dtype=torch.bool),
        "loss_mask": torch.ones_like(ids),
    }
    SFTActor(engine).train_lm(batch)


def run(a: argparse.Namespace) -> None:
    import torch

    from tandemrl.api.types import FinetuneSpec
    from tandemrl.configs.backends import parse_allocation
    from tandemrl.configs.engine import OptimizerConfig, TrainEngineConfig
    from tandemrl.configs.rollout import InferenceClientConfig
    from tandemrl.engines.registry import make_engine
    from tandemrl.engines.teardown import destroy_process_groups
    from tandemrl.inference.remote import RemoteInferenceClient
    from tandemrl.inference.server import launch_server
    from tandemrl.inference.vllm import VLLMBackend
    from tandemrl.rollout.controller import RolloutController
    from tandemrl.weights import push
    from tandemrl.weights.plan import collective_update

    if a.in_flight is not None:
        push.MAX_IN_FLIGHT = a.in_flight
    model = build_model(a)
    server = launch_server(VLLMBackend(), model, extra={"max_model_len": 512, "dtype": a.server_dtype})
    print(f"starting vLLM on {model} (log {server.log_file}) ...", flush=True)
    client = controller = None
    try:
        init_single_process_group()
        cfg = TrainEngineConfig(path=model, optimizer=OptimizerConfig(lr=a.lr, gradient_clipping=0.0))
        engine = make_engine("fsdp", cfg)
        engine.create_process_group(parse_allocation("fsdp:d1").train.strategy)
        engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=8))
        n_params = sum(t.numel() for _, t in engine.iter_hf_params())
        vocab = int(engine.model_config.vocab_size)
        print(f"server healthy after {server.wait_healthy(900):.0f}s; {n_params / 1e6:.1f}M parameters", flush=True)
        client = RemoteInferenceClient.for_backend(
            "vllm", InferenceClientConfig(request_retries=0, setup_timeout=60.0, request_timeout=600.0)
        )
        client.initialize([server.address])
        meta = collective_update(
            parse_allocation("vllm:d1+fsdp:d1"), group_addr="127.0.0.1", comm_backend="gloo",
            bucket_size_mb=a.bucket_mb, anchor_every=10**6, dtype=a.send_dtype,
        )  # fmt: skip
        controller = RolloutController(client, engine, client.config, meta)
        print(f"export + pack alone: {statistics.median(pack_seconds(engine, a.bucket_mb) for _ in range(2)):.2f}s")
        before = snapshot(engine)
        sft_step(engine, vocab, seed=0)
        after = snapshot(engine)
        f32, bf16 = changed_fraction(before, after, torch.float32), changed_fraction(before, after, torch.bfloat16)
        print(f"one AdamW step at lr {a.lr}: changed elements {f32:.3f} (fp32 export), {bf16:.3f} (bf16 cast)")
        del before, after
        rows = []
        for mode in a.modes:
            m = dataclasses.replace(meta, delta=mode)
            controller.push_weights(meta=m)  # warm-up (none) / the anchor (delta)
            for r in range(a.rounds):
                if mode != "none":
                    sft_step(engine, vocab, seed=1 + r)
                controller.push_weights(meta=m)
                s = controller.last_push_stats
                assert s is not None
                rows.append((mode, s))
        print(f"\n{'mode':<8}{'moved MB':>10}{'of full':>9}{'seconds':>9}{'GB/s*':>8}{'wire GB/s':>11}{'changed':>9}")
        for mode, s in rows:
            frac = f"{s.changed / s.elements:.3f}" if s.elements else "-"
            print(
                f"{mode:<8}{s.bytes / 1e6:>10.1f}{s.bytes / s.full_bytes:>9.3f}{s.seconds:>9.2f}"
                f"{s.full_bytes / s.seconds / 1e9:>8.2f}{s.bytes / s.seconds / 1e9:>11.2f}{frac:>9}"
            )
        print("* GB/s: bytes of a whole update (in the sent dtype) per second of push; wire: bytes broadcast")
        print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        if controller is not None:
            controller.destroy()
        if client is not None:
            client.destroy()
        server.stop()
        destroy_process_groups()


if __name__ == "__main__":
    from tandemrl.utils.machine import measured_on

    with measured_on("weight_sync"):
        run(parse_args())
