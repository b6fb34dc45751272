"""vLLM worker extension: in-place weight updates from disk or from a trainer broadcast.

Start vLLM with ``--worker-extension-cls tandemrl.inference.vllm_ext.TandemWorkerExtension``
(``VLLMBackend.server_command`` does) and ``VLLM_SERVER_DEV_MODE=1``; the client calls
these methods through ``POST /collective_rpc {"method": ..., "kwargs": {...}}``. vLLM
forwards only JSON strings, so every argument arrives as a string and is cast here.

Every update goes through ``self.reload_weights(weights_iterator=...)`` (vLLM's
layer-wise in-place reload), never ``model.load_weights``: on CPU the linear layers
repack their weights after loading and leave size-0 parameters behind, which a second
plain ``load_weights`` cannot load into; ``reload_weights`` restores the checkpoint-format
parameters, loads, then re-runs the repacking. On GPU it is equally correct.

The broadcast wire format and the process-group rendezvous are defined (and documented)
in ``tandemrl.weights.wire`` and ``tandemrl.weights.group``, which the trainer uses for its side.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tandemrl.weights.delta import receive_delta_buckets
from tandemrl.weights.group import DEFAULT_TIMEOUT_S, destroy_group, join_group
from tandemrl.weights.wire import parse_buckets_json, receive_buckets, unpack_bucket

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class TandemWorkerExtension:
    """Mixed into vLLM's Worker class; ``self`` is the worker (``reload_weights``, ``rank``, ``device``)."""

    # Every attribute name here must be new to vLLM's Worker (vLLM asserts no clash).
    _tandemrl_pg: Any = None
    # Whole updates over host memory land in the last update's buffers (one per bucket): a fresh buffer of a
    # few hundred MB costs more to fault in than to receive. Never shared within one update: vLLM 0.32's
    # layerwise reload keeps the tensors of a layer that loads fewer elements than it holds (padding) until
    # its final pass, so each bucket keeps its own buffer.
    _tandemrl_recv_buffers: list[torch.Tensor] | None = None
    _tandemrl_pg_device: Any = None
    _tandemrl_delta_base: Any = None  # flat buckets of the last delta-mode update (weights.delta)
    _tandemrl_delta_tag: str | None = None  # that update's id
    _tandemrl_delta_specs: Any = None  # its buckets' specs

    if TYPE_CHECKING:  # provided by the vLLM Worker this class is mixed into
        rank: int
        device: torch.device
        model_runner: Any

        def reload_weights(self, *, weights_iterator: Any) -> None: ...

    # ---- disk ------------------------------------------------------------------------------

    def tandemrl_update_from_disk(self, path: str) -> dict[str, Any]:
        """Load every ``*.safetensors`` file in the HF directory ``path`` in place."""
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"tandemrl_update_from_disk: no *.safetensors files in {path!r}")
        start = time.perf_counter()
        counter = _Counter(_iter_safetensors(files))
        self._tandemrl_drop_delta_base()  # a delta must never apply on top of other weights
        self._tandemrl_reload(counter)
        return {"tensors": counter.n, "seconds": round(time.perf_counter() - start, 4)}

    # ---- collective ------------------------------------------------------------------------

    def tandemrl_init_weight_group(
        self,
        host: str,
        port: str,
        world_size: str,
        rank: str,
        backend: str | None = None,
        timeout: str | None = None,
    ) -> dict[str, Any]:
        """Join the trainer's group as rank ``rank`` + this worker's rank (its tp/pp index).

        Blocks until every rank has joined, so the trainer sends this request from a
        background thread while it creates rank 0. ``backend`` defaults to nccl when the
        worker runs on CUDA, else gloo.
        """
        if backend is None:
            backend = "nccl" if getattr(self.device, "type", "cpu") == "cuda" else "gloo"
        destroy_group(self._tandemrl_pg)  # re-joining replaces an old group
        my_rank = int(rank) + int(self.rank)
        timeout_s = float(timeout) if timeout is not None else DEFAULT_TIMEOUT_S
        start = time.perf_counter()
        self._tandemrl_pg = join_group(host, int(port), int(world_size), my_rank, backend, timeout_s)
        self._tandemrl_pg_device = "cpu" if backend == "gloo" else self.device
        return {"rank": my_rank, "backend": backend, "seconds": round(time.perf_counter() - start, 4)}

    def tandemrl_recv_weights(
        self, meta_json: str, delta: str | None = None, tag: str | None = None, base: str | None = None
    ) -> dict[str, Any]:
        """Receive the buckets ``meta_json`` lists (one broadcast each) and load them in place.

        With ``delta`` ("xor"/"sparse") every bucket comes as a header and a payload applied to
        the copy of the update ``base`` (empty: an anchor, every bucket whole); the result is
        kept as update ``tag``.
        """
        if self._tandemrl_pg is None:
            raise RuntimeError("tandemrl_recv_weights: call tandemrl_init_weight_group first")
        buckets = parse_buckets_json(meta_json)
        start = time.perf_counter()
        if delta:
            source = self._tandemrl_delta_source(buckets, tag, base)
        else:
            self._tandemrl_drop_delta_base()
            if self._tandemrl_pg_device == "cpu" and self._tandemrl_recv_buffers is None:
                self._tandemrl_recv_buffers = []
            source = receive_buckets(self._tandemrl_pg, buckets, self._tandemrl_pg_device, self._tandemrl_recv_buffers)
        counter = _Counter(source)
        expected = sum(len(b) for b in buckets)
        try:
            self._tandemrl_reload(counter)
        except BaseException:
            self._tandemrl_drop_delta_base()
            self._tandemrl_recv_buffers = None
            raise
        finally:
            # If loading stopped early (an error, a rejected name), still take every broadcast
            # so the trainer is not left blocked in its next one.
            consumed = counter.n
            if not counter.failed:  # (a failed broadcast would only fail again)
                for _ in counter:
                    pass
        if consumed != expected:
            self._tandemrl_drop_delta_base()
            raise RuntimeError(f"tandemrl_recv_weights: the model consumed {consumed} of {expected} tensors")
        if delta:
            self._tandemrl_delta_tag = tag
        return {"buckets": len(buckets), "tensors": counter.n, "seconds": round(time.perf_counter() - start, 4)}

    def _tandemrl_delta_source(
        self, buckets: list[list[Any]], tag: str | None, base: str | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if not tag:
            raise ValueError("tandemrl_recv_weights: a delta update needs 'tag'")
        held = self._tandemrl_delta_tag
        if base and base != held:
            self._tandemrl_drop_delta_base()
            raise RuntimeError(
                f"tandemrl_recv_weights: the delta applies to update {base!r}, this server holds {held!r}; "
                "the trainer must send a full anchor"
            )
        if self._tandemrl_delta_base is None:
            self._tandemrl_delta_base = []
        self._tandemrl_delta_tag = None  # until this update has arrived whole
        self._tandemrl_delta_specs = buckets
        return receive_delta_buckets(self._tandemrl_pg, buckets, self._tandemrl_pg_device, self._tandemrl_delta_base)

    def _tandemrl_drop_delta_base(self) -> None:
        self._tandemrl_delta_base, self._tandemrl_delta_tag = None, None

    def tandemrl_delta_digest(self) -> dict[str, Any]:
        """sha256 of every tensor of the last delta-mode update, as this worker holds it (for tests)."""
        import hashlib

        import torch

        if self._tandemrl_delta_base is None or self._tandemrl_delta_tag is None:
            return {"tag": None, "tensors": {}}
        digests = {}
        for flat, specs in zip(self._tandemrl_delta_base, self._tandemrl_delta_specs, strict=True):
            for name, t in unpack_bucket(flat, specs):
                digests[name] = hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
        return {"tag": self._tandemrl_delta_tag, "tensors": digests}

    def _tandemrl_reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """``reload_weights``, leaving the model reloadable if it fails part-way.

        vLLM's in-place reload first swaps every layer to checkpoint-format parameters and
        only restores the kernel format in a final pass that an exception (e.g. a weight
        name the model does not have) skips; every later reload then fails too
        ("'Parameter' object has no attribute 'weight_loader'"). Running that final pass
        keeps the server updatable; its weights are a mix until the next complete update.
        """
        try:
            self.reload_weights(weights_iterator=weights)
        except BaseException:
            try:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                runner = self.model_runner
                finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                logger.exception("tandemrl: could not finalize a failed weight reload")
            raise

    def tandemrl_destroy_weight_group(self) -> dict[str, Any]:
        destroy_group(self._tandemrl_pg)
        self._tandemrl_pg, self._tandemrl_recv_buffers = None, None
        return {"destroyed": True}


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, f.get_tensor(name)


class _Counter:
    """Pass-through iterator that counts what the model consumed."""

    def __init__(self, it: Iterator[tuple[str, torch.Tensor]]):
        self._it = it
        self.n = 0
        self.failed = False  # the source itself raised (e.g. the broadcast failed)

    def __iter__(self) -> _Counter:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        try:
            item = next(self._it)
        except StopIteration:
            raise
        except BaseException:
            self.failed = True
            raise
        self.n += 1
        return item
