"""EncoderStackConfig mirrors BertConfig's fields and rejects impossible settings with messages that say why."""

import dataclasses
import json

import pytest
from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassError
from transformers import AutoConfig, BertConfig

from encoderstack import EncoderStackConfig


def test_every_bert_config_field_maps_onto_the_same_field():
    bert = BertConfig()
    ours = EncoderStackConfig()
    for name in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "hidden_act",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "max_position_embeddings",
        "type_vocab_size",
        "initializer_range",
        "layer_norm_eps",
        "pad_token_id",
        "classifier_dropout",
        "tie_word_embeddings",
    ):
        assert getattr(ours, name) == getattr(bert, name), name


def test_the_defaults_are_bert_with_post_ln():
    config = EncoderStackConfig()
    assert (config.norm_placement, config.norm_type, config.embedding_norm, config.position_embedding_type) == (
        "post",
        "layernorm",
        True,
        "absolute",
    )


def test_auto_config_builds_the_config_from_the_model_type():
    config = AutoConfig.for_model("encoderstack", norm_placement="pre", num_hidden_layers=24)
    assert isinstance(config, EncoderStackConfig)
    assert (config.norm_placement, config.num_hidden_layers) == ("pre", 24)


def test_a_config_survives_a_save_and_load(tmp_path):
    config = EncoderStackConfig(
        norm_placement="resi_dual",
        norm_type="rmsnorm",
        position_embedding_type="rope",
        rope_theta=500.0,
        resi_dual_scale=0.5,
        hidden_act="swiglu",
        embedding_norm=False,
    )
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    saved = {key: value for key, value in config.to_dict().items() if key != "_name_or_path"}
    assert {key: value for key, value in loaded.to_dict().items() if key != "_name_or_path"} == saved


ROTARY = {"position_embedding_type": "rope"}


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"hidden_size": 30, "num_attention_heads": 4},
            "`hidden_size` (30) must be divisible by `num_attention_heads` (4)",
        ),
        (
            {"norm_placement": "middle"},
            "Field 'norm_placement' expected one of ('post', 'pre', 'sandwich', 'deepnorm', 'resi_dual', 'peri', "
            "'mix', 'lns', 'hybrid', 'hybrid_star', 'admin', 'deepscale', 'pre_skip_first'), got middle",
        ),
        (
            {"norm_type": "batchnorm"},
            "Field 'norm_type' expected one of ('layernorm', 'rmsnorm', 'dyt', 'derf'), got batchnorm",
        ),
        ({"mix_ln_ratio": 1.5}, "`mix_ln_ratio` must lie in [0, 1], got 1.5"),
        ({"mix_ln_ratio": -0.25}, "`mix_ln_ratio` must lie in [0, 1], got -0.25"),
        ({"dyt_alpha_init": 0}, "`dyt_alpha_init` must be a positive finite number, got 0"),
        ({"hidden_act": "sparkle"}, "Unknown `hidden_act` 'sparkle'"),
        (
            {"position_embedding_type": "relative_key"},
            "Field 'position_embedding_type' expected one of ('absolute', 'sinusoidal', 'rope'), got relative_key",
        ),
        ({"num_hidden_layers": 0}, "`num_hidden_layers` must be a positive integer, got 0"),
        ({"vocab_size": -5}, "`vocab_size` must be a positive integer, got -5"),
        (
            {"vocab_size": 99, "pad_token_id": 99},
            "`pad_token_id` must be None or an id of the vocabulary, in [0, 98] (`vocab_size` 99), got 99",
        ),
        ({"hidden_dropout_prob": 1.0}, "`hidden_dropout_prob` must lie in [0, 1), got 1.0"),
        ({"attention_probs_dropout_prob": -0.1}, "`attention_probs_dropout_prob` must lie in [0, 1), got -0.1"),
        ({"classifier_dropout": 1.5}, "`classifier_dropout` must lie in [0, 1), got 1.5"),
        ({"position_embedding_type": "rope", "hidden_size": 36, "num_attention_heads": 4}, "even head size, got 9"),
        ({"resi_dual_scale": 0}, "`resi_dual_scale` must be a positive finite number, got 0"),
        ({"num_key_value_heads": 5}, "`num_key_value_heads` (5) must be a positive divisor of `num_attention_heads`"),
        ({"mlp_bias": "up"}, "Field 'mlp_bias' with value 'up' doesn't match any type"),
        ({**ROTARY, "rope_parameters": ["linear"]}, "`rope_parameters` must be a dict or None, got ['linear']"),
        ({**ROTARY, "rope_parameters": {"rope_type": "spiral"}}, "unknown rope_type 'spiral'"),
        (
            {**ROTARY, "rope_parameters": {"full_attention": {}, "global": {}}},
            "names ['global'], which are not layer types",
        ),
        (
            {**ROTARY, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0}},
            "partial_rotary_factor must lie in (0, 1], got 0",
        ),
        (
            {"rope_parameters": {"rope_type": "default"}},
            "`rope_parameters` needs rotary positions (position_embedding_type='rope'), got 'absolute'",
        ),
        ({"prediction_head_size": 0}, "`prediction_head_size` must be a positive integer or None, got 0"),
    ],
)
def test_an_impossible_config_is_rejected_with_a_clear_message(fields, message):
    with pytest.raises(StrictDataclassError) as error:
        EncoderStackConfig(**fields)
    assert message in str(error.value)


def test_every_float_field_refuses_nan_and_infinities():
    float_fields = [field.name for field in dataclasses.fields(EncoderStackConfig) if "float" in str(field.type)]
    assert {"layer_norm_eps", "initializer_range", "rope_theta", "resi_dual_scale", "hidden_dropout_prob"} <= set(
        float_fields
    )
    for name in float_fields:
        for value in (float("nan"), float("inf"), float("-inf")):
            with pytest.raises(StrictDataclassClassValidationError, match=f"`{name}` must .*, got {value}"):
                EncoderStackConfig(**{name: value})


def test_a_field_of_the_wrong_type_is_rejected():
    with pytest.raises(StrictDataclassError, match="embedding_norm"):
        EncoderStackConfig(embedding_norm="yes")


def has_rope_as_transformers_common_tests_see_it(config) -> bool:
    """transformers 5.25's ModelTesterMixin runs its RoPE tests on a config with these two attributes."""
    return hasattr(config, "rope_parameters") and hasattr(config, "max_position_embeddings")


@pytest.mark.parametrize("position_embedding_type", ["absolute", "sinusoidal"])
def test_a_config_without_rotary_positions_has_no_rope_parameters_even_when_loaded_from_an_old_file(
    position_embedding_type, tmp_path
):
    config = EncoderStackConfig(position_embedding_type=position_embedding_type)
    assert not has_rope_as_transformers_common_tests_see_it(config)
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" not in written
    # Files saved before this change carry `"rope_parameters": null`.
    (tmp_path / "config.json").write_text(json.dumps({**written, "rope_parameters": None}))
    assert not has_rope_as_transformers_common_tests_see_it(AutoConfig.from_pretrained(tmp_path))


def test_a_rotary_config_has_transformers_flat_rope_parameters_with_rope_theta():
    config = EncoderStackConfig(position_embedding_type="rope", rope_theta=500.0)
    assert has_rope_as_transformers_common_tests_see_it(config)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 500.0}


def test_a_saved_per_layer_type_rope_parameters_loads_unchanged(tmp_path):
    """Configs saved before this change spelled `rope_parameters` out per layer type, whatever the layer types."""
    per_type = {
        "full_attention": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    EncoderStackConfig(position_embedding_type="rope").save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**written, "rope_parameters": per_type}))
    assert AutoConfig.from_pretrained(tmp_path).rope_parameters == per_type
