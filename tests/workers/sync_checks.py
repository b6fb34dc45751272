"""torchrun worker for tests/integration/test_weight_sync.py: an FSDP trainer talking to a real vLLM server.

Modes (results go to ``--out``, written by rank 0):

* ``logprobs``: each rank samples completions through ``RemoteInferenceClient.agenerate`` at
  every ``--temperatures`` value, then ``FSDPEngine.forward`` recomputes the sampled
  tokens' logprobs at that temperature on the same weights -> ``logprobs.pt``.
* ``truncated``: the same at T=1 with ``--top-p``/``--top-k``, recomputed by ``PPOActor.compute_logp``
  with and without ``truncation_replay``, plus each token's outside-the-kept-set flag -> ``truncated.pt``.
* ``update``: train a few SFT steps on a fixed batch, export the weights (HF),
  push them with ``RolloutController.push_weights`` (``--sync disk`` or ``collective``) and record the
  server's greedy continuations of ``--prompts`` before and after -> ``update.pt``.
  ``--allocation`` picks the trainer's backend and layout (default ``fsdp:d2``).
* ``delta``: 5 rounds of (SFT step, collective push in delta mode: xor, xor, xor in fp32, then
  sparse, sparse cast to bf16; an anchor every 3), then the server's copy of the last update
  (sha256 per tensor, ``tandemrl_delta_digest``) and its logprobs, and the same after a whole
  fp32 (``delta="none"``) push of the same weights -> ``delta.pt``.
* ``leave`` (one rank): the first collective update's receive request fails on the client after the
  trainer posted its broadcasts; the pusher makes the server leave the group instead of waiting out
  its timeout, and the next update works -> ``leave.pt``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from tandemrl.algorithms.ppo import PPOActor
from tandemrl.algorithms.sft import SFTActor
from tandemrl.algorithms.truncation import truncated_logprobs
from tandemrl.api.engine import TrainEngine
from tandemrl.api.inference import HttpRequest, ModelRequest, ModelResponse, WeightUpdateMeta
from tandemrl.api.types import FinetuneSpec, SaveLoadMeta, TensorDict
from tandemrl.configs.backends import parse_allocation
from tandemrl.configs.engine import OptimizerConfig, TrainEngineConfig
from tandemrl.configs.ppo import PPOActorConfig
from tandemrl.configs.rollout import InferenceClientConfig
from tandemrl.engines.registry import engine_class
from tandemrl.engines.teardown import destroy_process_groups
from tandemrl.inference.http import HttpClient, InferenceServerError
from tandemrl.inference.remote import RemoteInferenceClient
from tandemrl.models.functional import gather_logprobs, next_token_labels
from tandemrl.rollout.controller import RolloutController
from tandemrl.weights.plan import collective_update
from tandemrl.weights.wire import parse_buckets_json

GREEDY_TOKENS = 12  # greedy continuation length compared with transformers


def make_engine(
    model: str,
    lr: float,
    allocation: str = "fsdp:d2",
    mixed_precision: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> TrainEngine:
    """An SFT engine of the backend and layout ``allocation`` names (the engine registry picks the class);
    fp32 compute unless ``mixed_precision`` says otherwise; ``overrides``: dotted TrainEngineConfig fields."""
    from parity_checks import apply_overrides

    opt = OptimizerConfig(lr=lr, gradient_clipping=0.0)
    cfg = TrainEngineConfig(path=model, mixed_precision=mixed_precision, optimizer=opt)
    apply_overrides(cfg, overrides or {})
    component = parse_allocation(allocation).train
    engine = engine_class(component.backend)(cfg)
    engine.create_process_group(component.strategy)
    engine.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=1))
    return engine


class RecordingClient(HttpClient):
    """The real HTTP client, also keeping every request body it sends to ``/collective_rpc``."""

    def __init__(self) -> None:
        super().__init__("sync-checks")
        self.rpcs: list[dict[str, Any]] = []

    async def send(self, addr: str, req: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        if req.path == "/collective_rpc" and req.json is not None:
            self.rpcs.append(req.json)
        return await super().send(addr, req, *args, **kwargs)


def make_rollout(addr: str, client: HttpClient | None = None, setup_timeout: float = 60.0) -> RemoteInferenceClient:
    """A client of the server at ``addr``; ``initialize`` waits up to ``setup_timeout`` for it to be healthy."""
    config = InferenceClientConfig(request_retries=1, request_timeout=300.0, setup_timeout=setup_timeout)
    rollout = RemoteInferenceClient.for_backend("vllm", config, http_client=client)
    rollout.initialize([addr])
    return rollout


def generate(rollout: RemoteInferenceClient, reqs: list[ModelRequest]) -> list[ModelResponse]:
    async def run() -> list[ModelResponse]:
        return list(await asyncio.gather(*(rollout.agenerate(r) for r in reqs)))

    return asyncio.run(run())


def padded(seqs: list[list[int]]) -> TensorDict:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = True
    return {"input_ids": ids, "attention_mask": mask}


def gather_to_rank0(obj: object) -> list[object]:
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------- logprobs


def sampling_requests(
    args: argparse.Namespace, vocab: int, g: torch.Generator, tag: str, **sampling: Any
) -> list[ModelRequest]:
    """``args.samples`` random prompts of 6-15 tokens, each to run ``args.new_tokens`` tokens (no EOS stop)."""
    reqs = []
    for i in range(args.samples):
        prompt = torch.randint(3, vocab, (int(torch.randint(6, 16, (1,), generator=g)),), generator=g)
        req = ModelRequest(rid=f"{tag}-{i}", input_ids=prompt.tolist(), metadata={"ignore_eos": True})
        req.gconfig = req.gconfig.new(max_new_tokens=args.new_tokens, **sampling)
        reqs.append(req)
    return reqs


def generated_positions(
    args: argparse.Namespace, resps: list[ModelResponse], recomputed: dict[str, torch.Tensor]
) -> dict[str, list[float]]:
    """The server's logprobs and each [B, L] next-token aligned recomputation, on the generated tokens."""
    out: dict[str, list[float]] = {"server": [], **{k: [] for k in recomputed}}
    for i, r in enumerate(resps):
        assert r.output_len == args.new_tokens, (r.output_len, r.stop_reason)
        # Position t holds log p(token t + 1 | tokens <= t).
        span = slice(r.input_len - 1, r.input_len - 1 + r.output_len)
        for k, v in recomputed.items():
            out[k] += v[i, span].tolist()
        out["server"] += r.output_logprobs
    return out


def logprobs(args: argparse.Namespace) -> None:
    """Server (behaviour) logprobs vs the trainer's recomputation, per temperature."""
    engine = make_engine(args.model, lr=1e-4)
    bf16 = make_engine(args.model, lr=1e-4, mixed_precision="bfloat16")  # the default: bf16 compute
    rollout = make_rollout(args.addr)
    vocab = int(engine.model_config.vocab_size)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1000 + rank)
    result: dict[float, dict[str, list[float]]] = {}
    try:
        for temp in args.temperatures:
            resps = generate(rollout, sampling_requests(args, vocab, g, f"lp-{rank}-{temp}", temperature=temp))

            def post_hook(logits: torch.Tensor, mb: TensorDict, temp: float = temp) -> torch.Tensor:
                return gather_logprobs(logits, next_token_labels(mb["input_ids"], mb["cu_seqlens"]), temp)

            def raw_hook(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
                return gather_logprobs(logits, next_token_labels(mb["input_ids"], mb["cu_seqlens"]), 1.0)

            batch = padded([r.input_tokens + r.output_tokens for r in resps])
            recomputed = engine.forward(batch, post_hook=post_hook)
            raw = engine.forward(batch, post_hook=raw_hook)  # ignoring the temperature (a control)
            in_bf16 = bf16.forward(batch, post_hook=post_hook)
            result[temp] = generated_positions(
                args, resps, {"trainer": recomputed, "trainer_raw": raw, "trainer_bf16": in_bf16}
            )
    finally:
        rollout.destroy()
    gathered = gather_to_rank0(result)
    if rank == 0:
        merged = {t: {k: sum((part[t][k] for part in gathered), []) for k in result[t]} for t in result}
        torch.save(merged, os.path.join(args.out, "logprobs.pt"))


def truncated(args: argparse.Namespace) -> None:
    """Sampling at T=1 with top-p/top-k: the server's logprobs vs PPOActor.compute_logp with and without
    ``truncation_replay`` (fp32 trainer), and whether each token fell outside the trainer's kept set."""
    engine = make_engine(args.model, lr=1e-4)
    rollout = make_rollout(args.addr)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(2000 + rank)
    sampling = {"temperature": 1.0, "top_p": args.top_p, "top_k": args.top_k}
    try:
        resps = generate(
            rollout, sampling_requests(args, int(engine.model_config.vocab_size), g, f"tr-{rank}", **sampling)
        )
    finally:
        rollout.destroy()
    batch = padded([r.input_tokens + r.output_tokens for r in resps])
    replay = PPOActorConfig(truncation_replay=True, top_p=args.top_p, top_k=args.top_k)
    replayed = PPOActor(replay, engine).compute_logp(batch)
    full = PPOActor(PPOActorConfig(), engine).compute_logp(batch)

    def outside_hook(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
        labels = next_token_labels(mb["input_ids"], mb["cu_seqlens"])
        return truncated_logprobs(logits, labels, 1.0, args.top_k, args.top_p)[1].float()

    outside = engine.forward(batch, post_hook=outside_hook)
    out = generated_positions(args, resps, {"replay": replayed, "full": full, "outside": outside})
    gathered = gather_to_rank0(out)
    if rank == 0:
        merged = {k: sum((part[k] for part in gathered), []) for k in out}
        torch.save(merged, os.path.join(args.out, "truncated.pt"))


# ----------------------------------------------------------------------------- update


def memorize_batch(vocab: int, seed: int) -> TensorDict:
    """Rows the SFT steps fit, so the trained model's greedy outputs differ from the original's."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 24), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids, dtype=torch.bool),
        "loss_mask": torch.ones_like(ids),
    }


def greedy_outputs(rollout: RemoteInferenceClient, prompts: list[list[int]]) -> list[list[int]]:
    reqs = []
    for i, p in enumerate(prompts):
        req = ModelRequest(rid=f"greedy-{i}", input_ids=list(p), metadata={"ignore_eos": True})
        req.gconfig = req.gconfig.new(greedy=True, max_new_tokens=GREEDY_TOKENS)
        reqs.append(req)
    return [r.output_tokens for r in generate(rollout, reqs)]


def version_label(rollout: RemoteInferenceClient) -> str:
    b = rollout.backend
    return str(rollout.http.send_sync(rollout.addresses[0], b.build_version_get())["weight_version"])


def update(args: argparse.Namespace) -> None:
    """Train, export, update the server by ``args.sync``; record greedy outputs around the update."""
    lora = (
        {"lora.rank": args.lora_rank, "lora.alpha": 2.0 * args.lora_rank, "lora.serve": args.lora_serve}
        if args.lora_rank
        else {}
    )
    engine = make_engine(args.model, lr=args.lr, allocation=args.allocation, overrides=lora)
    client = RecordingClient()
    rollout = make_rollout(args.addr, client)
    rank = dist.get_rank()
    with open(args.prompts) as f:
        prompts = json.load(f)
    if args.sync == "disk":
        meta = WeightUpdateMeta.from_disk(os.path.join(args.out, "sync"), "weight_sync", "disk")
    else:
        meta = collective_update(
            parse_allocation("vllm:d1+fsdp:d2"),
            group_addr="127.0.0.1",
            comm_backend="gloo",
            bucket_size_mb=args.bucket_mb,
        )
    controller = RolloutController(rollout, engine, rollout.config, meta)
    record: dict[str, object] = {"meta": {"type": meta.type, "bucket_size_mb": meta.bucket_size_mb}}
    try:
        batch = memorize_batch(int(engine.model_config.vocab_size), seed=7)
        dp_rank, dp_size = engine.data_parallel_rank, engine.data_parallel_world_size  # TP peers share rows
        shard = {k: v[dp_rank::dp_size] for k, v in batch.items()}
        record["losses"] = [SFTActor(engine).train_lm(shard)["loss"] for _ in range(args.steps)]
        engine.save(SaveLoadMeta(path=os.path.join(args.out, "exported"), weight_format="hf"))
        if rank == 0:
            record["before"] = greedy_outputs(rollout, prompts)
            record["label_before"] = version_label(rollout)
        dist.barrier()
        start = time.perf_counter()
        controller.push_weights()  # the controller's meta; labelled get_version() + 1, every side set to it
        record["update_seconds"] = time.perf_counter() - start
        record["rank_versions"] = gather_to_rank0((engine.get_version(), rollout.get_version()))
        if rank == 0:
            s = controller._pusher.last_stats
            assert s is not None
            record["sync"] = {"bytes": s.bytes, "full_bytes": s.full_bytes, "seconds": s.seconds, "adapter": s.adapter}
            record["after"] = greedy_outputs(rollout, prompts)
            record["label_after"] = version_label(rollout)
            record["client_version"] = rollout.get_version()
            # Tensors per bucket, as the server was told in its tandemrl_recv_weights call(s).
            recv = [r for r in client.rpcs if r["method"] == "tandemrl_recv_weights"]
            record["recv_rpcs"] = len(recv)  # one per update: every bucket's specs in one call
            record["bucket_sizes"] = [len(b) for r in recv for b in parse_buckets_json(r["kwargs"]["meta_json"])]
            record["n_params"] = len(engine.hf_param_specs())
        dist.barrier()
    finally:
        controller.destroy()  # closes the weight-update group
        rollout.destroy()
        client.close()
    if rank == 0:
        torch.save(record, os.path.join(args.out, "update.pt"))


# ------------------------------------------------------------------------------ delta


def greedy_logprobs(rollout: RemoteInferenceClient, prompts: list[list[int]]) -> list[list[float]]:
    """Greedy continuations' logprobs, one request at a time (the same batch shape every call)."""
    out = []
    for i, p in enumerate(prompts):
        req = ModelRequest(rid=f"lp-{i}", input_ids=list(p), metadata={"ignore_eos": True})
        req.gconfig = req.gconfig.new(greedy=True, max_new_tokens=GREEDY_TOKENS)
        out.append(generate(rollout, [req])[0].output_logprobs)
    return out


def export_digests(engine: TrainEngine, dtype: torch.dtype) -> dict[str, str]:
    """Collective: sha256 of each exported tensor's bytes, floats cast to ``dtype``."""
    out = {}
    for n, t in engine.iter_hf_params():
        t = t.to(dtype) if t.is_floating_point() else t
        out[n] = hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
    return out


def delta(args: argparse.Namespace) -> None:
    engine = make_engine(args.model, lr=args.lr)
    rollout = make_rollout(args.addr)
    rank = dist.get_rank()
    prompts = [[5 + i, 17, 42, 99, 7 + 3 * i] for i in range(4)]
    meta = collective_update(
        parse_allocation("vllm:d1+fsdp:d2"), group_addr="127.0.0.1", comm_backend="gloo",
        bucket_size_mb=1, delta="xor", anchor_every=3,
    )  # fmt: skip
    controller = RolloutController(rollout, engine, rollout.config, meta)
    pusher = controller._pusher
    record: dict[str, Any] = {"updates": []}
    rpc = HttpRequest("POST", "/collective_rpc", {"method": "tandemrl_delta_digest"}, 120.0)
    try:
        if rank == 0:
            record["original"] = greedy_logprobs(rollout, prompts)
        batch = memorize_batch(int(engine.model_config.vocab_size), seed=7)
        shard = {k: v[rank::2] for k, v in batch.items()}
        for kind, dtype in [("xor", None)] * 3 + [("sparse", "bfloat16")] * 2:
            SFTActor(engine).train_lm(shard)
            controller.push_weights(meta=dataclasses.replace(meta, delta=kind, dtype=dtype))
            if rank == 0:
                s = pusher.last_stats
                assert s is not None
                record["updates"].append((kind, s.bytes, s.full_bytes, s.changed, s.elements))
        digests = export_digests(engine, torch.bfloat16)
        stats = engine.export_stats()
        if rank == 0:
            record["stats"] = {k: v for k, v in stats.items() if k.startswith("weight_sync/")}
            record["trainer"] = digests
            record["server"] = rollout.http.send_sync(rollout.addresses[0], rpc)["results"][0]
            record["after_delta"] = greedy_logprobs(rollout, prompts)
        # The same weights, whole and in fp32: the bf16 server casts them itself.
        controller.push_weights(meta=dataclasses.replace(meta, delta="none"))
        if rank == 0:
            record["after_full"] = greedy_logprobs(rollout, prompts)
            record["server_after_full"] = rollout.http.send_sync(rollout.addresses[0], rpc)["results"][0]
        whole_again(args, engine, rollout, controller, meta, (shard, prompts), record)
        dist.barrier()
    finally:
        controller.destroy()
        rollout.destroy()
    if rank == 0:
        torch.save(record, os.path.join(args.out, "delta.pt"))


def whole_again(
    args: argparse.Namespace,
    engine: TrainEngine,
    rollout: RemoteInferenceClient,
    controller: RolloutController,
    meta: WeightUpdateMeta,
    data: tuple[dict[str, torch.Tensor], list[list[int]]],
    record: dict[str, Any],
) -> None:
    """After a whole update: one step, a second whole update (into both sides' kept buffers), then the same
    weights by disk; records rank 0's buffer addresses around the second update and what each serves."""
    (shard, prompts), pusher, rank = data, controller._pusher, dist.get_rank()
    ptrs = [b.data_ptr() for b in pusher._pack_buffers]
    SFTActor(engine).train_lm(shard)
    controller.push_weights(meta=dataclasses.replace(meta, delta="none"))
    if rank == 0:
        record["pack_buffers"] = (ptrs, [b.data_ptr() for b in pusher._pack_buffers])
        record["after_whole2"] = greedy_logprobs(rollout, prompts)
    disk = WeightUpdateMeta.from_disk(os.path.join(args.out, "sync"), "weight_sync", "disk")
    controller.push_weights(meta=disk)
    if rank == 0:
        record["after_disk"] = greedy_logprobs(rollout, prompts)


# ------------------------------------------------------------------------------ leave


class FailFirstReceive(RecordingClient):
    """``RecordingClient`` whose first weight receive fails on the client, before the server sees it:
    what a pooled connection the server had just closed did to a real run."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    async def send(self, addr: str, req: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        body = req.json or {}
        if req.path == "/collective_rpc" and body.get("method") == "tandemrl_recv_weights" and not self.dropped:
            self.dropped += 1
            detail = "ServerDisconnectedError: Server disconnected"
            raise InferenceServerError(addr, req.method, req.path, detail, retryable=True)
        return await super().send(addr, req, *args, **kwargs)


def leave(args: argparse.Namespace) -> None:
    """One trainer rank; its first collective update fails after the broadcasts were posted, the next works."""
    engine = make_engine(args.model, lr=args.lr, allocation="fsdp:d1")
    client = FailFirstReceive()
    rollout = make_rollout(args.addr, client)
    meta = collective_update(
        parse_allocation("vllm:d1+fsdp:d1"), group_addr="127.0.0.1", comm_backend="gloo", bucket_size_mb=1
    )
    controller = RolloutController(rollout, engine, rollout.config, meta)
    prompts = [[5 + i, 17, 42, 99, 7 + 3 * i] for i in range(4)]
    record: dict[str, Any] = {"label_before": version_label(rollout)}
    try:
        SFTActor(engine).train_lm(memorize_batch(int(engine.model_config.vocab_size), seed=7))
        try:
            controller.push_weights()
        except InferenceServerError as e:
            record["error"] = str(e)
        record["label_failed"] = version_label(rollout)
        record["generates_after_failure"] = greedy_outputs(rollout, prompts)
        controller.push_weights()
        record["label_after"] = version_label(rollout)
        record["versions"] = (engine.get_version(), rollout.get_version())
        record["rpcs"] = [r["method"] for r in client.rpcs]
    finally:
        controller.destroy()
        rollout.destroy()
        client.close()
    torch.save(record, os.path.join(args.out, "leave.pt"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["logprobs", "truncated", "update", "delta", "leave"])
    p.add_argument("--model", required=True)
    p.add_argument("--addr", required=True, help="host:port of the vLLM server")
    p.add_argument("--out", required=True)
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--samples", type=int, default=4, help="completions per rank and temperature")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--top-p", type=float, default=0.8, help="truncated mode's sampling top_p")
    p.add_argument("--top-k", type=int, default=20, help="truncated mode's sampling top_k")
    p.add_argument("--sync", choices=["disk", "collective"], default="disk")
    p.add_argument("--prompts", help="JSON list of token-id prompts for the greedy comparison")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bucket-mb", type=int, default=8)
    p.add_argument("--allocation", default="fsdp:d2", help="training allocation of the update mode's engine")
    p.add_argument("--lora-rank", type=int, default=0, help="update mode: train LoRA adapters of this rank")
    p.add_argument("--lora-serve", default="auto", help="update mode: lora.serve (auto, adapter, merged)")
    a = p.parse_args()
    {"logprobs": logprobs, "truncated": truncated, "update": update, "delta": delta, "leave": leave}[a.mode](a)
    destroy_process_groups()
