"""DeepSpeed ZeRO-3 (2 gloo ranks, parameters partitioned) -> the real session vLLM server.

After a few SFT steps, ``update_weights`` by disk and then by bucketed collective broadcast
(several ZeRO-3 gathers and broadcast buckets) each make the server's greedy output equal
transformers' greedy output on the engine's HF export. Between the two, the server goes
back to its original weights, so the collective update has to carry the change itself.
Then ``RolloutController.destroy`` closes the weight-update group: that controller refuses
updates, and a new one works on the same group port. The session server is left with its original
weights, version label, unpaused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_weight_sync import check_update_record, random_prompts
from utils import run_torchrun
from vllm_server import VLLMTestServer, load_hf, restore_session_server, weight_label

from tandemrl.api.inference import HttpRequest

WORKER = Path(__file__).resolve().parents[1] / "workers" / "deepspeed_sync_checks.py"


@pytest.mark.slow
def test_zero3_updates_vllm_by_disk_and_collective(
    vllm_server: VLLMTestServer, tiny_model_dir: str, tmp_path: Path
) -> None:
    label = weight_label(vllm_server)
    # Many candidates: on the bf16 server only the widest-gap ones are compared.
    prompts = random_prompts(int(load_hf(tiny_model_dir).config.vocab_size), seed=11, n=256)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    args = ["--model", tiny_model_dir, "--addr", vllm_server.proc.address, "--out", str(tmp_path)]
    try:
        run_torchrun(
            WORKER,
            nproc=2,
            args=[*args, "--prompts", str(tmp_path / "prompts.json")],
            env={"TANDEMRL_DIST_TIMEOUT": "300"},
            timeout=600,
        )
        disk = check_update_record(tmp_path / "disk", prompts, "zero3 disk", fp32_server=False, version=1)
        coll = check_update_record(tmp_path / "collective", prompts, "zero3 collective", fp32_server=False, version=2)
    finally:
        vllm_server.call(HttpRequest("POST", "/collective_rpc", {"method": "tandemrl_destroy_weight_group"}, 60.0))
        restore_session_server(vllm_server, label)
    # Back on the original weights between the updates, the server answered as before the first one.
    assert disk["restored"] == disk["before"]
    # The same exported weights went both ways: identical greedy outputs after either update.
    assert disk["after"] == coll["after"]
    sizes = coll["bucket_sizes"]
    print(f"zero3 collective: {coll['n_params']} tensors in {len(sizes)} buckets of {sizes}")
    assert len(sizes) > 1 and sum(sizes) == coll["n_params"]
    assert coll["recv_rpcs"] == 1  # every bucket's specs in one receive RPC per update
    # A destroyed controller refuses updates; a new one on the same group port works.
    assert "push_weights() after destroy()" in coll["disconnected_error"]
    assert coll["reconnected_label"] == "3"
