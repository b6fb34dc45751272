"""``launcher.server_args``: the user's extra flags for the generation servers, read by every launcher."""

from __future__ import annotations

import json

import pytest
from utils import REPO_ROOT

from tandemrl.api.parallel import ParallelStrategy
from tandemrl.inference.vllm import VLLMBackend
from tandemrl.launchers.launch_config import read_launch_spec, script_config

GRPO = str(REPO_ROOT / "examples" / "gsm8k_grpo.yaml")


def test_server_args_reach_the_launch_spec_in_the_backends_names() -> None:
    spec = read_launch_spec(GRPO, ["launcher.server_args.max_num_seqs=64", "+launcher.server_args.enforce-eager=false"])
    assert spec.server_extra == {"max_num_seqs": 64, "enforce_eager": False}
    assert read_launch_spec(GRPO, []).server_extra == {}


def test_a_mapping_server_arg_reaches_the_server_command_as_one_json_value() -> None:
    """vLLM reads ``--hf-overrides`` as JSON: the fp32 output head of docs/consistency.md, set from the command line."""
    spec = read_launch_spec(GRPO, ["+launcher.server_args.hf_overrides={head_dtype: float32}"])
    assert spec.server_extra == {"hf_overrides": {"head_dtype": "float32"}}
    cmd = VLLMBackend().server_command("m", "127.0.0.1", 8000, ParallelStrategy(), spec.server_extra)
    i = cmd.index("--hf-overrides")
    assert json.loads(cmd[i + 1]) == {"head_dtype": "float32"}


def test_server_args_merge_with_the_lora_flags_and_never_contradict_them() -> None:
    lora = ["actor.engine.lora.rank=12", "weight_update_mode=disk", "actor.engine.lora.serve=adapter"]
    spec = read_launch_spec(GRPO, [*lora, "launcher.server_args.max_num_seqs=8", "launcher.server_args.max_loras=1"])
    assert spec.server_extra == {"max_num_seqs": 8, "enable_lora": True, "max_lora_rank": 16, "max_loras": 1}
    with pytest.raises(
        ValueError, match=r"'launcher\.server_args\.max_lora_rank'=8: LoRA updates by disk need max_lora_rank=16"
    ):
        read_launch_spec(GRPO, [*lora, "launcher.server_args.max_lora_rank=8"])


def test_deterministic_runs_get_whole_prefills_on_vllm() -> None:
    """Seeded requests in a split prefill crash vLLM's CPU worker (generator rewind): deterministic runs
    start their vLLM servers with --no-enable-chunked-prefill, unless server_args decide otherwise; running servers
    (rollout.server_addrs) get no flags from the launcher, so a deterministic run may name them."""
    assert read_launch_spec(GRPO, ["deterministic=true"]).server_extra == {"no_enable_chunked_prefill": True}
    mine = read_launch_spec(GRPO, ["deterministic=true", "+launcher.server_args.enable_chunked_prefill=true"])
    assert mine.server_extra == {"enable_chunked_prefill": True}
    assert read_launch_spec(GRPO, ["deterministic=false"]).server_extra == {}
    running = read_launch_spec(GRPO, ["deterministic=true", "rollout.server_addrs=[127.0.0.1:9]"])
    assert running.server_extra == {} and running.server_addrs == ["127.0.0.1:9"]


def test_server_stall_bounds_are_read_and_checked() -> None:
    spec = read_launch_spec(GRPO, ["launcher.server_stall_warn=5", "launcher.server_stall_limit=30"])
    assert (spec.launcher.server_stall_warn, spec.launcher.server_stall_limit) == (5.0, 30.0)
    assert (
        read_launch_spec(GRPO, []).launcher.server_stall_warn,
        read_launch_spec(GRPO, []).launcher.server_stall_limit,
    ) == (
        60.0,
        900.0,
    )
    with pytest.raises(
        ValueError, match=r"'launcher\.server_stall_warn' \(5\) must be below launcher\.server_stall_limit"
    ):
        read_launch_spec(GRPO, ["launcher.server_stall_warn=5", "launcher.server_stall_limit=4"])
    with pytest.raises(ValueError, match=r"'launcher\.server_stall_warn' on the command line .* must be > 0\.0, got 0"):
        read_launch_spec(GRPO, ["launcher.server_stall_warn=0"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "launcher.server_args=5",
            r"Config key 'launcher\.server_args' on the command line .* expects a mapping, got 5",
        ),
        ("launcher.no_such_key=1", r"Unknown config key 'launcher\.no_such_key' on the command line"),
        # Names the installed vLLM's parser does not know (read once per version, tandemrl/inference/vllm_flags.py).
        (
            "launcher.server_args.max_num_seq=4",
            r"config key 'launcher\.server_args': vllm servers have no flag max_num_seq \(did you mean max_num_seqs\?\)",
        ),
        ("launcher.server_args.kv={a: 1}", r"config key 'launcher\.server_args': vllm servers have no flag"),
        ("launcher.server_args.port=9", r"config key 'launcher\.server_args': vllm server flags \['port'\] are set by"),
        ("+launcher.server_args.tensor-parallel-size=2", r"flags \['tensor_parallel_size'\] are set by tandemrl"),
    ],
)
def test_bad_server_args_fail_in_one_line_naming_the_key(override: str, expected: str) -> None:
    with pytest.raises(ValueError, match=expected) as err:
        read_launch_spec(GRPO, [override])
    assert "\n" not in str(err.value)


def test_the_training_script_never_sees_server_args(tmp_path) -> None:
    _config, kept = script_config(None, ["launcher.server_args.max_num_seqs=64", "seed=3"], str(tmp_path / "c.yaml"))
    assert kept == ["seed=3"]


def test_an_unknown_key_in_the_files_launcher_section_is_named_with_the_file(tmp_path) -> None:
    """Scripts never see the section, so the launcher refuses what it does not know (a typo would be ignored)."""
    config = tmp_path / "c.yaml"
    config.write_text(open(GRPO).read() + "launcher:\n  server_stall_warm: 5\n")
    with pytest.raises(ValueError, match=rf"Unknown config key 'launcher\.server_stall_warm' in {config}") as err:
        read_launch_spec(str(config), [])
    assert "\n" not in str(err.value)
