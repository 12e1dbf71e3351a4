"""Each norm placement computes exactly its equation (DESIGN.md §3), transcribed here from the model's own weights
with plain tensor math, never by calling the model's wiring."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import PLACEMENTS, batch, build, real

from encoderstack import EncoderStackModel


def norm(module, x):
    return F.layer_norm(x, x.shape[-1:], module.weight, module.bias, module.eps)


def linear(module, x):
    return x @ module.weight.T + module.bias


def attention(layer, x, attention_mask, heads):
    batch_size, seq_length, width = x.shape
    split = lambda t: t.view(batch_size, seq_length, heads, width // heads).transpose(1, 2)  # noqa: E731
    q, k, v = (split(linear(getattr(layer.attention, name), x)) for name in ("query", "key", "value"))
    scores = q @ k.transpose(-1, -2) / math.sqrt(width // heads)
    scores = scores.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
    context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch_size, seq_length, width)
    return linear(layer.attention.output, context)


def feed_forward(layer, x):
    return linear(layer.mlp.down, F.gelu(linear(layer.mlp.up, x)))


def sublayers(layer, attention_mask, heads):
    """The two sublayers F of one layer, each paired with its residual's norms."""
    return (
        (lambda x: attention(layer, x, attention_mask, heads), layer.attention_residual),
        (lambda x: feed_forward(layer, x), layer.mlp_residual),
    )


def reference_stack(model, x, attention_mask):
    """DESIGN.md §3, one line per placement."""
    config = model.config
    placement, n, heads = config.norm_placement, config.num_hidden_layers, config.num_attention_heads
    alpha = (2 * n) ** 0.25
    a, d = x, x
    h = x
    for layer in model.layers:
        for f, res in sublayers(layer, attention_mask, heads):
            if placement == "post":
                h = norm(res.norm_out, h + f(h))
            elif placement == "pre":
                h = h + f(norm(res.norm_in, h))
            elif placement == "sandwich":
                h = h + norm(res.norm_branch, f(norm(res.norm_in, h)))
            elif placement == "deepnorm":
                h = norm(res.norm_out, alpha * h + f(h))
            elif placement == "resi_dual":
                out = f(a)
                a, d = norm(res.norm_out, a + out), d + out
    if placement in ("pre", "sandwich"):
        return norm(model.final.norm, h)
    if placement == "resi_dual":
        return a + norm(model.final.norm, d)
    return h


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_stack_output_equals_the_placement_equation(placement):
    model = build(EncoderStackModel, norm_placement=placement)
    inputs = batch()
    with torch.no_grad():
        embedded = model.embeddings(inputs["input_ids"], inputs["token_type_ids"],
                                    torch.arange(9).expand(3, -1), None)
        expected = reference_stack(model, embedded, inputs["attention_mask"])
        actual = model(**inputs).last_hidden_state
    mask = inputs["attention_mask"]
    torch.testing.assert_close(real(actual, mask), real(expected, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_each_placement_has_exactly_the_norms_its_equation_uses(placement):
    model = build(EncoderStackModel, norm_placement=placement)
    expected = {
        "post": {"norm_out"},
        "pre": {"norm_in", "final"},
        "sandwich": {"norm_in", "norm_branch", "final"},
        "deepnorm": {"norm_out"},
        "resi_dual": {"norm_out", "final"},
    }[placement]
    names = {name.split(".")[-2] for name, _ in model.named_parameters() if "norm" in name and "embeddings" not in name}
    names = {"final" if name == "norm" else name for name in names}
    assert names == expected


def test_deepnorm_scales_the_residual_by_the_fourth_root_of_twice_the_depth():
    model = build(EncoderStackModel, norm_placement="deepnorm", num_hidden_layers=6)
    assert model.layers[0].attention_residual.alpha == pytest.approx(12**0.25)


def test_deepnorm_initializes_value_output_and_ffn_with_gain_beta_and_leaves_query_key_alone():
    config_layers = 8
    torch.manual_seed(0)
    model = EncoderStackModel(
        build(EncoderStackModel, norm_placement="deepnorm", num_hidden_layers=config_layers,
              hidden_size=128, intermediate_size=256).config
    )
    beta = (8 * config_layers) ** -0.25
    layer = model.layers[3]
    std = model.config.initializer_range
    for linear_module, gain in ((layer.attention.query, 1.0), (layer.attention.key, 1.0),
                                (layer.attention.value, beta), (layer.attention.output, beta),
                                (layer.mlp.up, beta), (layer.mlp.down, beta)):
        assert linear_module.weight.std().item() == pytest.approx(std * gain, rel=0.05)


def test_resi_dual_stream_scale_leaves_the_output_unchanged():
    inputs = batch()
    reference = build(EncoderStackModel, norm_placement="resi_dual")
    scaled = build(EncoderStackModel, norm_placement="resi_dual", resi_dual_scale=0.125)
    with torch.no_grad():
        expected, actual = reference(**inputs).last_hidden_state, scaled(**inputs).last_hidden_state
    mask = inputs["attention_mask"]
    torch.testing.assert_close(real(actual, mask), real(expected, mask), atol=1e-5, rtol=0)


def test_resi_dual_feeds_the_normalized_stream_to_the_next_sublayer():
    """The known wrong implementation normalizes the other stream; with a=d=x only the first sublayer agrees."""
    model = build(EncoderStackModel, norm_placement="resi_dual", num_hidden_layers=1)
    inputs = batch()
    captured = []
    model.layers[0].mlp.register_forward_hook(lambda module, args, out: captured.append(args[0]))
    with torch.no_grad():
        model(**inputs, padding_free=False)  # the hook reads the padded (batch, seq, hidden) layout
        embedded = model.embeddings(inputs["input_ids"], inputs["token_type_ids"], torch.arange(9).expand(3, -1), None)
        layer = model.layers[0]
        first = attention(layer, embedded, inputs["attention_mask"], model.config.num_attention_heads)
        expected = norm(layer.attention_residual.norm_out, embedded + first)
    mask = inputs["attention_mask"]
    torch.testing.assert_close(real(captured[0], mask), real(expected, mask), atol=1e-5, rtol=0)
