"""On-policy distillation's rollout side: a teacher model, served by its own inference servers,
scores every token the student generated.

``TeacherScoredWorkflow(inner, teacher)`` wraps any workflow (single-turn RLVR, multi-turn,
agents): after ``inner`` returns its padded batch, each row's tokens go to the teacher in one
scoring request (``RemoteInferenceClient.aprompt_logprobs``: nothing is sampled), and the batch gains
``teacher_logprobs`` [n, L], token-aligned like ``logprobs``: ``log p_teacher(input_ids[t] |
input_ids[:t])`` where ``loss_mask`` is 1, else 0. ``DistillActor`` turns it into advantages.

The teacher's addresses come from ``teacher.server_addrs`` (:func:`connect_teacher`), or from a
``lookup(name)`` callable such as the launcher's auxiliary-server accessor once it exists.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import torch

from tandemrl.api.types import TensorDict
from tandemrl.api.workflow import GenerationClient, RolloutWorkflow
from tandemrl.configs.rollout import InferenceClientConfig
from tandemrl.inference.remote import RemoteInferenceClient, parse_server_addrs

TEACHER_SERVER = "teacher"  # the auxiliary server name a launcher would give the teacher's servers


def teacher_addresses(
    config: InferenceClientConfig, lookup: Callable[[str], list[str]] | None = None, key: str = "teacher"
) -> list[str]:
    """``<key>.server_addrs`` if set, else ``lookup("teacher")`` (e.g. the launcher's named auxiliary
    servers); never the policy servers' environment. One-line error naming ``key`` when neither has any."""
    if config.server_addrs:
        return parse_server_addrs(list(config.server_addrs), f"{key}.server_addrs")
    found = list(lookup(TEACHER_SERVER)) if lookup is not None else []
    if not found:
        raise ValueError(
            f"{key}.server_addrs: empty; list the teacher's inference servers (host:port), "
            "e.g. teacher.server_addrs=[127.0.0.1:8001]"
        )
    return parse_server_addrs(found, f"{key} servers from lookup('{TEACHER_SERVER}')")


def connect_teacher(
    config: InferenceClientConfig,
    backend: str = "vllm",
    lookup: Callable[[str], list[str]] | None = None,
    key: str = "teacher",
) -> RemoteInferenceClient:
    """A client of the teacher's servers (waits until they are healthy)."""
    client = RemoteInferenceClient.for_backend(backend, config)
    client.initialize(teacher_addresses(config, lookup, key))
    return client


async def teacher_logprobs(teacher: RemoteInferenceClient, batch: TensorDict, rid: str | None = None) -> torch.Tensor:
    """[n, L] float32: the teacher's logprob of each ``loss_mask`` token of ``batch``, 0 elsewhere.

    Rows are right-padded: row i's tokens are ``input_ids[i, : attention_mask[i].sum()]``.
    """
    ids, attn, mask = batch["input_ids"], batch["attention_mask"].bool(), batch["loss_mask"].bool()
    lengths = attn.sum(dim=1).tolist()
    rows = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
    scored = await asyncio.gather(*(teacher.aprompt_logprobs(r, rid) for r in rows))
    out = torch.zeros(ids.shape, dtype=torch.float32)
    for i, (n, lps) in enumerate(zip(lengths, scored, strict=True)):
        out[i, 1:n] = torch.tensor(lps, dtype=torch.float32)
    return torch.where(mask, out, 0.0)


class TeacherScoredWorkflow(RolloutWorkflow):
    """``inner``'s episodes plus ``teacher_logprobs`` from the teacher's servers; see the module docstring."""

    def __init__(self, inner: RolloutWorkflow, teacher: RemoteInferenceClient) -> None:
        self.inner = inner
        self.teacher = teacher

    async def arun_episode(self, client: GenerationClient, data: dict[str, Any]) -> TensorDict | None:
        batch = await self.inner.arun_episode(client, data)
        if batch is None:
            return None
        for name in ("input_ids", "attention_mask", "loss_mask"):
            if name not in batch:
                raise KeyError(f"TeacherScoredWorkflow: the inner workflow's batch has no '{name}'")
        batch["teacher_logprobs"] = await teacher_logprobs(self.teacher, batch, rid=uuid.uuid4().hex)
        return batch
