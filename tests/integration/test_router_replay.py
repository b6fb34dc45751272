"""MoE routing replay (R3) on the Megatron engine (docs/moe.md): the index conversions by hand values, the
one-line refusals, and on the tiny Qwen3-MoE (one gloo rank, tests/workers/router_replay_checks.py) that the
replayed forwards use exactly the recorded experts and that, after updates that move the routers, replay
keeps the trainer's logprobs of the sampled tokens closer to the behaviour logprobs than free routing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from utils import REPO_ROOT, run_torchrun

from tandemrl.configs.engine import TrainEngineConfig
from tandemrl.engines.megatron.routing import (
    NOT_ROUTED,
    assemble_layers,
    canonical,
    indices_to_routing_map,
    layer_targets,
    routing_map_to_indices,
)

WORKER = Path(__file__).resolve().parents[1] / "workers" / "router_replay_checks.py"


# ------------------------------------------------------------------------------------------ pure logic
def test_indices_and_routing_map_convert_both_ways() -> None:
    idx = torch.tensor([[2, 0], [1, 3], [3, 2]])
    rm = indices_to_routing_map(idx, 4)
    assert rm.tolist() == [
        [True, False, True, False],
        [False, True, False, True],
        [False, False, True, True],
    ]
    assert routing_map_to_indices(rm, 2).tolist() == [[0, 2], [1, 3], [2, 3]]
    assert canonical(idx).tolist() == [[0, 2], [1, 3], [2, 3]]


def test_conversions_reject_bad_routings() -> None:
    with pytest.raises(ValueError, match=r"in \[0, 4\)"):
        indices_to_routing_map(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match="repeat an expert"):
        indices_to_routing_map(torch.tensor([[1, 1]]), 4)
    with pytest.raises(ValueError, match="route to 2 experts"):
        routing_map_to_indices(torch.tensor([[True, True, True, False]]), 2)


def test_assemble_layers_and_layer_targets() -> None:
    got = assemble_layers({1: torch.tensor([[0, 1], [2, 3]])}, n_layers=3, k=2)
    n = NOT_ROUTED
    assert got.tolist() == [[[n, n], [0, 1], [n, n]], [[n, n], [2, 3], [n, n]]]
    assert layer_targets(got, 1, num_experts=4).tolist() == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="without a recorded routing"):
        layer_targets(got, 0, num_experts=4)  # a layer that routed nothing (dense, or padding)
    with pytest.raises(ValueError, match="outside the model's 3 layers"):
        assemble_layers({3: torch.zeros(2, 2, dtype=torch.long)}, n_layers=3, k=2)


# ---------------------------------------------------------------------------------------- refusals
def test_router_replay_is_refused_off_megatron() -> None:
    from tandemrl.engines.fsdp import FSDPEngine

    cfg = TrainEngineConfig(path="unused")
    cfg.megatron.router_replay = True
    with pytest.raises(ValueError, match="Megatron-only, this is the fsdp engine"):
        FSDPEngine(cfg)


def test_config_check_names_router_replay_on_another_backend() -> None:
    from tandemrl.configs import GRPOConfig
    from tandemrl.configs.loader import ConfigError
    from tandemrl.trainers.entry import load_script_config

    yaml = str(REPO_ROOT / "examples" / "gsm8k_grpo.yaml")
    with pytest.raises(ConfigError) as err:
        load_script_config(["--config", yaml, "actor.engine.megatron.router_replay=true"], GRPOConfig)
    assert "actor.engine.megatron.router_replay" in str(err.value) and "Megatron-only" in str(err.value)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------ the R3 test
@pytest.fixture(scope="module", params=[("megatron:d1", 1), ("megatron:d2e2", 2)], ids=["d1", "d2e2"])
def replay_run(
    request: pytest.FixtureRequest, tiny_moe_dir: str, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> dict:
    """One gloo rank, and two with the experts split over them (expert parallel; both ranks see the same batch)."""
    alloc, nproc = request.param
    out = tmp_path_factory.mktemp("router_replay")
    args = ["--model", tiny_moe_dir, "--dense", tiny_model_dir, "--alloc", alloc, "--out", out]
    run_torchrun(WORKER, nproc, args, env={"TANDEMRL_DIST_TIMEOUT": "120"}, timeout=900)
    return torch.load(out / "replay.pt", weights_only=False)


def _per_layer(calls: list[tuple[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Router calls of one forward (its micro-batches in order) -> {layer: [T, k]} over the whole forward."""
    layers: dict[int, list[torch.Tensor]] = {}
    for layer, idx in calls:
        layers.setdefault(layer, []).append(idx)
    return {layer: torch.cat(parts) for layer, parts in layers.items()}


def _recorded(run: dict) -> dict[int, torch.Tensor]:
    packed = torch.cat(run["packed"])  # [T, n_layers, k] in micro-batch order
    return {layer: canonical(packed[:, layer]) for layer in run["moe_layers"]}


@pytest.mark.slow
def test_replay_reproduces_recorded_routing(replay_run: dict) -> None:
    run = replay_run
    recorded = _recorded(run)
    assert run["moe_layers"], "the tiny model has MoE layers"
    # (1) the recording is the routing the behaviour forward used
    assert {k: v.tolist() for k, v in _per_layer(run["record_used"]).items()} == {
        k: v.tolist() for k, v in recorded.items()
    }
    # dense layers and padding hold NOT_ROUTED; every routed token has k distinct experts
    routed, mask = run["routed"], run["mask"].bool()
    assert bool((routed[~mask] == NOT_ROUTED).all())
    # (2) every replayed forward routes exactly as recorded: same weights, a training forward, and after updates
    for key in ("replay_used_before", "replay_used_train", "replay_used_after"):
        used = _per_layer(run[key])
        assert {k: v.tolist() for k, v in used.items()} == {k: v.tolist() for k, v in recorded.items()}, key
    assert run["replay_same_weights"] == 0.0
    assert "no 'routed_experts'" in run["train_without_routing"]
    assert "is not an MoE model" in run["dense_error"] and "\n" not in run["dense_error"]
    if "tp_error" in run:  # the 2-rank run: tensor parallel (sequence-parallel routers) is refused
        assert "supported with tp=1 and pp=1" in run["tp_error"] and "\n" not in run["tp_error"]


@pytest.mark.slow
def test_replay_shrinks_the_logprob_gap_after_updates(replay_run: dict) -> None:
    run = replay_run
    mask = run["mask"].bool()
    layers = run["moe_layers"]
    before, after = run["routed"][mask][:, layers], run["free_routed"][mask][:, layers]
    changed = (canonical(before) != canonical(after)).any(-1).float().mean().item()
    print(
        f"free routing changed top-k for {changed:.1%} of (token, layer) pairs; "
        f"mean |logp - behav| replay {run['gap_replay']:.3e} vs free {run['gap_free']:.3e}"
    )
    assert changed > 0, "the updates must change some routing for the comparison to mean anything"
    assert run["gap_replay"] < run["gap_free"]


@pytest.mark.slow
def test_ppo_actor_records_before_the_update_and_replays(replay_run: dict) -> None:
    """PPOActor.ppo_update on a batch without routed_experts: one forward at the pre-update weights records
    them (equal to the engine-level recording at the same weights), and both minibatches' training forwards,
    the second after an optimizer step, route exactly as recorded."""
    run = replay_run
    mask = run["mask"].bool()
    assert torch.equal(run["ppo_routed"][mask], run["routed"][mask])
    assert len(run["ppo_train_used"]) == 2
    assert run["reinforce_recorded"], "ReinforceActor records the routing before its step too"
    for used, expected in zip(run["ppo_train_used"], run["ppo_train_expected"], strict=True):
        packed = torch.cat(expected)
        want = {layer: canonical(packed[:, layer]).tolist() for layer in run["moe_layers"]}
        assert {k: v.tolist() for k, v in _per_layer(used).items()} == want
