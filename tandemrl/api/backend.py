"""The inference-backend protocol: build HTTP requests and parse server replies, nothing else.

A backend never opens a socket. The shared client (``tandemrl/inference/http.py``) sends
the ``HttpRequest`` objects a backend builds and hands the decoded JSON back to it, so
retries, failover and interruption handling are written once for every server kind.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from tandemrl.api.inference import GenerateChunk, HttpRequest, ModelRequest, ParamSpec, PauseMode, WeightUpdateMeta
from tandemrl.api.parallel import ParallelStrategy


@runtime_checkable
class InferenceBackend(Protocol):
    """Request builder / response parser of one inference-server kind."""

    name: str
    # The allocation_mode dims (of d, t, p) this server kind may set above 1, e.g. "dtp".
    parallel_dims: str
    # True: one ``build_update_from_collective`` request may carry every bucket of an update
    # (the server receives them all inside that call). False: the server API takes one
    # bucket per request, so the client sends one request per bucket, in order.
    multi_bucket_collective: bool
    # What it can do beyond this protocol: names of ``tandemrl.api.allocation.SERVER_FEATURES``.
    features: frozenset[str]
    # Server flags of a deterministic run (``deterministic=true``): what its servers need to sample a seeded
    # request the same way every time; {} if nothing.
    deterministic_flags: dict[str, Any]
    # The values its servers take for --dtype (checked before a server starts).
    dtypes: tuple[str, ...]

    def build_generate(self, req: ModelRequest, output_so_far: list[int], remaining: int, version: int) -> HttpRequest:
        """Continue ``req.input_ids + output_so_far`` for at most ``remaining`` new tokens."""
        ...

    def parse_generate(self, payload: dict[str, Any]) -> GenerateChunk: ...

    def build_prompt_logprobs(self, token_ids: list[int], rid: str) -> HttpRequest:
        """Score ``token_ids`` without sampling: the logprob of each token after the first given
        its prefix, at temperature 1 (a teacher's logprobs of a student's sample)."""
        ...

    def parse_prompt_logprobs(self, payload: dict[str, Any], token_ids: list[int]) -> list[float]:
        """``len(token_ids) - 1`` logprobs: entry ``i`` is ``log p(token_ids[i + 1] | token_ids[: i + 1])``."""
        ...

    def build_pause(self, mode: PauseMode = "abort") -> HttpRequest:
        """Stop generating. ``"abort"``: in-flight requests return their partial output as "abort".
        ``"keep"``: they stay in the server with their KV cache and continue after ``build_resume``;
        a backend whose server cannot do that raises a one-line ValueError naming
        ``InferenceClientConfig.pause_mode``."""
        ...

    def build_resume(self) -> HttpRequest: ...

    def build_sleep(self, level: int) -> HttpRequest:
        """Colocated placement, sent to a paused server: free its device memory for the trainer
        (``level`` >= 1: KV cache dropped, weights offloaded or dropped, as the server defines)."""
        ...

    def build_wake_up(self) -> HttpRequest:
        """Undo ``build_sleep`` (the client resumes generation after it)."""
        ...

    def build_health(self) -> HttpRequest: ...

    def build_version_get(self) -> HttpRequest: ...

    def parse_version(self, payload: dict[str, Any]) -> int | None:
        """The server's weight version from a ``build_version_get`` reply; None if not an integer."""
        ...

    def build_set_version(self, version: int) -> HttpRequest: ...

    def build_update_from_disk(self, meta: WeightUpdateMeta) -> list[HttpRequest]:
        """Ordered steps that load ``meta.path`` into a (paused) server."""
        ...

    def build_lora_probe(self) -> HttpRequest:
        """Ask the server whether it can load LoRA adapters at run time."""
        ...

    def parse_lora_probe(self, payload: dict[str, Any]) -> int:
        """The largest adapter rank the server loads (its max LoRA rank); 0 if it loads none."""
        ...

    def build_load_adapter(self, meta: WeightUpdateMeta) -> list[HttpRequest]:
        """Ordered steps that (re)load the PEFT adapter directory ``meta.path`` into a (paused) server,
        after which the client calls ``adapter_loaded``."""
        ...

    def adapter_loaded(self) -> None:
        """Every server holds the adapter now: later ``build_generate`` requests generate with it."""
        ...

    def build_init_weight_group(self, meta: WeightUpdateMeta, rank_offset: int) -> HttpRequest:
        """Join the server's ranks to the update group; its first rank is ``rank_offset``."""
        ...

    def build_update_from_collective(self, meta: WeightUpdateMeta, buckets: list[list[ParamSpec]]) -> HttpRequest:
        """Receive ``buckets`` of broadcast tensors (rank 0 broadcasts one flat tensor per bucket, in order).

        Called with a single bucket unless ``multi_bucket_collective`` is True.
        """
        ...

    def build_leave_weight_group(self, meta: WeightUpdateMeta) -> HttpRequest:
        """Make the server's ranks leave the update group (their side is destroyed).

        Sent after an update failed with broadcasts already posted: once the servers' side is
        gone those broadcasts fail, so the trainer can drop its side without waiting out the
        group's timeout. The next update joins a new group.
        """
        ...

    def build_flush_cache(self) -> HttpRequest:
        """Drop cached KV computed with old weights."""
        ...

    def build_abort_all(self) -> HttpRequest: ...

    def server_command(
        self, model_path: str, host: str, port: int, strategy: ParallelStrategy, extra: dict[str, Any]
    ) -> list[str]:
        """argv that starts one server of this kind with ``strategy``'s tp/pp/dp."""
        ...

    def server_env(self) -> dict[str, str]:
        """Environment variables the server process needs on top of the caller's."""
        ...

    def lora_flags(self, rank: int) -> dict[str, Any]:
        """Server flags that let a server load one LoRA adapter of ``rank`` at run time (feature
        ``lora_adapters``); a one-line ValueError if it cannot."""
        ...

    def unknown_flags(self, flags: list[str]) -> list[str]:
        """Which of the server flag names ``flags`` its servers do not take (a hint may follow each name), so a
        misspelt one is named before a server starts; [] when it cannot tell."""
        ...

    def cpu_launch(self, flags: dict[str, Any], child_env: dict[str, str], env: dict[str, str], world: int) -> None:
        """Adjust a server launch (its ``flags`` and ``child_env``, in place) for a machine without CUDA; ``env``
        is what the caller asked for, ``world`` the server's device count."""
        ...
