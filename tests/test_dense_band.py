"""Sliding layers on rows of at most DENSE_BAND_RADII radii take a dense band mask, which is faster there than banded
attention (one at a time with a band mask on the per-sequence path, the padded batch's band mask elsewhere), and give
the dense band-masked softmax as the banded path does (tests/test_sliding_window.py runs that one)."""

import pytest
import torch
from test_execution_plan import facts
from test_sliding_window import ROUTES, real_rows, reference_states, route_sequences, windowed

from encoderstack import execution_encoderstack
from encoderstack.execution_encoderstack import DENSE_BAND_RADII, PER_SEQUENCE, decide_plan

BANDED = "encoderstack_banded"
CPU, H100 = ("cpu", None), ("cuda", (9, 0))
RADIUS = 4
SHORT, LONG = DENSE_BAND_RADII * RADIUS, DENSE_BAND_RADII * RADIUS + 1
# (device, dtype, inputs, other facts) -> (kind, full layers' attention, sliding layers' attention)
DENSE_BAND_TABLE = [
    ((CPU, torch.float32, "padded", {"longest": SHORT}), ("per_sequence", PER_SEQUENCE, PER_SEQUENCE)),
    ((CPU, torch.float32, "flattened", {"longest": SHORT}), ("per_sequence", PER_SEQUENCE, PER_SEQUENCE)),
    ((CPU, torch.float32, "whole", {"longest": SHORT}), ("padded", "sdpa", "sdpa")),
    ((CPU, torch.float32, "padded", {"longest": SHORT, "padding_free": False}), ("padded", "sdpa", "sdpa")),
    ((CPU, torch.float32, "padded", {"longest": LONG}), ("per_sequence", PER_SEQUENCE, BANDED)),
    ((CPU, torch.float32, "whole", {"longest": LONG}), ("padded", "sdpa", BANDED)),
    ((CPU, torch.float32, "whole", {"longest": SHORT, "backend": "flex_attention"}),
     ("padded", "flex_attention", BANDED)),
    ((H100, torch.bfloat16, "padded", {"longest": SHORT, "attention_dropout": True}),
     ("varlen", "encoderstack_flash", "encoderstack_flash")),
]  # fmt: skip


@pytest.mark.parametrize(("cell", "expected"), DENSE_BAND_TABLE, ids=[str(i) for i in range(len(DENSE_BAND_TABLE))])
def test_the_plan_takes_a_dense_band_mask_up_to_its_limit_in_radii_and_banded_beyond(cell, expected):
    device, dtype, inputs, other = cell
    plan = decide_plan(facts(device, dtype, inputs, **{"sliding_window": RADIUS, **other}))
    assert (plan.kind, plan.attention, plan.sliding) == expected, plan.reason


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_every_path_with_a_dense_band_mask_gives_the_dense_band_masked_softmax(route, backend, monkeypatch):
    model = windowed(RADIUS, attn_implementation=backend)  # the longest sequence, 30 tokens, is within 8 radii
    seqs = route_sequences(route)
    inputs, options = ROUTES[route](seqs)
    assert model.execution_plan(**inputs, **options).sliding not in (BANDED, None)
    with torch.no_grad():
        with monkeypatch.context() as patch:  # the reference reads no mask: whole sequences, as the banded path
            patch.setattr(execution_encoderstack, "DENSE_BAND_RADII", 0)
            expected = reference_states(model, seqs, patch)
        actual = real_rows(model(**inputs, **options).last_hidden_state, inputs)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
