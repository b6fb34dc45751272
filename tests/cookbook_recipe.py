"""Run one tinker-cookbook recipe against tinker-serve with local stand-ins for what it fetches from the hub;
run with the python of the cookbook's own virtualenv (tests/side_venv.py; docs/tinker.md, "tinker-cookbook").

    python cookbook_recipe.py RECIPE DATA_JSONL [key=value ...]

RECIPE is ``sl_loop`` or ``rl_loop`` (math_rl needs no stand-in: ``python -m
tinker_cookbook.recipes.math_rl.train env=arithmetic renderer_name=qwen3_instruct ...``); the key=value arguments are the recipe's own (chz), ``model_name`` among them: the base model's directory, which is also
the name tinker-serve serves it under. The recipe's code runs unmodified; the stand-ins are:

- the tokenizer: none needed, the cookbook loads a local directory's own (``get_tokenizer(model_name)``);
- the renderer (chat format): ``qwen3_instruct`` for ``model_name``, which the cookbook's model table cannot name
  (it knows hub ids only). Before the recipe starts, its generation prompt must equal the model's own chat
  template (``apply_chat_template``) and a rendered conversation that template up to its last ``<|im_end|>``;
  otherwise this exits with status 2;
- the data: the recipe's hub data set (``HuggingFaceH4/no_robots`` for sl_loop, ``openai/gsm8k`` for rl_loop)
  is DATA_JSONL, loaded with ``datasets.load_dataset("json", ...)`` as its ``train`` split.

``HF_HUB_OFFLINE`` and ``HF_DATASETS_OFFLINE`` are set, so anything else from the hub fails at once.
"""

from __future__ import annotations

import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import chz  # noqa: E402
import datasets  # noqa: E402
from tinker_cookbook import model_info, renderers  # noqa: E402
from tinker_cookbook.tokenizer_utils import get_tokenizer  # noqa: E402

RENDERER = "qwen3_instruct"
HUB_DATA = {"sl_loop": "HuggingFaceH4/no_robots", "rl_loop": "openai/gsm8k"}


def _check_renderer(model_name: str) -> None:
    """Exit 2 unless RENDERER renders the model's own chat template."""
    tokenizer = get_tokenizer(model_name)
    renderer = renderers.get_renderer(RENDERER, tokenizer)
    convo = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "It is 5."}]
    prompt = tokenizer.decode(renderer.build_generation_prompt(convo[:1]).to_ints())
    want_prompt = tokenizer.apply_chat_template(convo[:1], tokenize=False, add_generation_prompt=True)
    example = tokenizer.decode(renderer.build_supervised_example(convo)[0].to_ints())
    want_example = tokenizer.apply_chat_template(convo, tokenize=False).rstrip("\n")
    if prompt != want_prompt or example != want_example:
        print(f"renderer {RENDERER} is not this model's chat template: {prompt!r} / {example!r}", flush=True)
        sys.exit(2)


def _stand_ins(recipe: str, model_name: str, data: str) -> None:
    recommended = model_info.get_recommended_renderer_name
    load_dataset = datasets.load_dataset

    def renderer_name(name: str) -> str:
        return RENDERER if name == model_name else recommended(name)

    def local_data(path: str, *args: Any, **kwargs: Any) -> Any:
        if path == HUB_DATA.get(recipe):
            return load_dataset("json", data_files={"train": data})
        return load_dataset(path, *args, **kwargs)

    model_info.get_recommended_renderer_name = renderer_name
    datasets.load_dataset = local_data


def main(argv: list[str]) -> None:
    recipe, data, *args = argv
    config = dict(arg.split("=", 1) for arg in args)
    model_name = config["model_name"]
    _check_renderer(model_name)
    _stand_ins(recipe, model_name, data)
    if recipe == "sl_loop":
        from tinker_cookbook.recipes.sl_loop import main as run
    elif recipe == "rl_loop":
        from tinker_cookbook.recipes.rl_loop import main as run
    else:
        raise SystemExit(f"unknown recipe {recipe!r} (sl_loop or rl_loop)")
    sys.argv = [recipe, *args]
    chz.nested_entrypoint(run)


if __name__ == "__main__":
    main(sys.argv[1:])
