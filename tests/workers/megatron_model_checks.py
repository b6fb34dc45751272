"""torchrun worker (2 ranks) for tests/integration/test_megatron_model.py: Megatron GPTModel built from HF vs transformers.

For each parallel layout it builds the model with tandemrl.engines.megatron, loads the HF checkpoint,
runs one packed batch of 3 sequences, compares logits with transformers (per sequence), exports with
iter_hf_weights and round-trips the export through save_pretrained/from_pretrained. Rank 0 writes results.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist

from tandemrl.engines.teardown import destroy_process_groups

LENGTHS = (7, 13, 10)


def hf_reference(hf_dir: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits for each packed sequence run on its own, concatenated [T, V], and the final
    norm's gradient of the summed next-token loss."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out, start = [], 0
    for n in LENGTHS:
        out.append(model(input_ids=ids[None, start : start + n], use_cache=False).logits[0])
        start += n
    logits = torch.cat(out)
    next_token_loss(logits, ids).backward()
    return logits.detach(), model.model.norm.weight.grad


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of predicting ids[t+1] inside each packed sequence."""
    ends = torch.tensor(LENGTHS).cumsum(0) - 1
    keep = torch.ones(ids.numel(), dtype=torch.bool)
    keep[ends] = False
    return torch.nn.functional.cross_entropy(logits[:-1][keep[:-1]], ids[1:][keep[:-1]], reduction="sum")


def megatron_logits(
    model, hf_config, ids: torch.Tensor, block_mask: bool = True, grad: bool = False
) -> torch.Tensor | None:
    """Packed b=1 forward through every PP stage; full-vocab logits [T, V] on the last stage, else None."""
    from megatron.core import parallel_state as ps

    from tandemrl.engines.megatron.forward import gather_vocab_logits, packed_causal_mask, packed_position_ids

    T = ids.numel()
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    mask = packed_causal_mask(cu, T, "cpu") if block_mask else packed_causal_mask(torch.tensor([0]), T, "cpu")
    pos = packed_position_ids(cu, T, "cpu")
    with torch.set_grad_enabled(grad):
        if not ps.is_pipeline_first_stage():
            recv = torch.empty(T, 1, hf_config.hidden_size)
            dist.recv(recv, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(recv)
        out = model(ids[None], pos, mask)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        return gather_vocab_logits(out, hf_config.vocab_size)[0]


def digest(sd: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k, v in sd.items():
        h.update(k.encode())
        h.update(v.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_layout(tag: str, hf_dir: str, tp: int, pp: int, ep: int, out_dir: str) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from tandemrl.engines.megatron.cpu_shims import apply_cpu_shims
    from tandemrl.engines.megatron.hf_convert import hf_param_specs, iter_hf_weights, load_hf_weights
    from tandemrl.engines.megatron.model import build_gpt_model, transformer_config_from_hf

    apply_cpu_shims()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    torch.manual_seed(123)
    model_parallel_cuda_manual_seed(123)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    tf_config = transformer_config_from_hf(hf_config, tp=tp, pp=pp, ep=ep, params_dtype=torch.float32)
    model = build_gpt_model(hf_config, tf_config).eval()
    load_hf_weights(model, hf_dir, hf_config)

    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, hf_config.vocab_size, (sum(LENGTHS),), generator=gen)
    res: dict = {"tp": tp, "pp": pp, "ep": ep}
    logits = megatron_logits(model, hf_config, ids, grad=True)
    ref, ref_grad = hf_reference(hf_dir, ids)
    diffs = [None] * dist.get_world_size()
    grad_diffs = [None] * dist.get_world_size()
    if logits is not None:  # the final norm is replicated over TP: its grad is complete on every TP rank
        next_token_loss(logits, ids).backward()
        grad = dict(model.named_parameters())["decoder.final_layernorm.weight"].grad
        grad_diff = ((grad - ref_grad).abs().max() / ref_grad.abs().max()).item()
    dist.all_gather_object(diffs, None if logits is None else (logits.detach() - ref).abs().max().item())
    dist.all_gather_object(grad_diffs, None if logits is None else grad_diff)
    res["logit_max_diff"] = [d for d in diffs if d is not None]
    res["norm_grad_rel_diff"] = [d for d in grad_diffs if d is not None]
    res["logit_scale"] = ref.abs().max().item()
    if tag == "dense_tp1":  # the block mask matters: a plain causal mask over the pack must differ
        plain = megatron_logits(model, hf_config, ids, block_mask=False)
        res["plain_mask_diff"] = (plain - ref).abs().max().item()

    exported = dict(iter_hf_weights(model, hf_config))
    specs = hf_param_specs(hf_config, dtype=torch.float32)
    res["specs_match"] = [(s.name, list(s.shape), s.dtype) for s in specs] == [
        (k, list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in exported.items()
    ]
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest(exported))
    res["same_on_all_ranks"] = len(set(digests)) == 1
    if dist.get_rank() == 0:
        original = load_file(os.path.join(hf_dir, "model.safetensors"))
        res["missing"] = sorted(set(original) - set(exported))
        res["extra"] = sorted(set(exported) - set(original))
        res["not_equal_export"] = sorted(
            k for k in original if k in exported and not torch.equal(original[k], exported[k])
        )
        save = os.path.join(out_dir, f"export_{tag}")
        with torch.device("meta"):
            fresh = AutoModelForCausalLM.from_config(hf_config)
        res["n_tensors"] = len(exported)
        fresh.save_pretrained(save, state_dict=dict(exported))
        a = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
        b = AutoModelForCausalLM.from_pretrained(save, dtype=torch.float32).state_dict()
        res["not_equal_reload"] = sorted(k for k in a if k not in b or not torch.equal(a[k], b[k]))
    dist.barrier()
    ps.destroy_model_parallel()
    return res


def bf16_export(moe_dir: str) -> dict:
    """bf16 params (norms included, as in HF): EP=2 export is the checkpoint cast to bf16, all in bf16."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from tandemrl.engines.megatron.hf_convert import hf_param_specs, iter_hf_weights, load_hf_weights
    from tandemrl.engines.megatron.model import build_gpt_model, transformer_config_from_hf

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1)
    cfg = AutoConfig.from_pretrained(moe_dir)
    model = build_gpt_model(cfg, transformer_config_from_hf(cfg, tp=1, pp=1, ep=2, params_dtype=torch.bfloat16))
    load_hf_weights(model, moe_dir, cfg)
    exported = dict(iter_hf_weights(model, cfg))
    original = load_file(os.path.join(moe_dir, "model.safetensors"))
    specs = hf_param_specs(cfg, torch.bfloat16)
    res = {
        "not_equal": sorted(k for k, v in exported.items() if not torch.equal(original[k].bfloat16(), v)),
        "dtypes": sorted({str(v.dtype) for v in exported.values()}),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "specs_match": [(s.name, s.shape, s.dtype) for s in specs]
        == [(k, tuple(v.shape), "bfloat16") for k, v in exported.items()],
        "n": len(exported),
    }
    ps.destroy_model_parallel()
    return res


def strict_load_error(dense_dir: str, moe_dir: str) -> str:
    """Loading a checkpoint of another architecture must fail with a message naming the mismatch."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from transformers import AutoConfig

    from tandemrl.engines.megatron.hf_convert import load_hf_weights
    from tandemrl.engines.megatron.model import build_gpt_model, transformer_config_from_hf

    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    cfg = AutoConfig.from_pretrained(dense_dir)
    model = build_gpt_model(cfg, transformer_config_from_hf(cfg, tp=1, pp=1, ep=1, params_dtype=torch.float32))
    try:
        load_hf_weights(model, moe_dir, cfg)
        msg = ""
    except ValueError as e:
        msg = str(e)
    ps.destroy_model_parallel()
    return msg


LAYOUTS = {
    "dense_tp1": ("dense", 1, 1, 1),
    "dense_tp2": ("dense", 2, 1, 1),
    "dense_pp2": ("dense", 1, 2, 1),
    "moe_ep1": ("moe", 1, 1, 1),
    "moe_ep2": ("moe", 1, 1, 2),
    "moe_pp2": ("moe", 1, 2, 1),
    # Qwen3 dense: q/k norms, tied embeddings, odd vocab (TP padding), norms != 1
    "qwen3_tp2": ("qwen3", 2, 1, 1),
    "qwen3_pp2": ("qwen3", 1, 2, 1),
    # Qwen3-MoE: tied embeddings, odd vocab, a dense layer among MoE ones, norm_topk_prob=False, norms != 1
    "variant_pp2": ("variant", 1, 2, 1),
    "variant_ep2": ("variant", 1, 1, 2),
    # Llama (SmolLM2's layout): GQA 3:1, no biases, tied embeddings across PP stages, rope theta 1e5
    "llama_tp2": ("llama", 2, 1, 1),
    "llama_pp2": ("llama", 1, 2, 1),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dense", required=True)
    ap.add_argument("--moe", required=True)
    ap.add_argument("--variant", required=True)
    ap.add_argument("--qwen3", required=True)
    ap.add_argument("--llama", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*", default=list(LAYOUTS))
    a = ap.parse_args()
    dist.init_process_group("gloo")
    results: dict = {}
    for tag in a.only:
        kind, tp, pp, ep = LAYOUTS[tag]
        results[tag] = run_layout(tag, getattr(a, kind), tp, pp, ep, a.out)
    results["strict_load_error"] = strict_load_error(a.dense, a.moe)
    results["bf16_export"] = bf16_export(a.moe)
    if dist.get_rank() == 0:
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    destroy_process_groups()


if __name__ == "__main__":
    main()
