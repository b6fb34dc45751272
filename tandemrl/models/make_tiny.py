"""Build tiny random-weight HF models (Qwen2 dense, Qwen3-MoE or Llama) with a real BPE tokenizer.

Tests and CPU examples need a model that every backend (transformers, FSDP, Megatron,
DeepSpeed, vLLM) can load, that is small enough to train in seconds, and whose
tokenizer handles GSM8K text and a Qwen-style chat template. Nothing is downloaded:
the tokenizer is trained locally on GSM8K (if a local copy is given) or on a built-in
generated corpus of arithmetic word problems.

    python -m tandemrl.models.make_tiny --arch qwen2 --out /tmp/tiny --corpus ../shared/data/gsm8k
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen-style chat template; generation stops at <|im_end|>, which is the eos token.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenizer split: single digits (good for arithmetic), words, punctuation runs, spaces.
QWEN_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

ARCHS = ("qwen2", "qwen3_moe", "llama")
VOCAB_MULTIPLE = 64  # embedding rows are padded to this (vLLM / Megatron TP friendliness)
MAX_POSITIONS = 2048
# Bump when the build recipe changes so ensure_tiny_model rebuilds stale cache entries.
BUILD_VERSION = 1

# Defaults: head_dim 32 (vLLM's CPU attention does not support very small head sizes),
# 2 layers, ~0.6M parameters: a training step takes well under a second on one CPU core.
DEFAULTS: dict[str, Any] = {
    "hidden": 128,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "intermediate": 256,
    "experts": 4,
    "top_k": 2,
    "vocab": 1024,
    "seed": 0,
}
MOE_ONLY = ("experts", "top_k")


# ----------------------------------------------------------------------------- corpus


def _generated_corpus(n: int = 3000, seed: int = 0) -> list[tuple[str, str]]:
    """GSM8K-style arithmetic word problems, so the tokenizer trains with no files at hand."""
    rng = random.Random(seed)
    names = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark", "Sam", "Ada"]
    items = ["apples", "clips", "books", "cookies", "pencils", "marbles", "stickers", "eggs", "cards", "shells"]
    pairs: list[tuple[str, str]] = []
    for _ in range(n):
        name, item = rng.choice(names), rng.choice(items)
        a, b = rng.randint(2, 99), rng.randint(2, 30)
        kind = rng.randrange(5)
        if kind == 0:
            c = a + b
            q = f"{name} has {a} {item}. Then {name} gets {b} more {item}. How many {item} does {name} have now?"
            ans = f"{name} has {a}+{b} = <<{a}+{b}={c}>>{c} {item} now."
        elif kind == 1:
            a = a + b
            c = a - b
            q = f"{name} had {a} {item} and gave {b} of them away. How many {item} are left?"
            ans = f"{name} has {a}-{b} = <<{a}-{b}={c}>>{c} {item} left."
        elif kind == 2:
            c = a * b
            q = f"{name} buys {a} boxes of {item}. Each box holds {b} {item}. How many {item} did {name} buy?"
            ans = f"{name} bought {a}*{b} = <<{a}*{b}={c}>>{c} {item}."
        elif kind == 3:
            c = a
            total = a * b
            q = f"{name} shares {total} {item} equally among {b} friends. How many {item} does each friend get?"
            ans = f"Each friend gets {total}/{b} = <<{total}/{b}={c}>>{c} {item}."
        else:
            price, cnt = rng.randint(2, 20), rng.randint(2, 12)
            cost, change = price * cnt, rng.randint(1, 50)
            paid = cost + change
            q = (
                f"{name} buys {cnt} {item} for ${price} each and pays with ${paid}. "
                f"How much change does {name} get back?"
            )
            ans = (
                f"The {item} cost {cnt}*{price} = $<<{cnt}*{price}={cost}>>{cost}.\n"
                f"{name} gets {paid}-{cost} = $<<{paid}-{cost}={change}>>{change} back."
            )
            c = change
        pairs.append((q, f"{ans}\n#### {c}"))
    return pairs


def _corpus_file(corpus_path: str) -> Path:
    """A jsonl file, or a directory holding train.jsonl."""
    p = Path(corpus_path).expanduser()
    if p.is_dir():
        p = p / "train.jsonl"
    if not p.is_file():
        raise FileNotFoundError(f"tiny-model corpus not found: {p} (give a jsonl file or a dir with train.jsonl)")
    return p


def _read_corpus(corpus_path: str | None) -> list[tuple[str, str]]:
    """(question, answer) pairs of a GSM8K-style jsonl file, or of the generated corpus."""
    if corpus_path is None:
        return _generated_corpus()
    path = _corpus_file(corpus_path)
    pairs: list[tuple[str, str]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {lineno}: invalid JSON ({e.msg})") from None
            if isinstance(row, dict) and isinstance(row.get("question"), str) and isinstance(row.get("answer"), str):
                pairs.append((row["question"], row["answer"]))
    if not pairs:
        raise ValueError(f"{path}: no rows with string 'question' and 'answer' to train the tokenizer on")
    return pairs


def _training_texts(pairs: list[tuple[str, str]]) -> list[str]:
    """Texts laid out as chat turns (minus special tokens) so role names get merges too."""
    return [f"user\n{q}\nassistant\n{a}\n" for q, a in pairs]


# ----------------------------------------------------------------------------- builders


def build_tokenizer(texts: list[str], vocab: int) -> Any:
    """Train a byte-level BPE on `texts` and wrap it as a PreTrainedTokenizerFast with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab={vocab} is too small: byte-level BPE needs at least {256 + len(SPECIAL_TOKENS)}")
    tok = Tokenizer(models.BPE())
    # The exact pipeline transformers' Qwen2Tokenizer rebuilds on load (AutoTokenizer picks it
    # from model_type), so tokenizer.json alone and AutoTokenizer give identical ids.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
        padding_side="right",
    )


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def build_config(arch: str, vocab_size: int, eos_id: int, pad_id: int, p: dict[str, Any]) -> Any:
    """The HF config of the tiny model: untied embeddings, except llama, which ties them as SmolLM2 does."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=p["hidden"],
        intermediate_size=p["intermediate"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    cfg: PretrainedConfig
    if arch == "qwen2":
        from transformers import Qwen2Config

        cfg = Qwen2Config(**common)
    elif arch == "llama":
        from transformers import LlamaConfig

        cfg = LlamaConfig(**{**common, "tie_word_embeddings": True})
    elif arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        if not 1 <= p["top_k"] <= p["experts"]:
            raise ValueError(f"top_k={p['top_k']} must be between 1 and experts={p['experts']}")
        cfg = Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim: accepted, missing from its typed signature
            **common,
            head_dim=p["hidden"] // p["heads"],
            num_experts=p["experts"],
            num_experts_per_tok=p["top_k"],
            moe_intermediate_size=p["intermediate"],
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    else:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    return cfg


def _check_params(arch: str, p: dict[str, Any]) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    for key in ("hidden", "layers", "heads", "kv_heads", "intermediate", "experts", "top_k", "vocab"):
        if not isinstance(p[key], int) or p[key] <= 0:
            raise ValueError(f"{key}={p[key]!r} must be a positive int")
    if p["hidden"] % p["heads"]:
        raise ValueError(f"hidden={p['hidden']} must be divisible by heads={p['heads']}")
    if p["heads"] % p["kv_heads"]:
        raise ValueError(f"heads={p['heads']} must be divisible by kv_heads={p['kv_heads']}")


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    arch: str = "qwen2",
    *,
    hidden: int = DEFAULTS["hidden"],
    layers: int = DEFAULTS["layers"],
    heads: int = DEFAULTS["heads"],
    kv_heads: int = DEFAULTS["kv_heads"],
    intermediate: int = DEFAULTS["intermediate"],
    experts: int = DEFAULTS["experts"],
    top_k: int = DEFAULTS["top_k"],
    vocab: int = DEFAULTS["vocab"],
    corpus_path: str | None = None,
    seed: int = DEFAULTS["seed"],
) -> str:
    """Write a tiny random model + tokenizer + generation config to `out_dir`; returns its path.

    Same arguments give bit-identical files (seeded init, deterministic BPE training).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    p = dict(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        experts=experts,
        top_k=top_k,
        vocab=vocab,
    )
    _check_params(arch, p)
    tokenizer = build_tokenizer(_training_texts(_read_corpus(corpus_path)), vocab)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = build_config(arch, _round_up(len(tokenizer), VOCAB_MULTIPLE), eos_id, pad_id, p)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return str(out)


# ----------------------------------------------------------------------------- names


def parse_tiny_spec(spec: str) -> tuple[str, dict[str, int]]:
    """``qwen2`` or ``qwen2:layers=4,hidden=256`` (the part after ``tiny:``) -> (arch, build arguments).

    Sizes left out keep their defaults; the tokenizer depends only on the corpus and ``vocab``,
    so a wider or deeper model keeps the default one's token ids (e.g. a distillation teacher).
    """
    arch, _, opts = spec.partition(":")
    arch = arch or "qwen2"
    if arch not in ARCHS:
        raise ValueError(f"tiny:{spec}: unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    kw: dict[str, int] = {}
    for item in filter(None, (o.strip() for o in opts.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in DEFAULTS or not value.strip().isdigit():
            raise ValueError(
                f"tiny:{spec}: bad option {item!r}; expected key=int with key one of {', '.join(DEFAULTS)}"
            )
        kw[key] = int(value)
    try:
        _check_params(arch, {**DEFAULTS, **kw})
    except ValueError as err:
        raise ValueError(f"tiny:{spec}: {err}") from None
    return arch, kw


# ----------------------------------------------------------------------------- cache


def _corpus_digest(corpus_path: str | None) -> str:
    if corpus_path is None:
        return "builtin"
    h = hashlib.sha256()
    with open(_corpus_file(corpus_path), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tiny_model_key(arch: str = "qwen2", **kw: Any) -> str:
    """Cache key of a build: its arguments, the corpus contents and the transformers version."""
    import transformers

    unknown = set(kw) - set(DEFAULTS) - {"corpus_path"}
    if unknown:
        raise TypeError(f"unknown tiny-model argument(s): {', '.join(sorted(unknown))}")
    params = {**DEFAULTS, **{k: v for k, v in kw.items() if k != "corpus_path"}}
    if arch != "qwen3_moe":
        for k in MOE_ONLY:
            params.pop(k)
    blob = json.dumps(
        {
            "arch": arch,
            "params": params,
            "corpus": _corpus_digest(kw.get("corpus_path")),
            "build": BUILD_VERSION,
            "transformers": transformers.__version__,
        },
        sort_keys=True,
    )
    return f"{arch}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def ensure_tiny_model(cache_dir: str | os.PathLike[str], arch: str = "qwen2", **kw: Any) -> str:
    """Build the tiny model once per distinct arguments under `cache_dir` and reuse it.

    Concurrent callers (e.g. pytest-xdist workers) are safe and build it once
    (:func:`tandemrl.models.cache.build_once`); a half-written model is never visible.
    """
    from tandemrl.models.cache import build_once

    final = Path(cache_dir).expanduser() / tiny_model_key(arch, **kw)
    return build_once(final, lambda tmp: make_tiny_model(tmp, arch, **kw))


# ----------------------------------------------------------------------------- CLI


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--arch", choices=ARCHS, default="qwen2")
    ap.add_argument("--out", required=True, help="Output directory (created).")
    ap.add_argument("--hidden", type=int, default=DEFAULTS["hidden"])
    ap.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    ap.add_argument("--heads", type=int, default=DEFAULTS["heads"])
    ap.add_argument("--kv-heads", type=int, default=DEFAULTS["kv_heads"])
    ap.add_argument("--intermediate", type=int, default=DEFAULTS["intermediate"])
    ap.add_argument("--experts", type=int, default=DEFAULTS["experts"], help="qwen3_moe only.")
    ap.add_argument("--top-k", type=int, default=DEFAULTS["top_k"], help="qwen3_moe only.")
    ap.add_argument("--vocab", type=int, default=DEFAULTS["vocab"], help="BPE vocab size (incl. 256 bytes).")
    ap.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    ap.add_argument("--corpus", default=None, help="GSM8K-style jsonl file or dir with train.jsonl.")
    return ap.parse_args(argv)


def _iter_summary(path: str) -> Iterator[str]:
    cfg = json.loads((Path(path) / "config.json").read_text())
    for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "eos_token_id", "pad_token_id"):
        yield f"{k}={cfg.get(k)}"


def main(argv: list[str] | None = None) -> None:
    a = _parse_args(argv)
    path = make_tiny_model(
        a.out,
        a.arch,
        hidden=a.hidden,
        layers=a.layers,
        heads=a.heads,
        kv_heads=a.kv_heads,
        intermediate=a.intermediate,
        experts=a.experts,
        top_k=a.top_k,
        vocab=a.vocab,
        corpus_path=a.corpus,
        seed=a.seed,
    )
    print(f"wrote {path}: " + " ".join(_iter_summary(path)))


if __name__ == "__main__":
    main()
