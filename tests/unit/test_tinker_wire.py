"""tinker-serve's forward_backward decoding (tandemrl/tinker/wire.py) of requests the SDK 0.38's own encoder
(``tinker.proto.request_conv``) writes: the loss config from ``loss_fn_config_v2``, one-line refusals, provenance."""

from __future__ import annotations

import pytest
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from tandemrl.tinker.wire import UserError, parse_forward_backward

TOKENS = [5, 17, 42, 99]  # input 5, 17, 42 -> targets 17, 42, 99


def _datum(**inputs: list[float]) -> types.Datum:
    loss_inputs = {"target_tokens": TOKENS[1:], **inputs}
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs=loss_inputs)


RL = _datum(advantages=[0.0, 1.0, 1.0], logprobs=[0.0, -1.0, -2.0])


def _body(datum: types.Datum, loss_fn: str, config: dict[str, float | str] | None = None) -> bytes:
    fbi = types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn, loss_fn_config=config)  # type: ignore[arg-type]
    request = types.ForwardBackwardRequest(forward_backward_input=fbi, model_id="m", seq_id=1)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_the_loss_config_comes_from_loss_fn_config_v2() -> None:
    _, loss, config, _, _ = parse_forward_backward(_body(RL, "ppo", {"clip_low_threshold": 0.5}))
    assert (loss, config) == ("ppo", {"clip_low_threshold": 0.5})
    msg = pb.ForwardBackwardRequest()  # a v2-only request, as a server that prefers v2 must read it
    msg.ParseFromString(_body(RL, "gspo", {"clip_high_threshold": 2.0}))
    msg.ClearField("loss_fn_config")
    assert parse_forward_backward(msg.SerializeToString())[2] == {"clip_high_threshold": 2.0}


def test_unknown_keys_text_values_and_refused_losses_are_one_line_user_errors() -> None:
    cases = [
        (_body(RL, "ppo", {"clip_eps": 0.2}), r"loss_fn_config: unknown key 'clip_eps' for loss 'ppo' \(it takes: "),
        (_body(RL, "gspo", {"clip_low_threshold": "0.5"}), r"loss_fn_config.clip_low_threshold: must be a number"),
        (_body(RL, "stable_reinforce"), r"loss_fn: 'stable_reinforce' is not served by tinker-serve: "),
        (_body(RL, "custom", {"loss_id": "l-1"}), r"loss_fn: 'custom' is not served by tinker-serve: "),
    ]
    for body, message in cases:
        with pytest.raises(UserError, match=message) as err:
            parse_forward_backward(body)
        assert "\n" not in str(err.value)


def test_provenance_spans_are_accepted_and_gspo_datums_carry_their_ratio_mask() -> None:
    spans = (
        types.PromptProvenanceSpan(sequence_id="s-1", length=1),
        types.SampledProvenanceSpan(sequence_id="s-1", length=2),
    )
    datum = RL.with_provenance(model_input=list(spans), loss_fn_inputs=list(spans))
    data = parse_forward_backward(_body(datum, "gspo"))[4]
    assert data[0]["sequence_ratio_mask"].tolist() == [0.0, 1.0, 1.0]  # default: where the advantage is not 0
    masked = _datum(advantages=[0.0, 1.0, 1.0], logprobs=[0.0, -1.0, -2.0], sequence_ratio_mask=[0.0, 0.0, 1.0])
    assert parse_forward_backward(_body(masked, "gspo"))[4][0]["sequence_ratio_mask"].tolist() == [0.0, 0.0, 1.0]
