"""Each norm placement computes exactly its equation (DESIGN.md §3), transcribed here from the model's own weights
with plain tensor math, never by calling the model's wiring."""

import math

import pytest
import torch
from conftest import PLACEMENTS, batch, build, real

from encoderstack import EncoderStackModel
from encoderstack.configuration_encoderstack import PLACEMENT_EQUATIONS
from encoderstack.modeling_encoderstack import PLACEMENTS as POLICY


def norm(module, x, norm_type):
    """LayerNorm (x - mean) / sqrt(var + eps) * w + b, or RMSNorm x / sqrt(mean(x^2) + eps) * w, as the config says."""
    if norm_type == "rmsnorm":
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + module.eps) * module.weight
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + module.eps) * module.weight + module.bias


def linear(module, x):
    return x @ module.weight.T + module.bias


def sinusoidal(seq_length, width):
    """The 2017 Transformer's table, entry by entry: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...)."""
    table = torch.zeros(seq_length, width)
    for p in range(seq_length):
        for i in range(0, width, 2):
            table[p, i] = math.sin(p / 10000 ** (i / width))
            if i + 1 < width:
                table[p, i + 1] = math.cos(p / 10000 ** (i / width))
    return table


def embeddings(model, inputs):
    """word + token type + position (learned rows or the sinusoidal table, none with rotary), then the norm."""
    embeddings, config = model.embeddings, model.config
    seq_length = inputs["input_ids"].shape[1]
    x = (
        embeddings.word_embeddings.weight[inputs["input_ids"]]
        + embeddings.token_type_embeddings.weight[inputs["token_type_ids"]]
    )
    if config.position_embedding_type == "absolute":
        x = x + embeddings.position_embeddings.weight[:seq_length]
    elif config.position_embedding_type == "sinusoidal":
        x = x + sinusoidal(seq_length, config.hidden_size)
    return norm(embeddings.norm, x, config.norm_type) if config.embedding_norm else x


def rotate(x, theta):
    """RoFormer's rotation of (batch, heads, seq, head_dim), in the rotate-half pairing: coordinate i turns with
    coordinate i + head_dim/2 by the angle p * theta^(-2i / head_dim) at position p."""
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    for p in range(x.shape[2]):
        for i in range(half):
            angle = p * theta ** (-2 * i / x.shape[-1])
            first, second = x[:, :, p, i], x[:, :, p, i + half]
            out[:, :, p, i] = first * math.cos(angle) - second * math.sin(angle)
            out[:, :, p, i + half] = second * math.cos(angle) + first * math.sin(angle)
    return out


def attention(layer, x, attention_mask, config):
    batch_size, seq_length, width = x.shape
    heads = config.num_attention_heads
    split = lambda t: t.view(batch_size, seq_length, heads, width // heads).transpose(1, 2)  # noqa: E731
    q, k, v = (split(linear(getattr(layer.attention, name), x)) for name in ("query", "key", "value"))
    if config.position_embedding_type == "rope":
        q, k = rotate(q, config.rope_theta), rotate(k, config.rope_theta)
    scores = q @ k.transpose(-1, -2) / math.sqrt(width // heads)
    scores = scores.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
    context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch_size, seq_length, width)
    return linear(layer.attention.output, context)


def gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def feed_forward(layer, x, config):
    """down(act(up(x))); gated: up's first half is the gate, GeGLU gelu(gate) * rest, SwiGLU silu(gate) * rest."""
    up = linear(layer.mlp.up, x)
    if config.hidden_act == "gelu":
        return linear(layer.mlp.down, gelu(up))
    gate, rest = up.chunk(2, dim=-1)
    gated = gelu(gate) if config.hidden_act == "geglu" else gate * torch.sigmoid(gate)
    return linear(layer.mlp.down, gated * rest)


def sublayers(layer, attention_mask, config):
    """The two sublayers F of one layer, each paired with its residual's norms."""
    return (
        (lambda x: attention(layer, x, attention_mask, config), layer.attention_residual),
        (lambda x: feed_forward(layer, x, config), layer.mlp_residual),
    )


def reference_stack(model, x, attention_mask):
    """DESIGN.md §3, one line per placement; also ResiDual's `d` stream under `resi_dual_scale` s: s·x + s·Σf."""
    config = model.config
    placement, n, s = config.norm_placement, config.num_hidden_layers, config.resi_dual_scale
    alpha = (2 * n) ** 0.25
    ln = lambda module, x: norm(module, x, config.norm_type)  # noqa: E731
    a, d = x, s * x
    h = x
    for layer in model.layers:
        for f, res in sublayers(layer, attention_mask, config):
            if placement == "post":
                h = ln(res.norm_out, h + f(h))
            elif placement == "pre":
                h = h + f(ln(res.norm_in, h))
            elif placement == "sandwich":
                h = h + ln(res.norm_branch, f(ln(res.norm_in, h)))
            elif placement == "deepnorm":
                h = ln(res.norm_out, alpha * h + f(h))
            elif placement == "resi_dual":
                out = f(a)
                a, d = ln(res.norm_out, a + out), d + s * out
    if placement in ("pre", "sandwich"):
        return ln(model.final.norm, h), None
    if placement == "resi_dual":
        return a + ln(model.final.norm, d), d
    return h, None


VARIANTS = {
    "bert": {},
    "rmsnorm": {"norm_type": "rmsnorm"},
    "rotary": {"position_embedding_type": "rope", "rope_theta": 100.0},  # a small base: every pair turns visibly
    "sinusoidal": {"position_embedding_type": "sinusoidal"},
    "geglu": {"hidden_act": "geglu"},
    "swiglu": {"hidden_act": "swiglu"},
    "no-embedding-norm": {"embedding_norm": False},
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_stack_output_equals_the_placement_equation(placement, variant):
    model = build(EncoderStackModel, norm_placement=placement, **VARIANTS[variant])
    inputs = batch()
    with torch.no_grad():
        expected, _ = reference_stack(model, embeddings(model, inputs), inputs["attention_mask"])
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
        build(
            EncoderStackModel,
            norm_placement="deepnorm",
            num_hidden_layers=config_layers,
            hidden_size=128,
            intermediate_size=256,
        ).config
    )
    beta = (8 * config_layers) ** -0.25
    layer = model.layers[3]
    std = model.config.initializer_range
    for linear_module, gain in (
        (layer.attention.query, 1.0),
        (layer.attention.key, 1.0),
        (layer.attention.value, beta),
        (layer.attention.output, beta),
        (layer.mlp.up, beta),
        (layer.mlp.down, beta),
    ):
        assert linear_module.weight.std().item() == pytest.approx(std * gain, rel=0.05)


def test_resi_dual_scale_scales_the_unnormalized_stream_and_leaves_the_output_unchanged():
    inputs = batch()
    mask = inputs["attention_mask"]
    reference = build(EncoderStackModel, norm_placement="resi_dual")
    scaled = build(EncoderStackModel, norm_placement="resi_dual", resi_dual_scale=0.125)
    streams = []
    scaled.layers[-1].mlp_residual.register_forward_hook(lambda module, args, out: streams.append(out[1]))
    with torch.no_grad():
        expected, actual = reference(**inputs).last_hidden_state, scaled(**inputs, padding_free=False).last_hidden_state
        _, d = reference_stack(scaled, embeddings(scaled, inputs), mask)
    torch.testing.assert_close(real(actual, mask), real(expected, mask), atol=1e-5, rtol=0)
    torch.testing.assert_close(real(streams[0], mask), real(d, mask), atol=1e-5, rtol=0)


def test_resi_dual_feeds_the_normalized_stream_to_the_next_sublayer():
    """The known wrong implementation normalizes the other stream; with a=d=x only the first sublayer agrees."""
    model = build(EncoderStackModel, norm_placement="resi_dual", num_hidden_layers=1)
    inputs = batch()
    captured = []
    model.layers[0].mlp.register_forward_hook(lambda module, args, out: captured.append(args[0]))
    with torch.no_grad():
        model(**inputs, padding_free=False)  # the hook reads the padded (batch, seq, hidden) layout
        embedded = embeddings(model, inputs)
        layer = model.layers[0]
        first = attention(layer, embedded, inputs["attention_mask"], model.config)
        expected = norm(layer.attention_residual.norm_out, embedded + first, model.config.norm_type)
    mask = inputs["attention_mask"]
    torch.testing.assert_close(real(captured[0], mask), real(expected, mask), atol=1e-5, rtol=0)


def test_the_policy_table_has_one_row_for_every_placement_the_config_accepts_and_nothing_else():
    assert tuple(POLICY) == PLACEMENTS
    assert tuple(PLACEMENT_EQUATIONS) == PLACEMENTS


def test_only_deepnorm_scales_the_residual_and_the_init_and_only_resi_dual_keeps_a_second_stream():
    for name, placement in POLICY.items():
        scaled = placement.alpha(6) != 1.0 or placement.init_gain(6) != 1.0
        assert scaled == (name == "deepnorm"), name
        assert placement.dual_stream == (name == "resi_dual"), name
    assert POLICY["deepnorm"].init_gain(6) == pytest.approx(48**-0.25)
