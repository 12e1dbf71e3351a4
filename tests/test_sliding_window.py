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
    seqs = [
        {"input_ids": s["input_ids"], "token_type_ids": torch.zeros_like(s["input_ids"])} for s in sequences(LENGTHS)
    ]
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


@pytest.mark.parametrize("route", ["right-padded, padding-free", "left-padded, padded batch", "flattened rows, packed"])
def test_training_gradients_agree_with_the_dense_band_masked_softmax(route, monkeypatch):
    """Training mode, no dropout: the same weighted sum of real-token states differentiates to the same gradients."""
    model = windowed(4, attn_implementation="sdpa").train()
    seqs = route_sequences(route)
    inputs, options = ROUTES[route](seqs)
    weights = torch.randn(sum(LENGTHS), model.config.hidden_size, generator=torch.Generator().manual_seed(7))

    def gradients(states):
        model.zero_grad()
        (states * weights).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    expected = gradients(reference_states(model, seqs, monkeypatch))
    actual = gradients(real_rows(model(**inputs, **options).last_hidden_state, inputs))
    assert expected.keys() == actual.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("off_by", [-1, 1])
@pytest.mark.parametrize("route", ["right-padded, padding-free", "left-padded, padded batch", "flattened rows, packed"])
def test_a_window_off_by_one_is_caught(route, off_by, monkeypatch):
    """The agreement above is exact enough to see one key more or one key less on each side."""
    model = windowed(7)
    seqs = route_sequences(route)
    inputs, options = ROUTES[route](seqs)
    right = ExecutionPlan.layer_attention

    def wrong(plan, layer_type):
        name, window = right(plan, layer_type)
        return name, {key: value + off_by for key, value in window.items()}

    with torch.no_grad():
        expected = reference_states(model, seqs, monkeypatch)
        monkeypatch.setattr(ExecutionPlan, "layer_attention", wrong)
        actual = real_rows(model(**inputs, **options).last_hidden_state, inputs)
    assert (actual - expected).abs().max() > 1e-3


class CreatedTensors(TorchDispatchMode):
    """The element count of every tensor any operation creates (views included)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sizes += [x.numel() for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        return out


MEMORY_ROUTES = {
    "one sequence": lambda ids: ({"input_ids": ids[:1]}, {}),
    "padded batch": lambda ids: ({"input_ids": ids, "attention_mask": padding_mask(ids)}, {"padding_free": False}),
    "padding-free": lambda ids: ({"input_ids": ids, "attention_mask": padding_mask(ids)}, {}),
}


def padding_mask(ids):
    return (torch.arange(ids.shape[1]) < torch.tensor([[ids.shape[1]], [ids.shape[1] - 100]])).long()


@pytest.mark.parametrize("route", list(MEMORY_ROUTES))
def test_no_tensor_of_a_sliding_layer_holds_sequence_squared_elements(route, monkeypatch):
    """S = 2048 tokens a row, radius 16, two heads, every layer sliding: the largest tensor any operation of the
    forward creates holds fewer than S * S elements (one head's score matrix of one row), where the same model with a
    dense band mask creates one of at least S * S elements (which shows the count can fail)."""
    S = 2048
    model = windowed(16, layer_types=["sliding_attention"] * 2, num_hidden_layers=2, num_attention_heads=2)
    model.config.max_position_embeddings = S
    inputs, options = MEMORY_ROUTES[route](torch.randint(1, 99, (2, S), generator=torch.Generator().manual_seed(0)))
    with torch.no_grad(), CreatedTensors() as banded:
        model(**inputs, **options)
    assert max(banded.sizes) < S * S
    assert model.execution_plan(**inputs, **options).sliding == "encoderstack_banded"
    monkeypatch.setattr(modeling_encoderstack, "sliding_attention", lambda facts, plan: ("sdpa", "dense"))
    with torch.no_grad(), CreatedTensors() as dense:
        model(**inputs, padding_free=False)
    assert max(dense.sizes) >= S * S


BF16, FP32 = torch.bfloat16, torch.float32
CPU, H100 = ("cpu", None), ("cuda", (9, 0))
BANDED, VARLEN, NESTED = "encoderstack_banded", "encoderstack_varlen", "encoderstack_nested"
# (device, dtype, input, other facts) -> (kind, full layers' attention, sliding layers' attention); radius 4, the
# longest sequence 30 tokens unless said
SLIDING_PLAN_TABLE = [
    ((CPU, FP32, "whole", {}), ("padded", "sdpa", BANDED)),
    ((CPU, FP32, "padded", {}), ("per_sequence", "encoderstack_per_sequence", BANDED)),
    ((CPU, FP32, "flattened", {}), ("per_sequence", "encoderstack_per_sequence", BANDED)),
    ((CPU, FP32, "padded", {"padding_free": False}), ("padded", "sdpa", BANDED)),
    ((CPU, FP32, "flattened", {"padding_free": False}), ("block_diagonal", "sdpa", BANDED)),
    ((CPU, FP32, "padded", {"backend": "eager", "padding_free": False}), ("padded", "eager", BANDED)),
    ((CPU, FP32, "padded", {"backend": "flex_attention", "padding_free": False}), ("padded", "flex_attention", BANDED)),
    ((CPU, FP32, "padded", {"compiling": True}), ("padded", "sdpa", "sdpa")),
    ((CPU, FP32, "flattened", {"compiling": True}), ("block_diagonal", "sdpa", "sdpa")),
    ((CPU, FP32, "whole", {"recording": True, "backend": "eager"}), ("padded", "eager", "eager")),
    ((CPU, FP32, "padded", {"longest": 5}), ("per_sequence", "encoderstack_per_sequence", None)),
    ((CPU, FP32, "padded", {"longest": 6}), ("per_sequence", "encoderstack_per_sequence", BANDED)),
    ((H100, BF16, "padded", {}), ("varlen", VARLEN, VARLEN)),
    ((H100, BF16, "flattened", {}), ("varlen", VARLEN, VARLEN)),
    ((H100, BF16, "padded", {"varlen_window": False}), ("varlen", VARLEN, BANDED)),
    ((H100, BF16, "padded", {"attention_dropout": True}), ("varlen", NESTED, BANDED)),
    ((H100, BF16, "flattened", {"attention_dropout": True}), ("varlen", NESTED, BANDED)),
    ((H100, BF16, "padded", {"backend": "flash_attention_2"}), ("varlen", "flash_attention_2", "flash_attention_2")),
    (
        (H100, BF16, "padded", {"backend": "flash_attention_2", "padding_free": False}),
        ("padded", "flash_attention_2", "flash_attention_2"),
    ),
    ((H100, FP32, "padded", {}), ("padded", "sdpa", BANDED)),
    ((H100, BF16, "padded", {"backend": "flex_attention"}), ("padded", "flex_attention", "flex_attention")),
    (
        (H100, BF16, "padded", {"backend": "flex_attention", "compiling": True}),
        ("padded", "flex_attention", "flex_attention"),
    ),
]


@pytest.mark.parametrize(("cell", "expected"), SLIDING_PLAN_TABLE, ids=[str(i) for i in range(len(SLIDING_PLAN_TABLE))])
def test_the_plan_says_how_sliding_layers_run_in_every_cell(cell, expected):
    device, dtype, inputs, other = cell
    plan = decide_plan(facts(device, dtype, inputs, **{"sliding_window": 4, "longest": 30, **other}))
    assert (plan.kind, plan.attention, plan.sliding) == expected, plan.reason
    assert "sliding layers: " in plan.reason
    name, window = plan.layer_attention("sliding_attention")
    assert (name, window) == ((expected[2], {"sliding_window": 5}) if expected[2] else (expected[1], {}))
    assert plan.layer_attention("full_attention") == (expected[1], {})


def test_without_sliding_layers_the_plan_is_the_one_it_was():
    for device, dtype, inputs in ((CPU, FP32, "padded"), (H100, BF16, "flattened"), (CPU, BF16, "whole")):
        cell = facts(device, dtype, inputs, longest=30)
        assert decide_plan(cell) == dataclasses.replace(decide_plan(cell), sliding=None)
        assert "sliding" not in decide_plan(cell).reason


@pytest.mark.parametrize("route", ["right-padded, padding-free", "flattened rows, one row", "one sequence"])
def test_layer_types_that_are_all_full_change_nothing(route):
    seqs = route_sequences(route)
    inputs, options = ROUTES[route](seqs)
    plain = build(EncoderStackModel, position_embedding_type="rope")
    full = build(
        EncoderStackModel, position_embedding_type="rope", layer_types=["full_attention"] * 3, sliding_window=2
    )
    with torch.no_grad():
        expected, actual = plain(**inputs, **options), full(**inputs, **options)
    torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, atol=0, rtol=0)
    assert full.execution_plan(**inputs, **options).reason == plain.execution_plan(**inputs, **options).reason


def test_a_prepared_4d_mask_with_sliding_layers_is_refused_in_one_line():
    model = windowed(2)
    ids = torch.randint(1, 99, (1, 9))
    with pytest.raises(ValueError, match="4-D `attention_mask` cannot carry the sliding layers' window"):
        model(input_ids=ids, attention_mask=torch.ones(1, 1, 9, 9, dtype=torch.bool))
