"""A request in flight at a weight update, in both ``InferenceClientConfig.pause_mode`` s (the session vLLM
server, all ``slow``).

One greedy request is held by the server after ``K`` tokens (tests/vllm_gate.py), the weights are
updated through ``RemoteInferenceClient`` (from disk, or by a collective broadcast) while it is held, and it
is let go. In both modes it finishes with all ``N`` tokens, the tokens before the update on the old
weights' greedy path and labelled version 0, the rest labelled 1. What differs:

* ``abort``: the client resubmits prompt + partial output (counted by ``take_resubmitted_tokens``), the
  server sees a new request (the gate's first hold after the update reports 1 or 2 tokens), and the
  logprobs after the update are those of the new weights over the whole sequence (fp32 HF reference).
* ``keep``: nothing is resubmitted, the server continues the same request (its first hold after the
  update reports at least the tokens made before it), and the logprobs after the update are those of
  the new weights reading the KV the old weights computed for the sequence before it (fp32 HF
  reference built that way); they are far from the all-new-weights reference.

After the request, ``/reset_prefix_cache`` at the update could drop the old weights' prompt block in
abort mode only: in keep mode the held request still used it, so a request salted with version 0 is
still served it, while one sent at the engine's new version (what the engine sends) is not: it gets
exactly what the server serves after the test's own reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from test_stale_kv import block_size, cold, engine_on, joined_group, random_prompt
from test_stale_kv import generate as salted
from vllm_server import VLLMTestServer, load_hf, perturbed_model

from tandemrl.api.inference import ModelRequest, WeightUpdateMeta
from tandemrl.inference.remote import RemoteInferenceClient

K = 6  # tokens granted before the update
N = K + 8  # tokens the request asks for
TOL = 0.5  # bf16 server vs fp32 reference, max |logprob diff| (measured up to 0.13; the new lm_head is scaled x8)


@contextlib.contextmanager
def by_disk(engine: RemoteInferenceClient, new: torch.nn.Module, out: Path) -> Iterator[Callable[[], None]]:
    """Yields the update: ``new`` saved to ``out`` and loaded, labelled version 1."""
    new.save_pretrained(out)
    yield lambda: engine.update_weights_from_disk(WeightUpdateMeta(type="disk", path=str(out), version=1)).result()


def by_broadcast(
    engine: RemoteInferenceClient, new: torch.nn.Module, out: Path
) -> contextlib.AbstractContextManager[Callable[[], None]]:
    """Yields the update: ``new`` broadcast over a group joined beforehand (so only the update itself
    reaches the server while the request is held)."""
    return joined_group(engine, new)


@torch.no_grad()
def continued_logprobs(first: torch.nn.Module, then: torch.nn.Module, seq: list[int], start: int) -> list[float]:
    """Logprob of each ``seq[start:]`` token when ``first`` computed the KV of ``seq[: start - 1]`` and
    ``then`` runs every later position on top of it (``first is then``: one model throughout)."""
    ids = torch.tensor([seq])
    past = first(ids[:, : start - 1], use_cache=True).past_key_values
    logits = then(ids[:, start - 1 : -1], past_key_values=past, use_cache=True).logits[0].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(seq) - start), ids[0, start:]].tolist()


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "push", "seed"),
    [("abort", by_disk, 201), ("keep", by_disk, 202), ("keep", by_broadcast, 203)],
    ids=["abort-disk", "keep-disk", "keep-collective"],
)
def test_request_in_flight_at_an_update(
    vllm_server: VLLMTestServer,
    tmp_path: Path,
    mode: str,
    push: Callable[..., contextlib.AbstractContextManager[Callable[[], None]]],
    seed: int,
) -> None:
    block = block_size(vllm_server)
    prompt = random_prompt(vllm_server, block + block // 4, seed=seed)
    old_path = salted(vllm_server, prompt, N, 0)  # the old weights' greedy path; caches the prompt's first block
    new = perturbed_model(vllm_server.model_dir, seed=seed)
    with engine_on(vllm_server, pause_mode=mode) as engine, push(engine, new, tmp_path / "new") as update:

        async def held_over_update() -> tuple[list[int], list[float], list[int], str, int]:
            req = ModelRequest(rid=uuid.uuid4().hex, input_ids=list(prompt), metadata={"ignore_eos": True})
            req.gconfig = req.gconfig.new(greedy=True, max_new_tokens=N)
            with vllm_server.gate(prompt) as gate:  # the request waits between tokens
                task = asyncio.ensure_future(engine.agenerate(req))
                held = await asyncio.to_thread(gate.wait_held)
                held = await asyncio.to_thread(gate.advance, held, K)
                await asyncio.to_thread(gate.release_until, update, held, N - 1)
                held = await asyncio.to_thread(gate.wait_held)  # the request's first hold after the update...
                first_hold = gate.last_held  # ...reports the tokens the server's request has made so far
                held.close()  # let it go on (the gate is disarmed on leaving the block)
            resp = await task
            return resp.output_tokens, resp.output_logprobs, resp.output_versions, resp.stop_reason, first_hold

        tokens, logprobs, versions, stop, first_hold = asyncio.run(held_over_update())
        resubmitted = engine.take_resubmitted_tokens()
        # The prompt's first block, cached under the old weights before the update: still served to a
        # request salted with version 0 only if the update's flush could not drop it (keep mode)...
        stale = salted(vllm_server, prompt, 1, 0)
        if mode == "keep":  # ...but never to what the engine sends now
            fresh = salted(vllm_server, prompt[: block + 1], 4, engine.get_version())
            oracle = cold(vllm_server, prompt[: block + 1], 4)

    m = versions.index(1) if 1 in versions else len(versions)  # tokens made before the update
    assert stop == "length" and len(tokens) == N, (stop, len(tokens))
    assert K <= m <= K + 1 and versions == [0] * m + [1] * (N - m), versions
    assert tokens[:m] == old_path.tokens[:m]
    if mode == "abort":
        assert resubmitted == len(prompt) + m and first_hold <= 2, (resubmitted, first_hold)
    else:
        assert resubmitted == 0 and first_hold >= m, (resubmitted, first_hold)

    # After the update: which KV the served logprobs read.
    seq, start = prompt + tokens, len(prompt) + m
    over_old_kv = continued_logprobs(load_hf(vllm_server.model_dir), new, seq, start)
    all_new = continued_logprobs(new, new, seq, start)
    expected, other = (over_old_kv, all_new) if mode == "keep" else (all_new, over_old_kv)
    near, far = gap(logprobs[m:], expected), gap(logprobs[m:], other)
    print(f"\n{mode}: max |served - expected| {near:.3f}, max |served - other| {far:.3f}")
    assert near < TOL, (logprobs[m:], expected)
    assert far > 5 * TOL, (logprobs[m:], other)  # measured 14-18
    assert stale.cached == (block if mode == "keep" else 0), (stale.cached, block)
    if mode == "keep":
        assert fresh.cached == 0 and (fresh.tokens, fresh.logprobs) == (oracle.tokens, oracle.logprobs)
