"""Tinker wire formats: the forward_backward request and the proto replies (the SDK's own ``tinker_public_pb2``).

Errors are ``UserError`` with one line naming the field; the server answers them with HTTP 400
(at submission) or as a failed future of category ``user``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

from tandemrl.algorithms.tinker_losses import LossSpec, check_config, loss_spec, with_defaults

_NP = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class UserError(ValueError):
    """A bad request: one line, naming the field."""


class NotFound(UserError):
    """An id the server does not know (HTTP 404)."""


def _tensor(msg: Any, where: str) -> np.ndarray:
    if msg.HasField("sparse_csr"):
        raise UserError(f"{where}: sparse tensors are not supported by tinker-serve; send dense ones")
    dtype = _NP.get(msg.dtype)
    if dtype is None:
        raise UserError(f"{where}: unsupported dtype {msg.dtype}")
    arr = np.frombuffer(msg.dense, dtype=dtype)
    shape = list(msg.shape) or [arr.size]
    if math.prod(shape) != arr.size:
        raise UserError(f"{where}: shape {shape} does not match its {arr.size} values")
    return arr.reshape(shape)


def parse_forward_backward(body: bytes) -> tuple[str, str, dict[str, float], bool, list[dict[str, torch.Tensor]]]:
    """(model_id, loss_fn, loss_fn_config, forward_only, data) of a proto request, every datum checked.

    The datums' provenance spans (``model_input_spans``, ``loss_fn_input_spans``) are accepted and not read:
    no served loss uses them."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as err:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise UserError(f"forward_backward: body is not a ForwardBackwardRequest proto ({err})") from None
    spec = _user_error(loss_spec, msg.loss_fn)
    config = loss_config(msg)
    if not msg.data:
        raise UserError("forward_backward: data is empty")
    data = [with_defaults(msg.loss_fn, _datum(d, i, spec, msg.forward_only)) for i, d in enumerate(msg.data)]
    return msg.model_id, msg.loss_fn, config, msg.forward_only, data


def _user_error(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with its ValueError turned into a UserError (HTTP 400)."""
    try:
        return fn(*args)
    except ValueError as err:
        raise UserError(str(err)) from None


def loss_config(msg: Any) -> dict[str, float]:
    """The request's loss config: ``loss_fn_config_v2`` (numbers or text; the SDK 0.38 writes every key there) over
    the legacy float map. Every key must be one the loss takes, and a number."""
    _user_error(check_config, msg.loss_fn, sorted({*msg.loss_fn_config_v2, *msg.loss_fn_config}))
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise UserError(f"loss_fn_config.{key}: must be a number for loss {msg.loss_fn!r}, got text {value.text!r}")
        config[key] = value.number
    return config


def _datum(d: Any, i: int, spec: LossSpec, forward_only: bool) -> dict[str, torch.Tensor]:
    """Token ids and loss inputs of datum ``i``; a forward-only call may leave out the loss's own inputs
    (weights count 1, advantages and sampling logprobs 0: its ``logprobs`` output does not depend on them)."""
    tokens: list[np.ndarray] = []
    for j, chunk in enumerate(d.model_input):
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise UserError(f"data[{i}].model_input.chunks[{j}]: only encoded_text chunks are supported")
        tokens.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    ids = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int32)
    n = ids.size
    if n == 0:
        raise UserError(f"data[{i}].model_input: no tokens")
    out = {"input_ids": torch.from_numpy(ids.astype(np.int64))}
    for name in ("target_tokens", *spec.inputs, *spec.optional):
        if name not in d.loss_fn_inputs and (name in spec.optional or (forward_only and name != "target_tokens")):
            if name not in spec.optional:
                out[name] = torch.ones(n) if name == "weights" else torch.zeros(n)
            continue
        if name not in d.loss_fn_inputs:
            raise UserError(f"data[{i}].loss_fn_inputs: missing {name!r}")
        arr = _tensor(d.loss_fn_inputs[name], f"data[{i}].loss_fn_inputs.{name}")
        if arr.shape != (n,):
            raise UserError(
                f"data[{i}].loss_fn_inputs.{name}: shape {list(arr.shape)}, expected [{n}] (one per input token)"
            )
        out[name] = torch.from_numpy(arr.astype(np.int64 if name == "target_tokens" else np.float32))
    return out


def forward_backward_output(outputs: list[dict[str, torch.Tensor]], metrics: dict[str, float]) -> bytes:
    """The proto ``ForwardBackwardOutput``: one ArrayRecord whose fields hold every datum's tensor."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    rec = msg.loss_fn_outputs.add()
    rec.num_datums = len(outputs)
    for name in outputs[0] if outputs else ():
        arrays = [o[name].float().numpy().astype(np.float32) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        bt = rec.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


MASK_LOGPROB = -99999.0  # the SDK's empty top-k cell (token id 0)


def sample_output(
    sequences: list[tuple[list[int], list[float], str]],
    prompt_logprobs: list[float] | None,
    topk: list[list[tuple[int, float]] | None] | None = None,
    k: int = 0,
) -> bytes:
    """The proto ``SampleResponse``; ``topk`` (one row per prompt token, None for an empty row) fills its
    ``topk_prompt_logprobs`` as the SDK's dense N x ``k`` matrices."""
    msg = pb.SampleResponse()
    for tokens, logprobs, stop in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_LENGTH if stop == "length" else pb.STOP_REASON_STOP
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray([math.nan, *prompt_logprobs], dtype=np.float32).tobytes()
    if topk is not None and k > 0:
        ids = np.zeros((len(topk), k), dtype=np.int32)
        lps = np.full((len(topk), k), MASK_LOGPROB, dtype=np.float32)
        for i, row in enumerate(topk):
            for j, (tok, lp) in enumerate(row or []):
                ids[i, j], lps[i, j] = tok, lp
        msg.topk_prompt_logprobs.CopyFrom(
            pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(topk))
        )
    return msg.SerializeToString()


def prompt_tokens(prompt: dict[str, Any], where: str = "prompt") -> list[int]:
    """The token ids of a JSON ``ModelInput`` (encoded_text chunks only)."""
    ids: list[int] = []
    for j, chunk in enumerate(prompt.get("chunks") or []):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"{where}.chunks[{j}]: only encoded_text chunks are supported")
        ids += [int(t) for t in chunk.get("tokens", [])]
    if not ids:
        raise UserError(f"{where}: no tokens")
    return ids
