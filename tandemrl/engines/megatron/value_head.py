"""The critic's value head on a megatron-core GPTModel: HF's ``<Arch>ForTokenClassification`` with one label.

HF's critic is the causal LM's backbone plus ``score = nn.Linear(hidden, 1, bias=token_classification_bias)``
on the final-norm hidden states (lm_head dropped). Here that head replaces the GPTModel's ``output_layer`` on
the last pipeline stage, as a ``ColumnParallelLinear(hidden, tp)``: each TP rank holds one output row, the
real row on TP rank 0 and zero padding rows elsewhere, exactly the layout of a vocab of size 1 padded to a
multiple of TP. So the head is exact (rank 0 computes HF's dot product, the gather slices off the padding
columns) and needs no code of its own: sequence parallelism (its input all-gather), TP gradient
reduction, grad norms, the vocab-gather in the engine and the checkpoint layouts of hf_convert all work as
for the LM head. The padding rows get zero gradient and so stay zero under AdamW (decay of 0 is 0).
"""

from __future__ import annotations

from typing import Any

import torch

NUM_LABELS = 1  # one value per token; HF's num_labels for the critic
OUTPUT_LAYER = "output_layer"  # the GPTModel attribute the head replaces (names: output_layer.weight / .bias)


def head_bias(hf_config: Any) -> bool:
    """Whether HF's ``score`` layer has a bias: ``token_classification_bias``, default True (transformers 5)."""
    return bool(getattr(hf_config, "token_classification_bias", True))


def initial_head_weights(hf_config: Any, seed: int) -> dict[str, torch.Tensor]:
    """HF's fresh ``score`` of a critic loaded from a causal-LM checkpoint: ``normal(0, initializer_range)``
    and a zero bias (fp32, CPU). HF draws it first after the engine's ``torch.manual_seed(seed)``: a generator
    seeded the same way gives the same tensor without touching the global RNG."""
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(hf_config, "initializer_range", 0.02))
    out = {"score.weight": torch.empty(NUM_LABELS, hf_config.hidden_size).normal_(0.0, std, generator=gen)}
    if head_bias(hf_config):
        out["score.bias"] = torch.zeros(NUM_LABELS)
    return out


def install_value_head(model: torch.nn.Module, hf_config: Any, tf_config: Any, seed: int) -> None:
    """Replace ``model.output_layer`` (last PP stage only) by the value head, initialised as HF's.

    The model must be built untied (``share_embeddings_and_output_weights=False``): a tied output layer
    has no weight of its own to replace.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from tandemrl.engines.megatron.model import padded_vocab_size

    if not getattr(model, "post_process", False):
        return
    if getattr(model, "share_embeddings_and_output_weights", False):
        raise ValueError("value head: build the critic's GPTModel with tie_word_embeddings=False")
    old = getattr(model, OUTPUT_LAYER)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    head = ColumnParallelLinear(
        hf_config.hidden_size,
        padded_vocab_size(NUM_LABELS, tp),
        config=tf_config,
        init_method=torch.nn.init.zeros_,  # set below; zeros_ leaves the global RNG alone
        bias=head_bias(hf_config),
        gather_output=False,
        skip_bias_add=False,
        tp_group=ps.get_tensor_model_parallel_group(),
    )
    head.weight.is_embedding_or_output_parameter = True  # as megatron marks the LM head it replaces
    head.to(old.weight.device)
    init = initial_head_weights(hf_config, seed)
    with torch.no_grad():
        for name, param in head.named_parameters():  # TP rank 0: the real row, the others padding zeros
            param.zero_()
            if rank == 0:
                param[:NUM_LABELS].copy_(init[f"score.{name}"])
    setattr(model, OUTPUT_LAYER, head)
