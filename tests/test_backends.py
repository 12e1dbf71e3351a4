"""Every placement runs the same on every attention backend, ignores padding, and trains finitely with every head."""

import pytest
import torch
from conftest import (
    BACKENDS,
    HEADS,
    REPRESENTATIVE_PLACEMENTS,
    batch,
    build,
    first_output,
    head_inputs,
    head_labels,
    real,
)

from encoderstack import EncoderStackModel

VARIANTS = [
    {},
    {"position_embedding_type": "sinusoidal"},
    {"position_embedding_type": "rope"},
    {"norm_type": "rmsnorm", "embedding_norm": False},
    {"hidden_act": "geglu"},
    {"hidden_act": "swiglu"},
]


def hidden(model, inputs, backend, padding_free=True):
    model.set_attn_implementation(backend)
    with torch.no_grad():
        return model(**inputs, padding_free=padding_free).last_hidden_state


@pytest.mark.parametrize("padding_free", [True, False], ids=["padding_free", "padded"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())) or "bert")
@pytest.mark.parametrize("placement", REPRESENTATIVE_PLACEMENTS)
def test_sdpa_gives_the_same_real_token_outputs_as_eager(placement, variant, padding_free):
    model = build(EncoderStackModel, norm_placement=placement, **variant)
    inputs = batch()
    mask = inputs["attention_mask"]
    eager, sdpa = hidden(model, inputs, "eager", padding_free), hidden(model, inputs, "sdpa", padding_free)
    torch.testing.assert_close(real(sdpa, mask), real(eager, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("padding_free", [True, False], ids=["padding_free", "padded"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())) or "bert")
@pytest.mark.parametrize("placement", REPRESENTATIVE_PLACEMENTS)
def test_a_sequence_alone_equals_the_same_sequence_inside_a_padded_batch(placement, variant, backend, padding_free):
    model = build(EncoderStackModel, norm_placement=placement, **variant)
    padded = batch()
    together = hidden(model, padded, backend, padding_free)
    for row, length in enumerate(padded["attention_mask"].sum(1).tolist()):
        alone = {key: value[row : row + 1, :length] for key, value in padded.items()}
        torch.testing.assert_close(hidden(model, alone, backend)[0], together[row, :length], atol=1e-5, rtol=0)


@pytest.mark.parametrize("padding_free", [True, False], ids=["padding_free", "padded"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("placement", REPRESENTATIVE_PLACEMENTS)
def test_a_row_of_only_padding_gives_finite_outputs(placement, backend, padding_free):
    model = build(EncoderStackModel, norm_placement=placement)
    inputs = batch(lengths=(9, 0, 4))
    out = hidden(model, inputs, backend, padding_free)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("placement", REPRESENTATIVE_PLACEMENTS)
@pytest.mark.parametrize("model_class", HEADS, ids=lambda c: c.__name__)
def test_forward_and_backward_are_finite_for_every_head(model_class, placement, backend):
    model = build(model_class, norm_placement=placement, attn_implementation=backend).train()
    inputs = batch()
    outputs = model(**head_inputs(model_class, inputs), **head_labels(model_class, inputs))
    loss = getattr(outputs, "loss", None)
    loss = loss if loss is not None else first_output(outputs).pow(2).mean()
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_flex_attention_gives_the_same_real_token_outputs_as_eager():
    """FlexAttention runs forward-only on CPU (torch has no CPU backward for it), so only inference is checked."""
    inputs = batch()
    mask = inputs["attention_mask"]
    for placement in REPRESENTATIVE_PLACEMENTS:
        model = build(EncoderStackModel, norm_placement=placement)
        for padding_free in (True, False):
            eager = hidden(model, inputs, "eager", padding_free)
            flex = hidden(model, inputs, "flex_attention", padding_free)
            torch.testing.assert_close(real(flex, mask), real(eager, mask), atol=1e-5, rtol=0)
