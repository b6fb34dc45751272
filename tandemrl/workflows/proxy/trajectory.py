"""Token-level stitching of an agent session's calls into exact trajectories (token in, token out).

Every call's prompt is checked against the trajectories recorded so far:

* ``extend``: the freshly rendered prompt starts with a trajectory's tokens (its last prompt +
  output): the call continues it; the new tokens (tool results, user turns, template glue) get
  loss mask 0.
* the rendered prompt does not, but the messages continue a trajectory (its messages + one
  assistant turn + new messages): the chat template re-rendered history differently (dropped
  ``<think>`` blocks, other whitespace, a different tokenization of the model's text).
  ``mode="prefix"`` (``repair``) sends the trajectory's own tokens + the tokens of the new
  messages, so the model sees, and is trained on, exactly what it produced;
  ``mode="fork"`` (``fork``) sends the re-rendered prompt and starts a new training sample.
* ``new``: an unrelated conversation starts a new trajectory.
* ``branch``: two calls continued the same trajectory at once; the later one copies the
  shared prefix into a new trajectory.

No path puts a token the model did not generate under loss mask 1.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tandemrl.api.inference import ModelResponse
from tandemrl.workflows.proxy.render import BadRequest, same_message

Mode = Literal["prefix", "fork"]
MODES = ("prefix", "fork")
# (last output tokens of the continued trajectory, the new messages) -> their tokens
SuffixFn = Callable[[Sequence[int], Sequence[dict[str, Any]]], list[int]]


@dataclass
class CallRecord:
    """One model call as the server saw it."""

    index: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str
    trajectory: int
    link: str
    constrained: bool = False  # sent with an output constraint (structured outputs)


@dataclass
class Trajectory:
    """One training sample: token-aligned lists, and the conversation its last call ended with."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    constrained: list[int] = field(default_factory=list)  # 1 on outputs of constrained calls
    messages: list[dict[str, Any]] | None = None  # last call's messages + its assistant reply
    last_output: list[int] = field(default_factory=list)

    def append(
        self,
        ids: Sequence[int],
        trained: bool,
        logprobs: Sequence[float] = (),
        versions: Sequence[int] = (),
        constrained: bool = False,
    ) -> None:
        n = len(ids)
        self.tokens += ids
        self.loss_mask += [int(trained)] * n
        self.constrained += [int(trained and constrained)] * n
        self.logprobs += list(logprobs) if trained else [0.0] * n
        self.versions += list(versions) if trained else [-1] * n

    def head(self, n: int) -> Trajectory:
        """A new trajectory holding the first ``n`` tokens."""
        return Trajectory(
            self.tokens[:n],
            self.loss_mask[:n],
            self.logprobs[:n],
            self.versions[:n],
            list(self.calls),
            self.constrained[:n],
        )


@dataclass
class Plan:
    """What one call sends (``prompt_ids``) and which trajectory it continues (``parent``, at ``parent_len``)."""

    prompt_ids: list[int]
    link: str
    parent: int | None = None
    parent_len: int = 0


def _continues(prev: Sequence[dict[str, Any]], messages: Sequence[dict[str, Any]]) -> bool:
    """``messages`` = ``prev`` (whose last entry is the assistant reply) with that reply and more appended."""
    n = len(prev)
    if len(messages) <= n:
        return False
    if messages[n - 1].get("role") != "assistant":
        return False
    return all(same_message(a, b) for a, b in zip(prev[: n - 1], messages[: n - 1], strict=True))


class Session:
    """The trajectories of one agent session (one sample of an episode)."""

    def __init__(self, mode: Mode = "prefix") -> None:
        if mode not in MODES:
            raise ValueError(f"proxy mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.trajectories: list[Trajectory] = []
        self.calls: list[CallRecord] = []
        self.stats: Counter[str] = Counter()

    def plan(
        self, rendered: list[int], messages: Sequence[dict[str, Any]] | None = None, suffix: SuffixFn | None = None
    ) -> Plan:
        """How to send a call whose prompt renders to ``rendered`` (``messages``: chat calls only)."""
        best: int | None = None
        for i, t in enumerate(self.trajectories):
            n = len(t.tokens)
            if (
                n <= len(rendered)
                and rendered[:n] == t.tokens
                and (best is None or n > len(self.trajectories[best].tokens))
            ):
                best = i
        if best is not None:
            return Plan(list(rendered), "extend", best, len(self.trajectories[best].tokens))
        if messages is not None:
            for i in sorted(range(len(self.trajectories)), key=lambda j: -len(self.trajectories[j].tokens)):
                t = self.trajectories[i]
                if t.messages is None or not _continues(t.messages, messages):
                    continue
                if self.mode == "fork" or suffix is None:
                    return Plan(list(rendered), "fork")
                try:
                    new_ids = suffix(t.last_output, messages[len(t.messages) :])
                except BadRequest:  # the template cannot render appended turns alone: fork instead
                    self.stats["repair_failed"] += 1
                    return Plan(list(rendered), "fork")
                return Plan(t.tokens + new_ids, "repair", i, len(t.tokens))
        return Plan(list(rendered), "new")

    def commit(
        self,
        plan: Plan,
        resp: ModelResponse,
        reply: dict[str, Any] | None,
        messages: Any = None,
        constrained: bool = False,
    ) -> CallRecord:
        """Record a finished call: prompt tokens (mask 0 where new) then the output (mask 1, server logprobs;
        ``constrained``: the call was sent with an output constraint)."""
        link = plan.link
        if plan.parent is None:
            traj, start = Trajectory(), 0
            self.trajectories.append(traj)
        else:
            traj, start = self.trajectories[plan.parent], plan.parent_len
            if len(traj.tokens) != start:  # another call continued it meanwhile
                traj, link = traj.head(start), "branch"
                self.trajectories.append(traj)
        t_index = self.trajectories.index(traj)
        traj.append(plan.prompt_ids[start:], trained=False)
        out = list(resp.output_tokens)
        lps = [float(x) for x in resp.output_logprobs]
        traj.append(out, trained=True, logprobs=lps, versions=resp.output_versions, constrained=constrained)
        traj.last_output = out
        traj.messages = None if messages is None or reply is None else list(messages) + [reply]
        rec = CallRecord(
            len(self.calls),
            list(plan.prompt_ids),
            out,
            lps,
            [int(v) for v in resp.output_versions],
            resp.stop_reason,
            t_index,
            link,
            constrained,
        )
        traj.calls.append(rec.index)
        self.calls.append(rec)
        self.stats[link] += 1
        return rec
