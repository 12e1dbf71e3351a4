"""Each norm placement computes exactly its equation (DESIGN.md §3), transcribed here from the model's own weights
with plain tensor math, never by calling the model's wiring."""

import math
from typing import get_args

import matplotlib.colors
import pytest
import torch
from conftest import PLACEMENTS, batch, build, real, tiny_config

from encoderstack import EncoderStackForMaskedLM, EncoderStackModel
from encoderstack.configuration_encoderstack import (
    HEAD_LAYOUTS,
    HEADS,
    PLACEMENT_EQUATIONS,
    PLACEMENT_REGISTRY,
    EncoderStackConfig,
)
from encoderstack.diagnostics.plots import COLORS
from encoderstack.hub_card import PLACEMENT_TAGS, build_card
from encoderstack.modeling_encoderstack import PLACEMENTS as POLICY
from encoderstack.modeling_encoderstack import DynamicErf, DynamicTanh


def norm(module, x, norm_type):
    """LayerNorm (x - mean) / sqrt(var + eps) * w + b, RMSNorm x / sqrt(mean(x^2) + eps) * w, DyT
    w * tanh(alpha x) + b or Derf w * erf(alpha x + s) + b, as the config says."""
    if norm_type == "dyt":
        return torch.tanh(module.alpha * x) * module.weight + module.bias
    if norm_type == "derf":
        return torch.erf(module.alpha * x + module.shift) * module.weight + module.bias
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
    if config.norm_placement in ("hybrid", "hybrid_star"):  # HybridNorm's QKV-norm: over each head's features
        attention_module = layer.attention
        q, k, v = (
            norm(module, t, config.norm_type)
            for module, t in (
                (attention_module.query_norm, q),
                (attention_module.key_norm, k),
                (attention_module.value_norm, v),
            )
        )
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
    """DESIGN.md §3 and §15, one line per placement; also ResiDual's `d` stream under `resi_dual_scale` s: s·x + s·Σf.
    The norms and Admin's omegas are the model's weights; the wiring, the scales and the layer split are the papers'."""
    config = model.config
    placement, n, s = config.norm_placement, config.num_hidden_layers, config.resi_dual_scale
    alpha = (2 * n) ** 0.25
    beta_deepscale = math.sqrt(1 / n)  # DeepScaleLM: beta^2 = 1/N, lambda^2 = 1 - beta^2
    lambda_deepscale = math.sqrt(1 - beta_deepscale**2)
    post_layers = math.floor(config.mix_ln_ratio * n)  # Mix-LN: post-LN in the first floor(ratio * N) layers
    ln = lambda module, x: norm(module, x, config.norm_type)  # noqa: E731
    a, d = x, s * x
    h = x
    for l, layer in enumerate(model.layers, start=1):  # noqa: E741  (l: the papers' 1-based layer index)
        (attend, attention_res), (ffn, ffn_res) = sublayers(layer, attention_mask, config)
        if placement == "hybrid" or (placement == "hybrid_star" and l > 1):
            # HybridNorm: X' = X + MHA(QKV-Norm(X)); X_next = FFN(Norm(X')) + Norm(X')
            y = h + attend(h)
            z = ln(attention_res.norm_out, y)
            h = ffn(z) + z
            continue
        for f, res in ((attend, attention_res), (ffn, ffn_res)):
            block = placement
            if placement == "mix":
                block = "post" if l <= post_layers else "pre"
            if placement == "hybrid_star":  # HybridNorm*: the first block pre-norm (its attention keeps QKV-Norm)
                block = "pre"
            if placement == "pre_skip_first":  # ModernBERT: pre-LN, the first attention without an input norm
                block = "bare" if (l, res) == (1, attention_res) else "pre"
            if block in ("post", "admin"):  # Admin: LN(omega * h + f(h)), omega 1 until profiled
                omega = res.omega if block == "admin" else 1.0
                h = ln(res.norm_out, omega * h + f(h))
            elif block == "pre":
                h = h + f(ln(res.norm_in, h))
            elif block == "bare":
                h = h + f(h)
            elif block in ("sandwich", "peri"):
                h = h + ln(res.norm_branch, f(ln(res.norm_in, h)))
            elif block == "deepnorm":
                h = ln(res.norm_out, alpha * h + f(h))
            elif block == "lns":
                h = h + f(ln(res.norm_in, h) / math.sqrt(l))
            elif block == "deepscale":
                h = lambda_deepscale * h + beta_deepscale * f(ln(res.norm_in, h))
            elif block == "resi_dual":
                out = f(a)
                a, d = ln(res.norm_out, a + out), d + s * out
    if placement in ("post", "deepnorm", "admin"):
        return h, None
    if placement == "resi_dual":
        return a + ln(model.final.norm, d), d
    return ln(model.final.norm, h), None


def admin_omegas(model, inputs):
    """Admin's profiling (Liu et al. 2020; its reference code's adaptive profiling), from the equations:
    omega_1 = 1, omega_{i+1} = sqrt(Var[omega_i x_{i-1}] + Var[f_i(x_{i-1})]), x_i = LN(omega_i x_{i-1} + f_i(x_{i-1})),
    variances over every feature of the real tokens."""
    config, mask = model.config, inputs["attention_mask"]
    real_tokens = mask.bool()
    h, omega, omegas = embeddings(model, inputs), 1.0, []
    for layer in model.layers:
        for f, res in sublayers(layer, mask, config):
            branch = f(h)
            omegas.append(omega)
            next_omega = math.sqrt((omega * h)[real_tokens].var(correction=0) + branch[real_tokens].var(correction=0))
            h, omega = norm(res.norm_out, omega * h + branch, config.norm_type), next_omega
    return omegas


VARIANTS = {
    "bert": {},
    "rmsnorm": {"norm_type": "rmsnorm"},
    "rotary": {"position_embedding_type": "rope", "rope_theta": 100.0},  # a small base: every pair turns visibly
    "sinusoidal": {"position_embedding_type": "sinusoidal"},
    "geglu": {"hidden_act": "geglu"},
    "swiglu": {"hidden_act": "swiglu"},
    "no-embedding-norm": {"embedding_norm": False},
    "dyt": {"norm_type": "dyt"},
    "derf": {"norm_type": "derf"},
}
# Mix-LN's default ratio makes no layer of the tiny 3-layer stack post-LN: with 0.5, the first is.
PLACEMENT_FIELDS = {"mix": {"mix_ln_ratio": 0.5}}


def placement_model(placement, **fields):
    return build(EncoderStackModel, norm_placement=placement, **PLACEMENT_FIELDS.get(placement, {}), **fields)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_stack_output_equals_the_placement_equation(placement, variant):
    model = placement_model(placement, **VARIANTS[variant])
    inputs = batch()
    if placement == "admin":  # profiled omegas, not the 1s of a fresh model (that would be post-LN)
        model.profile_admin(**inputs)
    with torch.no_grad():
        expected, _ = reference_stack(model, embeddings(model, inputs), inputs["attention_mask"])
        actual = model(**inputs).last_hidden_state
    mask = inputs["attention_mask"]
    torch.testing.assert_close(real(actual, mask), real(expected, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_each_placement_has_exactly_the_norms_its_equation_uses(placement):
    model = placement_model(placement)
    qkv = {"query_norm", "key_norm", "value_norm"}
    expected = {
        "post": {"norm_out"},
        "pre": {"norm_in", "final"},
        "sandwich": {"norm_in", "norm_branch", "final"},
        "deepnorm": {"norm_out"},
        "resi_dual": {"norm_out", "final"},
        "peri": {"norm_in", "norm_branch", "final"},
        "mix": {"norm_out", "norm_in", "final"},
        "lns": {"norm_in", "final"},
        "hybrid": {"norm_out", "final", *qkv},
        "hybrid_star": {"norm_in", "norm_out", "final", *qkv},
        "admin": {"norm_out"},
        "deepscale": {"norm_in", "final"},
        "pre_skip_first": {"norm_in", "final"},
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


def test_the_config_choices_the_card_the_tags_and_the_plots_all_follow_the_one_registry(tmp_path):
    names = tuple(PLACEMENT_REGISTRY)
    assert get_args(EncoderStackConfig.__annotations__["norm_placement"]) == PLACEMENTS == names
    assert get_args(EncoderStackConfig.__annotations__["head_layout"]) == HEAD_LAYOUTS == tuple(HEADS)
    assert {name: entry.row for name, entry in PLACEMENT_REGISTRY.items()} == POLICY
    assert {name: entry.equation for name, entry in PLACEMENT_REGISTRY.items()} == PLACEMENT_EQUATIONS
    assert {name: entry.tag for name, entry in PLACEMENT_REGISTRY.items()} == PLACEMENT_TAGS
    assert {name: entry.colour for name, entry in PLACEMENT_REGISTRY.items()} == COLORS
    assert all(matplotlib.colors.is_color_like(colour) for colour in COLORS.values())
    assert len(set(COLORS.values())) == len(COLORS), "two placements drawn in one colour"
    for name, entry in PLACEMENT_REGISTRY.items():
        build(EncoderStackModel, num_hidden_layers=1, norm_placement=name).save_pretrained(tmp_path / name)
        card = build_card(tmp_path / name)
        assert card.data.tags == ["encoderstack", entry.tag]
        assert f"| norm placement | `{name}`: {entry.equation} |" in card.text.splitlines()


def test_preparing_for_training_profiles_admin_and_leaves_every_other_placement_as_built():
    inputs = batch()
    for placement in PLACEMENTS:
        model = build(EncoderStackForMaskedLM, norm_placement=placement)
        before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        model.prepare_for_training(**inputs)
        changed = [name for name, tensor in model.state_dict().items() if not torch.equal(tensor, before[name])]
        if placement == "admin":
            profiled = build(EncoderStackForMaskedLM, norm_placement="admin")
            profiled.load_state_dict(before)
            profiled.profile_admin(**inputs)
            assert changed and all(name.endswith("omega") for name in changed)
            for name in changed:
                assert torch.equal(model.state_dict()[name], profiled.state_dict()[name]), name
        else:
            assert changed == [], placement


def test_the_init_and_the_profiling_follow_the_layers_as_built_not_the_config_read_again():
    torch.manual_seed(0)
    config = build(EncoderStackModel, norm_placement="deepnorm", num_hidden_layers=8, hidden_size=128).config
    model = EncoderStackModel(config)
    model.config.norm_placement = "post"
    value = model.layers[3].attention.value
    model._init_weights(value)
    assert value.weight.std().item() == pytest.approx(config.initializer_range * 64**-0.25, rel=0.05)
    admin = build(EncoderStackModel, norm_placement="admin")
    admin.config.norm_placement = "post"
    assert len(admin.profile_admin(**batch())) == 2 * admin.config.num_hidden_layers


def test_only_deepnorm_and_deepscale_scale_the_residual_and_the_init_and_only_resi_dual_keeps_a_second_stream():
    for name, placement in POLICY.items():
        scaled = placement.alpha(6) != 1.0 or placement.init_gain(6) != 1.0 or placement.fan_in_init
        assert scaled == (name in ("deepnorm", "deepscale")), name
        assert placement.dual_stream == (name == "resi_dual"), name
    assert POLICY["deepnorm"].init_gain(6) == pytest.approx(48**-0.25)


def test_peri_is_the_sandwich_row_under_another_name_and_gives_identical_outputs():
    assert POLICY["peri"] is POLICY["sandwich"]
    inputs = batch()
    with torch.no_grad():
        peri, sandwich = (placement_model(name)(**inputs).last_hidden_state for name in ("peri", "sandwich"))
    assert torch.equal(peri, sandwich)


@pytest.mark.parametrize("ratio, post_layers", [(0.0, 0), (0.25, 2), (0.4, 3), (1.0, 8)])
def test_mix_ln_makes_the_first_floor_of_ratio_times_depth_layers_post_ln_and_the_rest_pre_ln(ratio, post_layers):
    model = build(EncoderStackModel, norm_placement="mix", num_hidden_layers=8, mix_ln_ratio=ratio)
    for index, layer in enumerate(model.layers):
        for residual in (layer.attention_residual, layer.mlp_residual):
            is_post = isinstance(residual.norm_out, torch.nn.LayerNorm)
            assert is_post == (index < post_layers), index
            assert isinstance(residual.norm_in, torch.nn.LayerNorm) == (not is_post), index
    assert isinstance(model.final.norm, torch.nn.LayerNorm)


def test_layernorm_scaling_scales_each_layers_input_norm_by_one_over_the_root_of_its_1_based_index():
    model = build(EncoderStackModel, norm_placement="lns", num_hidden_layers=4)
    for l, layer in enumerate(model.layers, start=1):  # noqa: E741
        assert layer.attention_residual.input_scale == layer.mlp_residual.input_scale == pytest.approx(l**-0.5)


def test_admin_profiling_sets_each_shortcut_omega_by_its_variance_recursion():
    model = build(EncoderStackModel, norm_placement="admin", num_hidden_layers=4)
    inputs = batch()
    returned = model.profile_admin(**inputs)
    with torch.no_grad():
        expected = admin_omegas(model, inputs)
    residuals = [r for layer in model.layers for r in (layer.attention_residual, layer.mlp_residual)]
    stored = [residual.omega for residual in residuals]
    assert returned == pytest.approx(expected, rel=1e-5)
    assert expected[0] == 1.0 and len(set(expected)) == len(expected)
    for omega, value in zip(stored, expected):
        assert omega.shape == (model.config.hidden_size,) and omega.requires_grad
        torch.testing.assert_close(omega.detach(), torch.full_like(omega, value), atol=0, rtol=1e-5)


def test_admin_profiling_works_from_a_task_head_and_leaves_its_training_mode():
    model = build(EncoderStackForMaskedLM, norm_placement="admin").train()
    omegas = model.profile_admin(**batch())
    assert len(omegas) == 2 * model.config.num_hidden_layers and model.training
    assert model.model.layers[-1].mlp_residual.omega[0].item() == pytest.approx(omegas[-1])


def test_admin_profiling_is_refused_for_another_placement():
    with pytest.raises(ValueError, match="profile_admin is for norm_placement='admin', not 'post'"):
        build(EncoderStackModel, norm_placement="post").profile_admin(**batch())


def test_deepscale_scales_shortcut_and_branch_by_lambda_and_beta_with_beta_squared_one_over_depth():
    depth = 8
    model = build(EncoderStackModel, norm_placement="deepscale", num_hidden_layers=depth)
    for residual in (model.layers[0].attention_residual, model.layers[-1].mlp_residual):
        assert residual.branch_scale**2 == pytest.approx(1 / depth)
        assert residual.alpha**2 + residual.branch_scale**2 == pytest.approx(1.0)


def test_deepscale_initializes_every_projection_of_a_layer_with_variance_one_over_fan_in():
    torch.manual_seed(0)
    config = build(EncoderStackModel, norm_placement="deepscale", hidden_size=128, intermediate_size=256).config
    layer = EncoderStackModel(config).layers[1]
    attention, mlp = layer.attention, layer.mlp
    for projection in (attention.query, attention.key, attention.value, attention.output, mlp.up, mlp.down):
        assert projection.weight.std().item() == pytest.approx(projection.in_features**-0.5, rel=0.05)
        assert torch.count_nonzero(projection.bias) == 0


@pytest.mark.parametrize("norm_type", ["dyt", "derf"])
def test_dyt_and_derf_replace_every_norm_start_from_dyt_alpha_init_and_learn_alpha(norm_type):
    torch.manual_seed(0)
    model = EncoderStackForMaskedLM(tiny_config(norm_type=norm_type, dyt_alpha_init=0.8))
    norms = [
        module for module in model.modules() if type(module) is {"dyt": DynamicTanh, "derf": DynamicErf}[norm_type]
    ]
    assert not [module for module in model.modules() if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm))]
    assert len(norms) == 1 + 2 * model.config.num_hidden_layers + 1  # embeddings, each post-LN sublayer, LM head
    for module in norms:
        assert module.alpha.tolist() == pytest.approx([0.8])
        assert torch.equal(module.weight, torch.ones_like(module.weight))
        assert torch.equal(module.bias, torch.zeros_like(module.bias))
        assert norm_type == "dyt" or module.shift.tolist() == [0.0]
    inputs = batch()
    model(**inputs, labels=inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)).loss.backward()
    assert all(module.alpha.grad is not None and module.alpha.grad.abs().item() > 0 for module in norms)
