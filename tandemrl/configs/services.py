"""Configs of auxiliary inference servers (a judge, a teacher) and of a remote reward service."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandemrl.api.allocation import AllocationMode


@dataclass
class AuxServerConfig:
    """An auxiliary inference server: ``aux_servers.<name>`` for the component ``vllm[<name>]`` of allocation_mode.

    Its replicas and parallelism come from allocation_mode; the launcher starts them next to the
    generation servers and exports their addresses (``tandemrl.api.aux_servers``).
    """

    path: str = field(
        default="", metadata={"help": "Model the server loads: an HF directory, 'tiny:qwen2' or 'smollm2-135m'."}
    )
    server_args: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "Extra server flags, e.g. {max_model_len: 1024} (vLLM's own option names)."},
    )


@dataclass
class RewardServiceConfig:
    """Training rewards from an HTTP service instead of the script's reward function.

    Set one of ``url`` (any service speaking the JSON protocol of docs/rewards.md) or ``judge`` (an
    auxiliary vLLM server prompted as a generative judge). A call is retried on timeouts, connection
    errors, 429 and 5xx; once its retries are spent the sample's whole group is dropped, never
    scored 0. Evaluation keeps the script's reward function.
    """

    url: str = field(default="", metadata={"help": "POST endpoint of a reward service, e.g. http://host:8000/reward."})
    judge: str = field(
        default="", metadata={"help": "Name of the auxiliary server (allocation_mode 'vllm[NAME]') that judges."}
    )
    timeout: float = field(default=30.0, metadata={"help": "Seconds one attempt may take.", "min": 0.001})
    retries: int = field(
        default=2, metadata={"help": "Retries of a failed attempt before the group is dropped.", "min": 0}
    )
    backoff: float = field(
        default=0.5,
        metadata={"help": "Seconds before the first retry; doubles each further retry (at most 10).", "min": 0},
    )
    max_concurrency: int = field(
        default=16, metadata={"help": "Calls in flight at once per trainer process.", "min": 1}
    )
    judge_max_tokens: int = field(default=8, metadata={"help": "Judge only: tokens the verdict may take.", "min": 1})

    @property
    def enabled(self) -> bool:
        return bool(self.url or self.judge)


def service_problem(
    alloc: AllocationMode, aux_paths: Mapping[str, str], judge: str = "", url: str = ""
) -> tuple[str, str] | None:
    """(key, what is wrong) when auxiliary servers and the reward service do not fit allocation_mode, else None.

    ``alloc``: the parsed allocation_mode; ``aux_paths``: ``aux_servers.<name>.path`` by name. Shared by
    the config guards and the launchers.
    """
    allocation_mode = alloc.spec
    aux = {c.name: c for c in alloc.aux}
    for name, comp in aux.items():
        if name is None or not aux_paths.get(name):
            return (
                f"aux_servers.{name}.path",
                f"is not set: allocation_mode '{allocation_mode}' starts the auxiliary server "
                f"'{comp.backend}[{name}]', which needs a model",
            )
        if alloc.train is not None and alloc.colocated(comp, alloc.train):
            return (
                "allocation_mode",
                f"'{allocation_mode}' colocates auxiliary server {name!r} with the trainer; give it its own '+' group",
            )
    for name in aux_paths:
        if name not in aux:
            gen = alloc.gen
            why = "is the generation server's name" if gen is not None and gen.name == name else "is not in it"
            return (
                f"aux_servers.{name}",
                f"names no auxiliary server of allocation_mode '{allocation_mode}' ({name!r} {why})",
            )
    if judge and url:
        return "reward_service.judge", f"is {judge!r} and reward_service.url is {url!r}: set only one"
    if judge:
        judge_server = aux.get(judge)
        if judge_server is None:
            return (
                "reward_service.judge",
                f"is {judge!r}, which is no auxiliary server of allocation_mode '{allocation_mode}' "
                f"(add 'vllm[{judge}]:d1' and aux_servers.{judge}.path)",
            )
        if "judge" not in judge_server.features:
            return "reward_service.judge", f"is {judge!r}, a {judge_server.backend} server; the judge needs vllm"
    if url:
        problem = url_problem(url)
        if problem:
            return "reward_service.url", problem
    return None


def url_problem(url: str) -> str | None:
    """What is wrong with a reward service URL, or None."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a port that is no number
    except ValueError as err:
        return f"is {url!r}, not a URL ({err})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"is {url!r}; expected http://host:port/path"
    return None
