"""Config loading: schema defaults < YAML < CLI overrides, typed results, and one-line errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from tandemrl.configs import (
    ConfigError,
    DistillConfig,
    GRPOConfig,
    OptimizerConfig,
    PPOActorConfig,
    PPOConfig,
    SFTConfig,
    config_to_dict,
    exit_on_config_error,
    register_configs,
    save_config,
)
from tandemrl.configs.agent import AgentGRPOConfig
from tandemrl.configs.loader import list_presets
from tandemrl.configs.openenv import OpenEnvGRPOConfig
from tandemrl.configs.tinker import TinkerServeConfig
from tandemrl.configs.verifiers import VerifiersGRPOConfig
from tandemrl.trainers.entry import load_config, load_config_or_exit

GRPO_YAML = {
    "experiment_name": "exp-a",
    "allocation_mode": "vllm:d1+fsdp:d1",
    "total_train_steps": 7,
    "cluster": {"fileroot": "/data/runs"},
    "valid_dataset": {"path": "/data/gsm8k", "split": "test", "batch_size": 4},
    "gconfig": {"n_samples": 3, "stop_token_ids": [5, 6], "stop": ["</s>"]},
    "actor": {"engine": {"path": "/models/tiny", "optimizer": {"lr": 2.0e-6, "weight_decay": 0.1}}, "group_size": 3},
}


def write_yaml(path: Path, data: object) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def load_error(argv: list[str], schema: type = GRPOConfig) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv, schema)
    message = str(info.value)
    assert "\n" not in message and message
    return message


def test_yaml_and_overrides_give_typed_nested_values(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "grpo.yaml", GRPO_YAML)
    argv = [
        "--config",
        str(path),
        "actor.engine.optimizer.lr=3e-6",
        "gconfig.stop=null",
        "gconfig.stop_token_ids=[1,2,3]",
        "rollout.server_addrs=['h1:1','h2:2']",
        "trial_name='007'",
        "ref.path=/models/ref",
        "ref.optimizer=null",
        "~valid_dataset.max_length",
    ]
    cfg, config_path = load_config(argv, GRPOConfig)

    assert type(cfg) is GRPOConfig and config_path == str(path.resolve())
    assert isinstance(cfg.actor, PPOActorConfig) and isinstance(cfg.actor.engine.optimizer, OptimizerConfig)
    assert cfg.actor.engine.optimizer.lr == pytest.approx(3e-6) and isinstance(cfg.actor.engine.optimizer.lr, float)
    assert cfg.actor.engine.optimizer.weight_decay == pytest.approx(0.1)  # from YAML, untouched by the CLI
    assert cfg.actor.engine.optimizer.beta2 == pytest.approx(0.999)  # schema default
    assert cfg.actor.engine.path == "/models/tiny" and cfg.actor.group_size == 3
    assert cfg.total_train_steps == 7 and cfg.experiment_name == "exp-a"
    assert cfg.gconfig.stop is None and cfg.gconfig.stop_token_ids == [1, 2, 3]
    assert cfg.rollout.server_addrs == ["h1:1", "h2:2"]
    assert cfg.trial_name == "007"  # quoted: stays a string
    assert cfg.valid_dataset is not None and cfg.valid_dataset.path == "/data/gsm8k"
    assert cfg.valid_dataset.batch_size == 4 and cfg.valid_dataset.shuffle is True
    assert cfg.ref is not None and cfg.ref.path == "/models/ref" and cfg.ref.optimizer is None
    assert cfg.ref.dtype == "float32"  # a null optional section is filled from its defaults


def test_save_then_load_reproduces_the_same_object(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "grpo.yaml", GRPO_YAML)
    cfg, _ = load_config(["--config", str(path), "gconfig.stop=['a b','null']", "actor.kl_ctl=0.05"], GRPOConfig)
    saved = save_config(cfg, tmp_path / "out" / "config.yaml")
    assert saved.is_file()
    again, again_path = load_config(["--config", str(saved)], GRPOConfig)
    assert again == cfg and again_path == str(saved)
    assert config_to_dict(again) == config_to_dict(cfg) == dataclasses.asdict(cfg)


def test_merge_order_defaults_then_yaml_then_cli(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "a.yaml", {"seed": 5, "actor": {"eps_clip": 0.3}})
    defaults, no_path = load_config([], GRPOConfig)
    assert no_path == "" and defaults.actor == GRPOConfig().actor and defaults.gconfig == GRPOConfig().gconfig
    assert defaults.saver.experiment_name == GRPOConfig().experiment_name
    from_yaml, _ = load_config(["--config", str(path)], GRPOConfig)
    both, _ = load_config([f"--config={path}", "seed=9"], GRPOConfig)
    assert (defaults.seed, from_yaml.seed, both.seed) == (1, 5, 9)
    assert both.actor.eps_clip == pytest.approx(0.3)
    cli_only, _ = load_config(["actor.eps_clip=0.25"], GRPOConfig)
    assert cli_only.actor.eps_clip == pytest.approx(0.25) and cli_only.seed == 1


def test_interpolations_are_resolved(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "a.yaml", {"cluster": {"fileroot": "/runs/root"}})
    cfg, _ = load_config(["--config", str(path), "experiment_name=e1", "trial_name=t9"], GRPOConfig)
    for section in (cfg.saver, cfg.recover, cfg.evaluator, cfg.stats_logger):
        assert (section.experiment_name, section.trial_name, section.fileroot) == ("e1", "t9", "/runs/root")
    assert (cfg.rollout.experiment_name, cfg.rollout.trial_name) == ("e1", "t9")
    custom, _ = load_config(["saver.fileroot=${cluster.fileroot}/ckpt", "cluster.fileroot=/x"], GRPOConfig)
    assert custom.saver.fileroot == "/x/ckpt"


def test_unknown_key_in_yaml_names_key_file_and_valid_keys(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "x.yaml", {"actor": {"engine": {"optimiser": {"lr": 1.0}}}})
    message = load_error(["--config", str(path)])
    assert "'actor.engine.optimiser'" in message and str(path) in message
    assert "valid keys at 'actor.engine'" in message and "optimizer" in message
    top = load_error(["--config", str(write_yaml(tmp_path / "y.yaml", {"sed": 3}))])
    assert "'sed'" in top and "top level" in top and "seed" in top


def test_unknown_key_on_cli_names_command_line() -> None:
    message = load_error(["actor.engine.optimiser.lr=1e-5"])
    assert (
        "'actor.engine.optimiser'" in message
        and "command line" in message
        and "actor.engine.optimiser.lr=1e-5" in message
    )
    nested = load_error(["actor.engine.optimizer={lr: 1, betta: 2}"])
    assert "'actor.engine.optimizer.betta'" in nested and "command line" in nested
    under_leaf = load_error(["seed.value=1"])
    assert "'seed.value'" in under_leaf


def test_wrong_type_in_yaml_names_key_and_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "bad.yaml", {"actor": {"engine": {"optimizer": {"lr": "abc"}}}})
    message = load_error(["--config", str(path)])
    assert message == f"Config key 'actor.engine.optimizer.lr' in {path} expects float, got 'abc'"
    as_list = load_error(["--config", str(write_yaml(tmp_path / "l.yaml", {"gconfig": {"stop_token_ids": [1, "x"]}}))])
    assert "'gconfig.stop_token_ids[1]'" in as_list and "expects int" in as_list
    scalar = load_error(["--config", str(write_yaml(tmp_path / "s.yaml", {"actor": {"engine": {"optimizer": 3}}}))])
    assert "'actor.engine.optimizer'" in scalar and "OptimizerConfig" in scalar


def test_wrong_type_on_cli_names_key() -> None:
    message = load_error(["actor.engine.optimizer.lr=abc"])
    assert "'actor.engine.optimizer.lr'" in message and "command line" in message and "expects float" in message
    assert "'seed'" in load_error(["seed=1.5"])
    assert "'async_training'" in load_error(["async_training=maybe"])
    assert "not optional" not in load_error(["seed=null"]) and "'seed'" in load_error(["seed=null"])


def test_choices_metadata_is_enforced() -> None:
    message = load_error(["actor.engine.dtype=fp32"])
    assert "'actor.engine.dtype'" in message and "bfloat16" in message and "command line" in message


def test_missing_file_and_preset() -> None:
    message = load_error(["--config", "no/such/file.yaml"])
    assert "no/such/file.yaml" in message
    preset = load_error(["--config", "preset:not_a_preset"])
    assert "not_a_preset" in preset and "grpo_gsm8k" in preset


def test_broken_yaml_files(tmp_path: Path) -> None:
    syntax = tmp_path / "syntax.yaml"
    syntax.write_text("seed: 1\nactor: [1\n")
    message = load_error(["--config", str(syntax)])
    assert str(syntax) in message and "line" in message
    as_list = tmp_path / "list.yaml"
    as_list.write_text("- 1\n- 2\n")
    assert str(as_list) in load_error(["--config", str(as_list)])


@pytest.mark.parametrize(
    "token", ["actor.engine.optimizer.lr=[1", "actor", "=3", "a b=1", "actor@pkg=1", "group/opt=x"]
)
def test_malformed_override_names_the_token(token: str) -> None:
    message = load_error([token])
    assert token in message and "command line" in message


def test_plus_and_tilde_overrides() -> None:
    assert "'brand_new'" in load_error(["+brand_new=1"])
    assert "'actor.brand_new'" in load_error(["+actor.brand_new.x=1"])
    assert "already has a value" in load_error(["+seed=3"])
    added, _ = load_config(["+total_train_steps=4", "++seed=8", "~ref"], GRPOConfig)
    assert added.total_train_steps == 4 and added.seed == 8 and added.ref is None
    deleted, _ = load_config(["~actor.engine.optimizer", "~valid_dataset"], GRPOConfig)
    assert deleted.actor.engine.optimizer is None and deleted.valid_dataset is None
    assert "'seed'" in load_error(["~seed"]) and "not optional" in load_error(["~seed"])
    assert "'nokey'" in load_error(["~nokey"])
    assert "not 5" in load_error(["~total_train_steps=5"])


def test_sweeps_and_multirun_are_rejected() -> None:
    for flag in ("-m", "--multirun"):
        message = load_error([flag, "seed=1,2"])
        assert flag in message and "launcher" in message
    assert "sweep" in load_error(["seed=1,2"])
    assert "--bogus" in load_error(["--bogus"])
    assert "--config" in load_error(["--config"])


def test_missing_required_value_names_key(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "m.yaml", {"actor": {"engine": {"path": "???"}}})
    message = load_error(["--config", str(path)])
    assert "'actor.engine.path'" in message and str(path) in message
    cfg, _ = load_config(["--config", str(path), "actor.engine.path=/m"], GRPOConfig)
    assert cfg.actor.engine.path == "/m"


@pytest.mark.parametrize(
    ("preset", "schema", "model_key"),
    [
        ("sft_gsm8k", SFTConfig, "model"),
        ("grpo_gsm8k", GRPOConfig, "actor.engine"),
        ("grpo_gsm8k", PPOConfig, "actor.engine"),
    ],
)
def test_presets_load_for_their_schemas(preset: str, schema: type, model_key: str) -> None:
    assert preset in list_presets()
    assert f"'{model_key}.path'" in load_error(["--config", f"preset:{preset}"], schema)
    cfg, path = load_config(["--config", f"preset:{preset}", f"{model_key}.path=/models/tiny"], schema)
    assert type(cfg) is schema and Path(path).is_file() and Path(path).name == f"{preset}.yaml"
    assert (cfg.model if model_key == "model" else cfg.actor.engine).path == "/models/tiny"
    assert cfg.train_dataset.path == "openai/gsm8k"
    overridden, _ = load_config(
        ["--config", f"preset:{preset}", f"{model_key}.path=m", "train_dataset.path=/local/gsm8k"], schema
    )
    assert overridden.train_dataset.path == "/local/gsm8k"
    if isinstance(cfg, GRPOConfig):
        assert cfg.allocation_mode == "vllm:d1+fsdp:d1" and cfg.train_dataset.type == "rl"
        assert cfg.gconfig.n_samples == 4 and cfg.gconfig.max_new_tokens == 64
        assert cfg.actor.group_size == 4 and cfg.actor.eps_clip == pytest.approx(0.2) and cfg.actor.kl_ctl == 0.0
        # One step consumes one dataloader batch: RLTrainer derives it; the preset leaves the default.
        assert cfg.ref is None and not hasattr(cfg.rollout, "consumer_batch_size")
    else:
        assert cfg.train_dataset.type == "sft" and cfg.model.optimizer is not None


def test_config_store_registration() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    register_configs()
    store = ConfigStore.instance()
    names = store.list("")
    for name, schema in (("sft", SFTConfig), ("grpo", GRPOConfig), ("ppo", PPOConfig)):
        assert f"{name}.yaml" in names
        assert OmegaConf.get_type(store.load(f"{name}.yaml").node) is schema
    assert "ppo_actor.yaml" in store.list("actor") and "adamw.yaml" in store.list("optimizer")
    assert OmegaConf.get_type(store.load("optimizer/adamw.yaml").node) is OptimizerConfig


def test_exit_helpers_print_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load_config_or_exit(["actor.engine.optimizer.lr=abc"], GRPOConfig)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "actor.engine.optimizer.lr" in err

    @exit_on_config_error
    def main() -> None:
        load_config(["nokey=1"], SFTConfig)

    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2 and "'nokey'" in capsys.readouterr().err
    cfg, _ = load_config_or_exit(["seed=4"], SFTConfig)
    assert cfg.seed == 4


# --------------------------------------------------------------------------- keys that moved (issue 13)
def test_engine_keys_moved_under_engine(tmp_path: Path) -> None:
    assert load_error(["actor.path=/m"]).startswith("Config key 'actor.path' moved to 'actor.engine.path'")
    cli = load_error(["actor.optimizer.lr=1e-5"])
    assert "'actor.optimizer.lr' moved to 'actor.engine.optimizer.lr'" in cli and "command line" in cli
    path = write_yaml(tmp_path / "old.yaml", {"actor": {"group_size": 2, "dtype": "bfloat16"}})
    in_yaml = load_error(["--config", str(path)])
    assert "'actor.dtype' moved to 'actor.engine.dtype'" in in_yaml and str(path) in in_yaml
    critic = load_error(["critic.is_critic=true"], PPOConfig)
    assert "'critic.is_critic' moved to 'critic.engine.is_critic'" in critic
    assert "removed" in load_error(["actor.engine.backend=x"]) and "'actor.engine.backend'" in load_error(
        ["actor.engine.backend=x"]
    )
    ref = load_error(["ref.path=/r", "ref.temperature=0.5"])
    assert "'ref.temperature'" in ref and "'actor.temperature'" in ref
    assert "Unknown config key 'critic.adv_norm'" in load_error(["critic.adv_norm.mean_level=group"], PPOConfig)
    derived = load_error(["rollout.consumer_batch_size=8"])
    assert "'rollout.consumer_batch_size' was removed" in derived and "train_dataset.batch_size" in derived


def test_critic_engine_builds_a_value_head_by_default() -> None:
    cfg, _ = load_config(["critic.engine.path=/c"], PPOConfig)
    assert cfg.critic.engine.is_critic and not cfg.actor.engine.is_critic and cfg.critic.engine.path == "/c"


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PRESETS = Path(__file__).resolve().parents[2] / "tandemrl" / "configs" / "presets"
YAML_SCHEMAS = {
    EXAMPLES / "gsm8k_sft.yaml": SFTConfig,
    EXAMPLES / "arith_sft.yaml": SFTConfig,
    EXAMPLES / "gsm8k_grpo.yaml": GRPOConfig,
    EXAMPLES / "gsm8k_grpo_smollm2.yaml": GRPOConfig,
    EXAMPLES / "arith_grpo_smollm2.yaml": GRPOConfig,
    EXAMPLES / "reasoning_gym_grpo_smollm2.yaml": GRPOConfig,
    EXAMPLES / "gsm8k_judge.yaml": GRPOConfig,
    EXAMPLES / "arith_grpo.yaml": GRPOConfig,
    EXAMPLES / "gsm8k_remax.yaml": GRPOConfig,
    EXAMPLES / "gsm8k_ppo.yaml": PPOConfig,
    EXAMPLES / "gsm8k_agent.yaml": AgentGRPOConfig,
    EXAMPLES / "verifiers_grpo.yaml": VerifiersGRPOConfig,
    EXAMPLES / "openenv_grpo.yaml": OpenEnvGRPOConfig,
    EXAMPLES / "gsm8k_distill.yaml": DistillConfig,
    EXAMPLES / "tinker_serve.yaml": TinkerServeConfig,
    PRESETS / "grpo_gsm8k.yaml": GRPOConfig,
    PRESETS / "sft_gsm8k.yaml": SFTConfig,
}


# Read from the raw YAML by the launchers, which do not know the script's schema (tandemrl/launchers/launch_config.py).
LAUNCHER_KEYS = {"allocation_mode"}


def _restated_defaults(data: dict, default: object, prefix: str = "") -> list[str]:
    """Keys whose literal value equals the schema default at that key (interpolations are links, not restated)."""
    from tandemrl.configs.loader import _field_types, _unwrap_optional

    found = []
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else key
        if full in LAUNCHER_KEYS:
            continue
        if isinstance(default, dict):  # entries of a dict field (aux_servers.judge) have no defaults
            continue
        current = getattr(default, key)
        if isinstance(value, dict):
            if current is None:  # an optional section (valid_dataset): compare with its type's defaults
                current = _unwrap_optional(_field_types(type(default))[key])[0]()
            found += _restated_defaults(value, current, full)
        elif value == current and not (isinstance(value, str) and "${" in value):
            found.append(f"{full}={value!r}")
    return found


def test_yaml_list_covers_every_shipped_yaml() -> None:
    shipped = set(EXAMPLES.rglob("*.yaml")) | set(PRESETS.glob("*.yaml"))
    assert shipped == set(YAML_SCHEMAS)


@pytest.mark.parametrize("path", sorted(YAML_SCHEMAS), ids=lambda p: p.name)
def test_shipped_yamls_load_and_restate_no_defaults(path: Path, tmp_path: Path) -> None:
    from tandemrl.launchers.launch_config import LAUNCHER_SECTION, script_config

    schema = YAML_SCHEMAS[path]
    key = "model.path" if schema in (SFTConfig, TinkerServeConfig) else "actor.engine.path"
    # The script reads the file the launcher hands it: without the launcher's own section.
    script_path, _ = script_config(str(path), [], str(tmp_path / path.name))
    cfg, _ = load_config(["--config", str(script_path), f"{key}=/models/tiny"], schema)
    assert type(cfg) is schema
    data = yaml.safe_load(path.read_text())
    data.pop(LAUNCHER_SECTION, None)
    assert _restated_defaults(data, schema()) == [], f"{path.name} restates schema defaults"
