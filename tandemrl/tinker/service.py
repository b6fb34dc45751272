"""What ``tandemrl tinker-serve`` does for each Tinker call, apart from HTTP (``routes.py``).

Asynchronous calls return a request id at once; the work runs later and its result is fetched
with ``retrieve_future``. Training calls (create_model, forward_backward, optim_step, the saves
and loads) run on ONE worker thread in the order they were submitted, so their futures resolve
in submission order; samples run concurrently against vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from tandemrl.engines.lora import merge_adapter_dir
from tandemrl.tinker import wire
from tandemrl.tinker.listing import Listing
from tandemrl.tinker.ranks import Ranks
from tandemrl.tinker.sampler import VLLMSampler
from tandemrl.tinker.trainer import EngineTrainer, targets_of
from tandemrl.tinker.wire import NotFound, UserError
from tandemrl.tinker.worker import TrainWorker

logger = logging.getLogger(__name__)
STOPPING = "tinker-serve is stopping; this call did not finish"
UNSUPPORTED_SAMPLE_FIELDS = (
    "topk_sample_logprobs",
    "target_prompt_logprobs",
    "prompt_alt_tokens_k",
    "prompt_logprobs_last_n",
)


class Gone(UserError):
    """A session that has finished (HTTP 410: the SDK's heartbeat loop stops on it)."""


@dataclass
class Result:
    """A finished call: JSON, or proto bytes (forward_backward and sample)."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None


@dataclass
class ModelInfo:
    session_id: str
    rank: int


@dataclass
class Session:
    last_seen: float  # time.monotonic() of its last heartbeat or call
    finished: str = ""  # why it ended: the SDK's finish reason, or the missed heartbeats


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _log_failure(fut: asyncio.Future[Any]) -> None:
    err = None if fut.cancelled() else fut.exception()
    if err is not None:
        logger.error("tinker-serve: unloading a finished session's client failed: %s", _first_line(err))


def vocab_size_of(model_dir: str) -> int:
    """The model's embedding rows: token ids must be below it."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir).get_text_config().vocab_size)


def check_tokens(ids: Any, vocab_size: int, where: str) -> None:
    """One line naming ``where`` when a token id is outside ``0..vocab_size-1``."""
    bad = [int(t) for t in ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise UserError(f"{where}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1}, {vocab_size} ids)")


DIMUON = (
    "Tinker does not publish Dimuon's update rule (its matrix-sign iteration count and normalisation epsilon are "
    "internal constants)"
)


def check_optimizer(config: Any, field: str) -> None:
    """AdamW is the one optimizer served: a one-line UserError naming any other (``type`` of an SDK optimizer
    config or params object)."""
    kind = config.get("type", "adamw") if isinstance(config, dict) else "adamw"
    if kind != "adamw":
        why = DIMUON if kind == "dimuon" else "it runs AdamW only"
        raise UserError(f"{field}: optimizer {kind!r} is not served by tinker-serve: {why}; use AdamW (AdamParams)")


def adapter_shape(directory: str) -> tuple[int, tuple[str, ...]]:
    """(rank, target module names) of a saved adapter."""
    with open(os.path.join(directory, "adapter_config.json")) as f:
        config = json.load(f)
    return int(config["r"]), tuple(config["target_modules"])


class TinkerService:
    """The API over ``trainer`` (rank 0's; its calls reach every rank through ``Ranks``): LoRA clients, or one
    full-weight client when the trainer was built with ``full_weight``. A session that finishes (the SDK's ``ServiceClient.close``) or sends no heartbeat and no call for
    ``session_timeout`` seconds (0: never) ends, and its training clients are unloaded. ``start`` reads the vLLM
    server's context length, which bounds every datum and prompt."""

    def __init__(
        self,
        trainer: EngineTrainer,
        model_name: str,
        vllm_addr: str,
        out_dir: str,
        max_adapters: int = 4,
        session_timeout: float = 60.0,
        merged: bool = False,
    ) -> None:
        model_dir = trainer.model_dir
        self.model_dir, self.model_name, self.out_dir = model_dir, model_name, out_dir
        self.session_timeout = session_timeout
        self.vocab_size = vocab_size_of(model_dir)
        self.max_model_len = 0  # the vLLM server's, read by start(); 0: not known, not checked
        self.trainer, self.ranks = trainer, Ranks(trainer)
        self.full_weight = bool(trainer.full_weight)
        self.max_adapters = 1 if self.full_weight else max_adapters
        # LoRA sampled as merged weights (--serve merged): each adapter merged into the base, loaded whole
        self.merged = merged and not self.full_weight
        # full-weight mode: sampler weights name -> (HF directory, save version); every save is a new version
        self.full_dirs: dict[str, tuple[str, int]] = {}
        self.saves = 0
        self.listing = Listing(model_name)
        self.sampler = VLLMSampler(vllm_addr, base_dir=model_dir)
        self.worker = TrainWorker()
        self.futures: dict[str, asyncio.Future[Result]] = {}
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, ModelInfo] = {}
        self.samplers: dict[str, str | None] = {}  # sampling session -> adapter name (None: base model)
        self.checkpoints: dict[str, str] = {}  # tinker:// path -> directory

    # ------------------------------------------------------------------ plumbing
    def _submit(self, work: Callable[[], Awaitable[Result]]) -> dict[str, Any]:
        rid = uuid.uuid4().hex
        self.futures[rid] = asyncio.ensure_future(work())
        return {"request_id": rid}

    def _train(self, name: str, fn: Callable[[], Result]) -> dict[str, Any]:
        """Queue ``fn`` on the training worker (FIFO: submission order)."""
        fut = self.worker.submit(name, fn)

        async def wait() -> Result:
            return await fut

        return self._submit(wait)

    def model(self, model_id: str) -> ModelInfo:
        if model_id not in self.models:
            raise NotFound(f"model_id: unknown model {model_id!r} (create it with create_lora_training_client)")
        self.listing.touch(model_id)
        info = self.models[model_id]
        self.sessions[info.session_id].last_seen = time.monotonic()
        return info

    def check_base(self, base_model: str | None) -> None:
        """The served name, or the model directory (the name the SDK loads a sampler's tokenizer from)."""
        if base_model is not None and base_model not in (self.model_name, self.model_dir):
            raise NotFound(f"base_model: {base_model!r} is not served here (this server serves {self.model_name!r})")

    async def start(self) -> None:
        self.max_model_len = await self.sampler.max_model_len()

    async def retrieve(self, rid: str, wait_s: float = 30.0) -> Result | dict[str, Any]:
        """The result, a ``try_again`` reply while it runs, or a failed-request reply."""
        fut = self.futures.get(rid)
        if fut is None:
            raise NotFound(f"request_id: unknown request {rid!r}")
        done, _ = await asyncio.wait([fut], timeout=wait_s)
        if not done:
            return {"type": "try_again", "request_id": rid, "queue_state": "active"}
        self.futures.pop(rid, None)  # a result is fetched once
        if fut.cancelled():
            return {"error": STOPPING, "category": "server"}
        err = fut.exception()
        if err is not None:
            category = "user" if isinstance(err, ValueError) else "server"
            return {"error": _first_line(err), "category": category}
        return fut.result()

    # ------------------------------------------------------------------ sessions and models
    def create_session(self) -> dict[str, Any]:
        sid = "session-" + uuid.uuid4().hex[:12]
        self.sessions[sid] = Session(time.monotonic())
        return {"type": "create_session", "session_id": sid}

    def session(self, session_id: str) -> Session:
        """A live session, seen now; 404 if unknown, 410 if it has finished."""
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"session_id: unknown session {session_id!r}")
        if session.finished:
            raise Gone(f"session_id: session {session_id!r} has finished ({session.finished})")
        session.last_seen = time.monotonic()
        return session

    def session_heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        self.session(str(body.get("session_id")))
        return {"type": "session_heartbeat"}

    def finish_session(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """The SDK's ``ServiceClient.close(status)``: the session ends and its training clients are unloaded."""
        if session_id not in self.sessions:
            raise NotFound(f"session_id: unknown session {session_id!r}")
        if not self.sessions[session_id].finished:  # the first reason wins, as the SDK documents
            self._end_session(session_id, str((body.get("reason") or {}).get("type") or "closed"))
        return {}

    def expire_sessions(self) -> list[str]:
        """End every session without a heartbeat or call for ``session_timeout`` seconds; their ids."""
        if self.session_timeout <= 0:
            return []
        now = time.monotonic()
        idle = [sid for sid, s in self.sessions.items() if not s.finished and now - s.last_seen > self.session_timeout]
        for sid in idle:
            self._end_session(sid, f"no heartbeat for {self.session_timeout:g}s")
        return idle

    async def expire_forever(self) -> None:
        """``expire_sessions`` every quarter of the timeout (a task ``tinker-serve`` runs while it serves)."""
        while self.session_timeout > 0:
            await asyncio.sleep(max(self.session_timeout / 4, 0.5))
            for sid in self.expire_sessions():
                logger.info("tinker-serve: session %s ended: %s", sid, self.sessions[sid].finished)

    def _end_session(self, session_id: str, why: str) -> None:
        self.sessions[session_id].finished = why
        for model_id in [m for m, info in self.models.items() if info.session_id == session_id]:
            self.models.pop(model_id)
            fut = self.worker.submit("unload_model", partial(self.ranks.run, "remove", model_id))
            fut.add_done_callback(_log_failure)

    def create_model(self, body: dict[str, Any]) -> dict[str, Any]:
        self.check_base(body.get("base_model"))
        check_optimizer(body.get("optimizer_config"), "optimizer_config")
        lora = body.get("lora_config")
        targets: tuple[str, ...] = ()
        if self.full_weight:
            rank = 0  # the SDK always sends a LoRA config; a --full-weight server trains every weight
        elif not lora:
            raise UserError("lora_config: tinker-serve trains LoRA adapters only; pass a rank")
        else:
            rank = int(lora.get("rank", 0))
            if not 1 <= rank <= self.trainer.max_rank:
                raise UserError(f"lora_config.rank: {rank} is outside 1..{self.trainer.max_rank} (--max-lora-rank)")
            targets = targets_of(bool(lora.get("train_attn", True)), bool(lora.get("train_mlp", True)))
        model_id = self._new_model(body, rank)
        seed = (lora or {}).get("seed")

        def create() -> Result:
            self.ranks.run("add", model_id, rank, targets, seed)
            return Result(json={"type": "create_model", "model_id": model_id})

        return self._train("create_model", create)

    def _new_model(self, body: dict[str, Any], rank: int) -> str:
        """Register a training client under the id the SDK derives: ``<session>:train:<model_seq_id>``."""
        if self.full_weight and self.models:
            raise UserError(
                f"create_model: full-weight client {next(iter(self.models))!r} is live and --full-weight trains one "
                "at a time; unload it first"
            )
        self.expire_sessions()
        if len(self.models) >= self.max_adapters:
            raise UserError(
                f"create_model: {len(self.models)} LoRA training clients are live, the cap (--max-adapters); "
                "unload one first"
            )
        session_id = str(body.get("session_id"))
        self.session(session_id)
        model_id = f"{session_id}:train:{int(body.get('model_seq_id', 0))}"
        if model_id in self.models:
            raise UserError(f"model_seq_id: model {model_id!r} exists already")
        self.models[model_id] = ModelInfo(session_id, rank)
        self.listing.add_run(model_id, None if self.full_weight else rank, body.get("user_metadata"))
        return model_id

    def get_info(self, model_id: str) -> dict[str, Any]:
        info = self.model(model_id)
        return {
            "type": "get_info",
            "model_id": model_id,
            # the SDK makes the sampling clients of save_weights_and_get_sampling_client with model_data.model_name
            # as their base model and loads their tokenizer from it: the model directory, which loads
            "model_data": {
                "arch": "full" if self.full_weight else "lora",
                "model_name": self.model_dir,
                "tokenizer_id": self.model_dir,
            },
            "is_lora": not self.full_weight,
            "lora_rank": None if self.full_weight else info.rank,
            "model_name": self.model_name,
        }

    def unload_model(self, model_id: str) -> dict[str, Any]:
        self.model(model_id)
        self.models.pop(model_id)

        def unload() -> Result:
            self.ranks.run("remove", model_id)
            return Result(json={"type": "unload_model", "model_id": model_id})

        return self._train("unload_model", unload)

    # ------------------------------------------------------------------ training
    def forward_backward(self, body: bytes) -> dict[str, Any]:
        model_id, loss_fn, config, forward_only, data = wire.parse_forward_backward(body)
        self.model(model_id)
        self.check_data(data)

        def run() -> Result:
            outputs, metrics = self.ranks.run("forward_backward", model_id, data, loss_fn, config, not forward_only)
            return Result(proto=wire.forward_backward_output(outputs, metrics))

        return self._train("forward" if forward_only else "forward_backward", run)

    def check_data(self, data: list[dict[str, Any]]) -> None:
        """Every datum fits the sampler's context and names only token ids of the vocabulary."""
        for i, datum in enumerate(data):
            n = int(datum["input_ids"].numel())
            if self.max_model_len and n > self.max_model_len:
                raise UserError(
                    f"data[{i}].model_input: {n} tokens, longer than the sampler's context "
                    f"(max_model_len {self.max_model_len})"
                )
            check_tokens(datum["input_ids"].tolist(), self.vocab_size, f"data[{i}].model_input")
            check_tokens(datum["target_tokens"].tolist(), self.vocab_size, f"data[{i}].loss_fn_inputs.target_tokens")

    def optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        model_id = str(body.get("model_id"))
        self.model(model_id)
        adam = body.get("adam_params")
        if adam is None:
            check_optimizer(body.get("optimizer_params"), "optim_step.optimizer_params")
            raise UserError("optim_step: adam_params missing (tinker-serve runs AdamW only)")
        lr = float(adam.get("learning_rate", 1e-4))
        if not (math.isfinite(lr) and lr >= 0):
            raise UserError(f"optim_step: adam_params.learning_rate must be a finite number >= 0, got {lr}")

        def run() -> Result:
            return Result(json={"type": "optim_step", "metrics": self.ranks.run("optim_step", model_id, adam)})

        return self._train("optim_step", run)

    def _ckpt(self, model_id: str, kind: str, name: str | None) -> tuple[str, str]:
        name = name or "auto-" + uuid.uuid4().hex[:8]
        if "/" in name or name.startswith("."):
            raise UserError(f"path: checkpoint name {name!r} must be a plain name (no '/')")
        return f"tinker://{model_id}/{kind}/{name}", os.path.join(self.out_dir, model_id, kind, name)

    def save_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        model_id = str(body.get("model_id"))
        self.model(model_id)
        path, directory = self._ckpt(model_id, "weights", body.get("path"))

        def run() -> Result:
            self.ranks.run("save_state", model_id, directory)
            self.checkpoints[path] = directory
            self.listing.add_checkpoint(path, directory)
            return Result(json={"type": "save_weights", "path": path})

        return self._train("save_weights", run)

    def load_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        """Into an existing model (``model_id``), or into a new one (``session_id`` + ``model_seq_id``)."""
        path = str(body.get("path"))
        if path not in self.checkpoints:
            raise NotFound(f"path: no checkpoint {path!r} on this server")
        check_optimizer(body.get("optimizer_config"), "optimizer_config")
        directory, optimizer = self.checkpoints[path], bool(body.get("optimizer"))
        created: tuple[int, tuple[str, ...]] | None = None
        if body.get("model_id") is not None:
            model_id = str(body["model_id"])
            self.model(model_id)
        else:
            self.check_base(body.get("base_model"))
            rank, targets = (0, ()) if self.full_weight else adapter_shape(directory)
            model_id, created = self._new_model(body, rank), (rank, targets)

        def run() -> Result:
            if created is not None:
                self.ranks.run("add", model_id, created[0], created[1], None)
            self.ranks.run("load_state", model_id, directory, optimizer)
            return Result(json={"type": "load_weights", "path": path, "model_id": model_id})

        return self._train("load_weights", run)

    def save_weights_for_sampler(self, body: dict[str, Any]) -> dict[str, Any]:
        model_id = str(body.get("model_id"))
        self.model(model_id)
        named = body.get("path") is not None
        path, directory = self._ckpt(model_id, "sampler_weights", body.get("path"))
        adapter = path.removeprefix("tinker://").replace("/", "--")
        fut = self.worker.submit(
            "save_weights_for_sampler", partial(self.ranks.run, "save_for_sampler", model_id, directory)
        )

        async def run() -> Result:
            await fut
            self.checkpoints[path] = directory
            self.listing.add_checkpoint(path, directory)
            await self._register_sampler_weights(adapter, directory, saved=True)
            if named:
                return Result(json={"type": "save_weights_for_sampler", "path": path})
            sid = self._new_sampler(adapter)
            return Result(json={"type": "save_weights_for_sampler", "sampling_session_id": sid, "path": path})

        return self._submit(run)

    # ------------------------------------------------------------------ sampling
    async def _register_sampler_weights(self, name: str, directory: str, saved: bool = False) -> None:
        """LoRA: load the adapter into vLLM under ``name`` (again if it was ``saved`` just now). Full weights: remember
        the directory and a new version of it if ``saved``; a sample loads them."""
        if not self.full_weight and not self.merged:
            await self.sampler.load_adapter(name, directory, reload=saved)
        elif self.full_weight and "/sampler_weights/" not in directory.replace(os.sep, "/"):
            raise UserError(f"model_path: {name!r} is a training state, not sampler weights (save_weights_for_sampler)")
        elif saved or name not in self.full_dirs:
            self.saves += 1
            self.full_dirs[name] = (directory, self.saves)

    @asynccontextmanager
    async def _serving(self, adapter: str | None) -> AsyncIterator[str | None]:
        """The vLLM model name to sample ``adapter`` under; with full or merged weights they are loaded for the while."""
        if not self.full_weight and not self.merged:
            async with self.sampler.adapter(adapter) as served:
                yield served
            return
        if adapter is None:
            async with self.sampler.full_weights(self.model_dir, 0):
                yield None
            return
        merge = partial(merge_adapter_dir, self.model_dir) if self.merged else None
        async with self.sampler.full_weights(*self.full_dirs[adapter], merge=merge):
            yield None

    def _new_sampler(self, adapter: str | None) -> str:
        sid = "sampler-" + uuid.uuid4().hex[:12]
        self.samplers[sid] = adapter
        return sid

    async def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        model_path = body.get("model_path")
        if model_path is None:
            self.check_base(body.get("base_model"))
            return {"type": "create_sampling_session", "sampling_session_id": self._new_sampler(None)}
        if model_path not in self.checkpoints:
            raise NotFound(f"model_path: no saved weights {model_path!r} on this server")
        adapter = str(model_path).removeprefix("tinker://").replace("/", "--")
        await self._register_sampler_weights(adapter, self.checkpoints[model_path])
        return {"type": "create_sampling_session", "sampling_session_id": self._new_sampler(adapter)}

    def get_sampler(self, sid: str) -> dict[str, Any]:
        if sid not in self.samplers:
            raise NotFound(f"sampler_id: unknown sampler {sid!r}")
        adapter = self.samplers[sid]
        path = None if adapter is None else "tinker://" + adapter.replace("--", "/")
        # the SDK loads a sampler's tokenizer from this name (the part before any ':'): the model directory loads
        return {"sampler_id": sid, "base_model": self.model_dir, "model_path": path}

    def sample(self, body: dict[str, Any]) -> dict[str, Any]:
        """Each sequence gets a ``sequence_id`` (``sample_sequence_ids``); ``record_stability_info`` is accepted and
        records nothing (its only reader, ``stable_reinforce``, is refused)."""
        sid = body.get("sampling_session_id")
        if sid is not None:
            if sid not in self.samplers:
                raise NotFound(f"sampling_session_id: unknown sampler {sid!r}")
            adapter = self.samplers[sid]
        else:
            self.check_base(body.get("base_model"))
            adapter = None
        prompt = self._prompt(body)
        n = int(body.get("num_samples", 1))
        if n < 1:
            raise UserError(f"num_samples: must be >= 1, got {n}")
        params = dict(body.get("sampling_params") or {})
        want_prompt_lp, topk = bool(body.get("prompt_logprobs")), int(body.get("topk_prompt_logprobs") or 0)
        if (want_prompt_lp or topk) and len(prompt) < 2:
            raise UserError("prompt_logprobs: the prompt needs at least 2 tokens")

        async def run() -> Result:
            plp, rows = None, None
            async with self._serving(adapter) as served:
                seqs = await self.sampler.sample(prompt, n, params, served)
                if want_prompt_lp or topk:
                    plp, rows = await self.sampler.prompt_logprobs(prompt, served, topk)
            return Result(proto=wire.sample_output(seqs, plp if want_prompt_lp else None, rows, topk))

        reply = self._submit(run)
        reply["sample_sequence_ids"] = [uuid.uuid4().hex for _ in range(n)]
        return reply

    def _prompt(self, body: dict[str, Any]) -> list[int]:
        """A sample request's prompt tokens, after refusing what tinker-serve does not serve."""
        for name in UNSUPPORTED_SAMPLE_FIELDS:
            if body.get(name):
                raise UserError(f"{name}: not supported by tinker-serve (it serves prompt_logprobs and top-k of them)")
        if int(body.get("topk_prompt_logprobs") or 0) < 0:
            raise UserError(f"topk_prompt_logprobs: must be >= 0, got {body['topk_prompt_logprobs']}")
        prompt = wire.prompt_tokens(body.get("prompt") or {})
        check_tokens(prompt, self.vocab_size, "prompt")
        if self.max_model_len and len(prompt) > self.max_model_len:
            context = f"(max_model_len {self.max_model_len})"
            raise UserError(f"prompt: {len(prompt)} tokens, longer than the sampler's context {context}")
        return prompt

    def capabilities(self) -> dict[str, Any]:
        context = self.max_model_len or None
        return {
            "supported_models": [
                {"model_name": self.model_name, "trainable": True, "sampleable": True, "max_context_length": context}
            ]
        }

    # ------------------------------------------------------------------ stopping
    def fail_pending(self) -> int:
        """Cancel every unfinished call (queued, running, or a sample); ``retrieve`` answers them as failed."""
        pending = [fut for fut in self.futures.values() if not fut.done()]
        for fut in pending:
            fut.cancel()
        return len(pending)

    async def drain(self, wait_s: float) -> None:
        """Wait until clients fetched every cancelled call's failure, or ``wait_s`` passed."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while any(f.cancelled() for f in self.futures.values()) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)

    def close(self, wait_s: float = 2.0) -> bool:
        """Stop the worker (waiting up to ``wait_s`` for a running call) and the sampler; True if a call still runs."""
        busy = self.worker.close(wait_s, last=self.ranks.stop)  # the other ranks return once the queue is done
        self.sampler.close()
        return busy
