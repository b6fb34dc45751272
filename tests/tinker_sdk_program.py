"""A short ``tinker`` SDK program that tests/unit/test_tinker_sdk_range.py runs with each SDK version it claims,
in that version's own virtualenv (it imports nothing of tandemrl's or the tests').

``python tinker_sdk_program.py BASE_MODEL`` with ``TINKER_BASE_URL`` and ``TINKER_API_KEY`` set: a LoRA
training client, two cross_entropy forward_backward + optim_step pairs on one sequence, then
save_weights_and_get_sampling_client, one greedy sample, and the client unloaded. Prints one JSON line: the
SDK's version, both losses and the sampled tokens. An SDK error ends it with status 1 and one line on stdout,
``ERROR <type>: <message>``.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from typing import Any

import tinker
from tinker import types

SEQ = [5, 17, 42, 99, 7, 23, 61, 88, 12, 30, 44, 71]


def _client(made: Any) -> Any:
    """The client itself: newer SDKs return a future of it (which still acts as the client, deprecated)."""
    return made.result() if hasattr(made, "result") else made


def _unload(model_id: str) -> None:
    request = urllib.request.Request(
        os.environ["TINKER_BASE_URL"].rstrip("/") + "/api/v1/unload_model",
        data=json.dumps({"model_id": model_id}).encode(),
        headers={"X-API-Key": os.environ["TINKER_API_KEY"], "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        reply.read()


def main(base_model: str) -> None:
    service = tinker.ServiceClient()
    tc = _client(service.create_lora_training_client(base_model=base_model, rank=4))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(SEQ[:-1]),
        loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * (len(SEQ) - 1)},
    )
    losses = []
    for _ in range(2):
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(fb.result().metrics["loss:sum"])
    sampler = _client(tc.save_weights_and_get_sampling_client())
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    sample = sampler.sample(types.ModelInput.from_ints(SEQ[:6]), 1, params).result()
    _unload(tc.model_id)  # the SDK has no call for it; tinker-serve caps the live LoRA clients
    print(json.dumps({
        "version": tinker.__version__,
        "losses": losses,
        "tokens": list(sample.sequences[0].tokens),
    }))  # fmt: skip


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except tinker.TinkerError as err:
        print(f"ERROR {type(err).__name__}: {getattr(err, 'message', err)}")
        sys.exit(1)
