"""The config switches the pre-norm modern encoders need (ModernBERT, EuroBERT, UltraBERT, NeoBERT, GTE, NomicBERT):
bias switches, grouped-query attention, rotary parameters per layer type with transformers' scalings, the placement
row whose first attention has no input norm, and the head variants. Parity with each family's own class is in
test_convert_modern.py; here, each mechanism on constructed configs."""

import pytest
import torch
import transformers
from conftest import batch, build, real, tiny_config

import encoderstack
from encoderstack.modeling_encoderstack import EncoderStackRotaryEmbedding, apply_rotary

ROPE = {"position_embedding_type": "rope", "rope_theta": 100.0}


def biases(model) -> set:
    """The names of the modules that have a bias, with the layer index written as {i}."""
    names = {name.rsplit(".", 1)[0] for name, _ in model.named_parameters() if name.endswith(".bias")}
    return {".".join("{i}" if part.isdigit() else part for part in name.split(".")) for name in names}


ATTENTION = {f"layers.{{i}}.attention.{name}" for name in ("query", "key", "value", "output")}
MLP = {"layers.{i}.mlp.up", "layers.{i}.mlp.down"}
NORMS = {"embeddings.norm", "layers.{i}.attention_residual.norm_out", "layers.{i}.mlp_residual.norm_out"}


@pytest.mark.parametrize(
    ("fields", "removed"),
    [
        ({}, set()),
        ({"attention_bias": False}, ATTENTION),
        ({"mlp_bias": False}, MLP),
        ({"mlp_bias": "down"}, {"layers.{i}.mlp.up"}),
        ({"norm_bias": False}, NORMS),
        ({"attention_bias": False, "mlp_bias": False, "norm_bias": False}, ATTENTION | MLP | NORMS),
    ],
)
def test_each_bias_switch_removes_exactly_its_biases(fields, removed):
    everything = ATTENTION | MLP | NORMS | {"pooler.dense"}
    assert biases(build(encoderstack.EncoderStackModel)) == everything
    assert biases(build(encoderstack.EncoderStackModel, **fields)) == everything - removed


def test_without_norm_biases_the_masked_lm_heads_norm_has_none_and_the_decoder_bias_is_its_own_switch():
    model = build(encoderstack.EncoderStackForMaskedLM, norm_bias=False, classifier_bias=False, decoder_bias=False)
    assert model.lm_head.norm.bias is None and model.lm_head.dense.bias is None and model.lm_head.decoder.bias is None
    assert build(encoderstack.EncoderStackForMaskedLM, norm_bias=False).lm_head.decoder.bias is not None


def repeated_heads(state: dict, groups: int, head_dim: int) -> dict:
    """The same weights for multi-head attention: every key/value head repeated for the query heads it serves."""

    def repeat(tensor):
        heads = tensor.unflatten(0, (-1, head_dim))
        return heads.repeat_interleave(groups, dim=0).flatten(0, 1)

    return {
        name: repeat(value) if ".attention.key." in name or ".attention.value." in name else value
        for name, value in state.items()
    }


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("padding_free", [True, False])
def test_grouped_query_attention_equals_multi_head_attention_with_repeated_key_value_heads(backend, padding_free):
    grouped = build(encoderstack.EncoderStackModel, num_key_value_heads=2, **ROPE)
    assert grouped.layers[0].attention.key.weight.shape == (16, 32)  # 2 heads of 8
    full = build(encoderstack.EncoderStackModel, **ROPE)
    full.load_state_dict(repeated_heads(grouped.state_dict(), groups=2, head_dim=8))
    inputs = batch()
    for model in (grouped, full):
        model.set_attn_implementation(backend)
    with torch.no_grad():
        outputs = [model(**inputs, padding_free=padding_free).last_hidden_state for model in (grouped, full)]
    mask = inputs["attention_mask"]
    torch.testing.assert_close(real(outputs[0], mask), real(outputs[1], mask), atol=1e-5, rtol=0)


def test_one_key_value_head_per_query_head_is_the_default():
    assert build(encoderstack.EncoderStackModel).layers[0].attention.key.weight.shape == (32, 32)


def rotary_tables(base: float, positions: torch.Tensor, head_dim: int = 8):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = positions[..., None].float() * inv_freq
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(-2)
    return angles.cos(), angles.sin()


def test_each_layer_gets_the_rotary_base_of_its_layer_type():
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    model = build(
        encoderstack.EncoderStackModel,
        num_hidden_layers=4,
        layer_types=types,
        sliding_window=64,  # wider than the batch: the bases alone differ between the types
        rope_parameters={"full_attention": {"rope_theta": 160000.0}, "sliding_attention": {"rope_theta": 10.0}},
        **ROPE,
    )
    received = []
    for layer in model.layers:
        layer.attention.register_forward_pre_hook(lambda module, args: received.append(args[2]))
    inputs = batch()
    with torch.no_grad():
        model(**inputs, padding_free=False)
    positions = torch.arange(inputs["input_ids"].shape[1])[None].expand_as(inputs["input_ids"])
    for layer_type, (cos, sin) in zip(types, received, strict=True):
        want = rotary_tables(160000.0 if layer_type == "full_attention" else 10.0, positions)
        torch.testing.assert_close((cos, sin), want, atol=1e-6, rtol=0)


def test_one_flat_rotary_dict_applies_to_every_layer_type_and_rope_theta_fills_a_missing_base():
    config = build(encoderstack.EncoderStackModel, rope_parameters={"rope_type": "default"}, **ROPE).config
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100.0}  # transformers' flat form, kept
    assert config.rope_parameters_by_type() == {
        layer_type: {"rope_type": "default", "rope_theta": 100.0}
        for layer_type in ("full_attention", "sliding_attention")
    }


def test_a_flat_rotary_dict_gives_the_per_layer_type_dicts_numbers_on_full_and_sliding_layers():
    fields = {"num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 2}
    scaling = {"rope_type": "linear", "rope_theta": 100.0, "factor": 2.0}
    flat = build(encoderstack.EncoderStackModel, rope_parameters=scaling, **fields, **ROPE)
    per_type = build(
        encoderstack.EncoderStackModel,
        rope_parameters={"full_attention": dict(scaling), "sliding_attention": dict(scaling)},
        **fields,
        **ROPE,
    )
    inputs = batch()
    with torch.no_grad():
        assert torch.equal(flat(**inputs).last_hidden_state, per_type(**inputs).last_hidden_state)


def set_rope_parameters_as_transformers_common_tests_do(config, parameters: dict):
    """What transformers 5.25's ModelTesterMixin RoPE tests do to a built config: merge a flat dict into
    `rope_parameters` by assignment (no `__init__` runs again)."""
    config.rope_parameters = getattr(config, "rope_parameters", None) or {}
    config.rope_parameters.update(parameters)


def last_hidden_states(config, *inputs) -> list:
    torch.manual_seed(42)  # the same weights for every config
    model = encoderstack.EncoderStackModel(config).eval()
    with torch.no_grad():
        return [model(ids).last_hidden_state for ids in inputs]


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn"])
def test_a_flat_rotary_scaling_merged_into_a_built_config_changes_outputs_as_transformers_common_test_expects(
    rope_type,
):
    """transformers' `test_model_rope_scaling_from_config`: factor 10, on 10 tokens and on 1.5 x the trained length.
    Dynamic NTK rescales only beyond `max_position_embeddings`, so the short input's outputs stay the same."""
    config = tiny_config(max_position_embeddings=16, **ROPE)
    short, long = torch.randint(1, 99, (1, 10)), torch.randint(1, 99, (1, 24))
    default = {"rope_type": "default", "rope_theta": 10_000.0, "original_max_position_embeddings": 16384}
    set_rope_parameters_as_transformers_common_tests_do(config, default)
    original_short, original_long = last_hidden_states(config, short, long)
    set_rope_parameters_as_transformers_common_tests_do(config, {"rope_type": rope_type, "factor": 10.0})
    scaled_short, scaled_long = last_hidden_states(config, short, long)
    if rope_type == "dynamic":
        torch.testing.assert_close(scaled_short, original_short, atol=1e-5, rtol=1e-5)
    else:
        assert not torch.allclose(scaled_short, original_short, atol=1e-5)
    assert not torch.allclose(scaled_long, original_long, atol=1e-5)


@pytest.mark.parametrize("rope_type", ["default", "linear"])
def test_partial_rotation_turns_the_leading_share_of_each_head_and_passes_the_rest_through(rope_type):
    """transformers' `partial_rotary_factor` (its test for it sets it on a built config, flat): the rotary tables span
    that share of the head, as transformers' own frequency functions compute them."""
    config = tiny_config(**ROPE)
    parameters = {"rope_type": rope_type, "partial_rotary_factor": 0.5} | (
        {"factor": 2.0} if rope_type != "default" else {}
    )
    set_rope_parameters_as_transformers_common_tests_do(config, parameters)
    model = encoderstack.EncoderStackModel(config).eval()
    positions = torch.arange(9)[None]
    cos, sin = model.rotary(positions, torch.float32)["full_attention"]
    scale = 2.0 if rope_type == "linear" else 1.0
    torch.testing.assert_close((cos, sin), rotary_tables(100.0, positions / scale, head_dim=4), atol=1e-6, rtol=0)
    x = torch.randn(1, 9, 4, 8)
    rotated = apply_rotary(x, cos, sin)
    assert torch.equal(rotated[..., 4:], x[..., 4:])
    first, second = x[..., :4].chunk(2, dim=-1)
    torch.testing.assert_close(rotated[..., :4], x[..., :4] * cos + torch.cat((-second, first), dim=-1) * sin)
    full = build(encoderstack.EncoderStackModel, **ROPE)
    full.load_state_dict(model.state_dict())
    inputs = batch()
    with torch.no_grad():
        assert not torch.allclose(model(**inputs).last_hidden_state, full(**inputs).last_hidden_state, atol=1e-5)


def test_linear_rotary_scaling_equals_the_default_rotary_at_scaled_positions():
    """(Through the tables: position ids 0, 2, 4, ... given to a model would mark every token a sequence of its own.)"""
    config = build(encoderstack.EncoderStackModel, **ROPE).config
    scaled = build(encoderstack.EncoderStackModel, rope_parameters={"rope_type": "linear", "factor": 2.0}, **ROPE)
    positions = torch.arange(9)[None]
    torch.testing.assert_close(
        scaled.rotary(2 * positions, torch.float32),
        EncoderStackRotaryEmbedding(config)(positions, torch.float32),
        atol=1e-6,
        rtol=0,
    )


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 500.0},
        {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0},
        {"rope_type": "dynamic", "rope_theta": 500.0, "factor": 2.0},
        {"rope_type": "yarn", "rope_theta": 500.0, "factor": 2.0, "original_max_position_embeddings": 16},
    ],
    ids=lambda parameters: parameters["rope_type"],
)
def test_rotary_tables_equal_the_gte_classes_for_each_scaling_including_dynamic_growth_and_reset(rope_parameters):
    """transformers' GteRotaryEmbedding is the reference (NomicBERT's is the same code): the same tables for positions
    within the trained length, beyond it (dynamic NTK recomputes its base) and back within it."""
    fields = {"hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 16}
    gte = transformers.models.gte.modeling_gte.GteRotaryEmbedding(
        transformers.GteConfig(**fields, rope_parameters=dict(rope_parameters))
    )
    config = encoderstack.EncoderStackConfig(**fields, rope_parameters=dict(rope_parameters), **ROPE)
    ours = EncoderStackRotaryEmbedding(config)
    x = torch.zeros(1)
    for length in (8, 40, 24, 8):
        positions = torch.arange(length)[None]
        cos, sin = ours(positions, torch.float32)["full_attention"]
        want_cos, want_sin = gte(x, positions)
        torch.testing.assert_close(cos.squeeze(-2), want_cos, atol=1e-6, rtol=0, msg=f"cos at length {length}")
        torch.testing.assert_close(sin.squeeze(-2), want_sin, atol=1e-6, rtol=0, msg=f"sin at length {length}")


def test_pre_skip_first_has_no_input_norm_on_the_first_attention_only():
    model = build(encoderstack.EncoderStackModel, norm_placement="pre_skip_first")
    inputs = [(layer.attention_residual.norm_in, layer.mlp_residual.norm_in) for layer in model.layers]
    assert isinstance(inputs[0][0], torch.nn.Identity)
    assert all(isinstance(norm, torch.nn.LayerNorm) for pair in inputs for norm in pair if norm is not inputs[0][0])
    assert isinstance(model.final.norm, torch.nn.LayerNorm)


LAYOUTS = ("modernbert", "eurobert", "ultrabert")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_modern_masked_lm_heads_have_their_layouts_parts(layout):
    head = build(encoderstack.EncoderStackForMaskedLM, head_layout=layout, prediction_head_size=24).lm_head
    parts = {name.rsplit(".", 1)[0] for name, _ in head.named_parameters()}
    assert (
        parts
        == {
            "modernbert": {"dense", "norm", "decoder"},
            "eurobert": {"decoder"},
            "ultrabert": {"dense", "dense_out", "decoder"},
        }[layout]
    )
    if layout == "ultrabert":
        assert head.dense.weight.shape == (24, 32) and head.dense_out.weight.shape == (32, 24)


def masked_mean(hidden, mask):
    mask = mask[..., None].float()
    return (hidden * mask).sum(1) / mask.sum(1)


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("pooling", ["first", "mean", "late"])
def test_sequence_pooling_reads_the_first_real_token_the_mean_or_averages_the_token_logits(pooling, padding_free):
    model = build(
        encoderstack.EncoderStackForSequenceClassification, head_layout="eurobert", classifier_pooling=pooling
    )
    inputs = batch()
    mask = inputs["attention_mask"]
    with torch.no_grad():
        hidden = model.model(**inputs).last_hidden_state
        logits = model(**inputs, padding_free=padding_free).logits
        if pooling == "late":
            want = masked_mean(model.classifier(model.transform(hidden)), mask)
        else:
            pooled = hidden[:, 0] if pooling == "first" else masked_mean(hidden, mask)
            want = model.classifier(model.transform(pooled))
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling", ["mean", "late"])
def test_mean_pooling_of_flattened_rows_gives_each_sequence_what_it_gets_alone(pooling):
    model = build(encoderstack.EncoderStackForSequenceClassification, head_layout="modernbert", **ROPE)
    model.config.classifier_pooling = pooling
    ids = torch.randint(1, 99, (1, 9), generator=torch.Generator().manual_seed(3))
    bounds = ((0, 4), (4, 9))
    with torch.no_grad():
        alone = torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in bounds])
        flattened = model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])).logits
    torch.testing.assert_close(flattened, alone, atol=1e-5, rtol=0)


def test_modernberts_token_heads_run_the_prediction_head_on_every_token():
    model = build(encoderstack.EncoderStackForTokenClassification, head_layout="modernbert", norm_bias=False)
    assert model.pre_classifier_norm.bias is None
    inputs = batch()
    with torch.no_grad():
        hidden = model.model(**inputs).last_hidden_state
        want = model.classifier(model.pre_classifier_norm(torch.nn.functional.gelu(model.pre_classifier(hidden))))
        logits = model(**inputs).logits
    mask = inputs["attention_mask"]
    torch.testing.assert_close(real(logits, mask), real(want, mask), atol=1e-5, rtol=0)
