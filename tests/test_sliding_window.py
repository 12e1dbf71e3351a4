"""Sliding-window attention (query i sees key j of its own sequence iff |i - j| <= sliding_window) as one more fact
of the execution plan: every path agrees with a dense band-masked softmax run on each sequence alone, outputs and
gradients; the window is exact (one more or one less fails); sliding layers never hold a tokens x tokens tensor;
a model whose layers are all full behaves as before; the CUDA routes get the window their kernels expect."""

import contextlib
import dataclasses

import pytest
import torch
from conftest import build
from test_execution_plan import facts
from test_packed_sequences import flattened, sequences
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface

from encoderstack import EncoderStackModel, modeling_encoderstack
from encoderstack.modeling_encoderstack import ExecutionPlan, decide_plan

LENGTHS = (5, 23, 1, 17, 30)
SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]


def windowed(window, layer_types=SLIDING, **overrides):
    return build(
        EncoderStackModel,
        layer_types=layer_types,
        sliding_window=window,
        position_embedding_type="rope",
        max_position_embeddings=64,
        **overrides,
    )


def dense_band_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain softmax attention over one whole sequence (batch of one, no padding), the band built densely."""
    assert attention_mask is None and query.shape[0] == 1
    scores = query @ key.transpose(-1, -2) * scaling
    if module.layer_type == "sliding_attention":
        at = torch.arange(query.shape[2])
        scores = scores.masked_fill((at[:, None] - at[None]).abs() > module.config.sliding_window, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2), None


AttentionInterface.register("dense_band_reference", dense_band_reference)


@contextlib.contextmanager
def every_layer_dense(monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(ExecutionPlan, "layer_attention", lambda self, layer_type: ("dense_band_reference", {}))
        yield


def padded(seqs, side="right"):
    width = max(len(s["input_ids"]) for s in seqs)
    batch = {name: torch.zeros(len(seqs), width, dtype=torch.long) for name in ("input_ids", "attention_mask")}
    for row, s in enumerate(seqs):
        n = len(s["input_ids"])
        where = slice(0, n) if side == "right" else slice(width - n, width)
        batch["input_ids"][row, where], batch["attention_mask"][row, where] = s["input_ids"], 1
    return batch


def real_rows(hidden, inputs):
    """(batch, seq, hidden) -> (tokens, hidden): the real tokens, sequence after sequence."""
    mask = inputs.get("attention_mask")
    return hidden.flatten(0, 1) if mask is None else hidden[mask.bool()]


def reference_states(model, seqs, monkeypatch):
    backend = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"  # whose mask of one whole sequence is None
    try:
        with every_layer_dense(monkeypatch):
            return torch.cat([model(input_ids=s["input_ids"][None]).last_hidden_state[0] for s in seqs])
    finally:
        model.config._attn_implementation = backend


ROUTES = {
    "right-padded, padding-free": lambda seqs: (padded(seqs), {}),
    "left-padded, padding-free": lambda seqs: (padded(seqs, "left"), {}),
    "right-padded, padded batch": lambda seqs: (padded(seqs), {"padding_free": False}),
    "left-padded, padded batch": lambda seqs: (padded(seqs, "left"), {"padding_free": False}),
    "flattened rows, packed": lambda seqs: (flattened(seqs), {}),
    "flattened rows, one row": lambda seqs: (flattened(seqs), {"padding_free": False}),
    "one sequence": lambda seqs: ({"input_ids": seqs[0]["input_ids"][None]}, {}),
}


def route_sequences(route):
    seqs = [{"input_ids": s["input_ids"], "token_type_ids": torch.zeros_like(s["input_ids"])} for s in sequences(LENGTHS)]
    return seqs[1:2] if route == "one sequence" else seqs


@pytest.mark.parametrize("window", [1, 7, 28, 29])  # the longest sequence: 30 tokens
@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex_attention"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_every_path_gives_the_dense_band_masked_softmax_on_real_tokens(route, backend, window, monkeypatch):
    model = windowed(window, attn_implementation=backend)
    seqs = route_sequences(route)
    inputs, options = ROUTES[route](seqs)
    with torch.no_grad():
        expected = reference_states(model, seqs, monkeypatch)
        actual = real_rows(model(**inputs, **options).last_hidden_state, inputs)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
