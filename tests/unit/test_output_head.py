"""``TrainEngineConfig.head_dtype: float32``: the output head computes fp32 logits from 16-bit weights and hidden states.

The bf16 trainer/server gap of docs/consistency.md has two parts: the bf16 body, and the logits rounded to bf16
by a bf16 output head on each side. A vLLM server started with ``hf_overrides: {head_dtype: float32}`` casts the
hidden states and its bf16 head weight to fp32 before the matmul; with ``head_dtype: float32`` the trainer does
the same. Checked here against a hand computation on the tiny model with its parameters cast to bf16 (as FSDP2's
mixed precision casts them), with the gradient reaching the bf16 weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from utils import REPO_ROOT

from tandemrl.configs import GRPOConfig
from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.configs.loader import ConfigError
from tandemrl.engines.hf_model import Fp32Head, build_hf_model
from tandemrl.trainers.entry import load_script_config

pytestmark = pytest.mark.unit


def _bf16_model(path: str, head_dtype: str | None) -> torch.nn.Module:
    model, _ = build_hf_model(TrainEngineConfig(path=path, head_dtype=head_dtype), torch.device("cpu"))
    for p in model.parameters():  # FSDP2's MixedPrecisionPolicy(param_dtype=bf16): parameters, not buffers
        p.data = p.data.to(torch.bfloat16)
    return model


def test_fp32_head_computes_unrounded_logits_and_trains_the_bf16_weights(tiny_model_dir: str) -> None:
    ids = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(0))
    plain, fp32 = _bf16_model(tiny_model_dir, None), _bf16_model(tiny_model_dir, "float32")
    assert type(fp32.get_output_embeddings()) is Fp32Head
    assert fp32.state_dict().keys() == plain.state_dict().keys()

    hidden = fp32.model(input_ids=ids).last_hidden_state
    assert hidden.dtype == torch.bfloat16
    head = fp32.get_output_embeddings().weight
    expected = hidden.float() @ head.float().T  # by hand: bf16 operands, fp32 product
    logits = fp32(input_ids=ids).logits
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)

    rounded = plain(input_ids=ids).logits
    assert rounded.dtype == torch.bfloat16  # the default head rounds every logit to bf16
    torch.testing.assert_close(rounded.float(), logits, rtol=1e-2, atol=5e-2)  # the same model...
    assert (rounded.float() - logits).abs().max() > 0  # ...whose fp32 head keeps what bf16 rounds away

    torch.log_softmax(logits, dim=-1)[0, :-1].gather(-1, ids[0, 1:, None]).sum().backward()
    assert head.grad is not None and head.grad.dtype == torch.bfloat16 and head.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["allocation_mode=vllm:d1+megatron:d1", "actor.engine.head_dtype=float32"], "not megatron"),
        (["actor.engine.head_dtype=bfloat16"], "float32"),
    ],
)
def test_head_dtype_refused_where_it_has_no_meaning(overrides: list[str], expected: str) -> None:
    grpo = str(Path(REPO_ROOT) / "examples" / "gsm8k_grpo.yaml")
    with pytest.raises(ConfigError) as err:
        load_script_config(["--config", grpo, *overrides], GRPOConfig)
    assert "actor.engine.head_dtype" in str(err.value) and expected in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
