"""Padding-free execution gives the padded path's numbers on real tokens, and gradients, for every placement, head,
backend and position type; zeros at padded positions; the cheap path when nothing is padded; a switch that turns it
off."""

import pytest
import torch
from conftest import HEADS, REPRESENTATIVE_PLACEMENTS, batch, build, first_output, head_inputs, head_labels, real

import encoderstack
from encoderstack import EncoderStackConfig, EncoderStackModel, execution_encoderstack

TOKEN_LEVEL = (
    encoderstack.EncoderStackForMaskedLM,
    encoderstack.EncoderStackForPreTraining,
    encoderstack.EncoderStackForTokenClassification,
    encoderstack.EncoderStackForQuestionAnswering,
)
VARIANTS = [
    {"position_embedding_type": "sinusoidal"},
    {"position_embedding_type": "rope"},
    {"norm_type": "rmsnorm", "embedding_norm": False},
    {"hidden_act": "swiglu"},
]


@pytest.fixture
def packings(monkeypatch):
    """Every PackedSequences built during the test (the model finds the class by its module-level name)."""
    built = []

    class CountingPacking(execution_encoderstack.PackedSequences):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(execution_encoderstack, "PackedSequences", CountingPacking)
    return built


def outputs_on_real_tokens(outputs, mask):
    """Every output tensor of a head, per-token ones restricted to the real tokens."""
    tensors = {key: value for key, value in outputs.items() if key != "loss" and torch.is_tensor(value)}
    return {
        key: real(value, mask) if value.shape[: mask.dim()] == mask.shape else value for key, value in tensors.items()
    }


def objective(model_class, outputs, mask):
    """The head's own loss (the same on both paths: padded positions never enter it), else one on the real tokens."""
    if outputs.get("loss") is None:
        return sum(value.pow(2).mean() for value in outputs_on_real_tokens(outputs, mask).values())
    return outputs.loss


def run(model, model_class, inputs, labels, **kwargs):
    """Outputs on real tokens and every parameter's gradient."""
    model.zero_grad()
    outputs = model(**head_inputs(model_class, inputs), **labels, **kwargs)
    mask = head_inputs(model_class, inputs)["attention_mask"]
    objective(model_class, outputs, mask).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return {key: value.detach() for key, value in outputs_on_real_tokens(outputs, mask).items()}, grads


def assert_same(actual, expected):
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=1e-5, rtol=0, msg=key)


def assert_paths_agree(model, model_class, inputs, labels=None):
    labels = head_labels(model_class, inputs) if labels is None else labels
    padded_outputs, padded_grads = run(model, model_class, inputs, labels, padding_free=False)
    free_outputs, free_grads = run(model, model_class, inputs, labels)
    assert_same(free_outputs, padded_outputs)
    assert_same(free_grads, padded_grads)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("placement", REPRESENTATIVE_PLACEMENTS)
@pytest.mark.parametrize("model_class", HEADS, ids=lambda c: c.__name__)
def test_padding_free_gives_the_padded_outputs_on_real_tokens_and_the_same_gradients(
    model_class, placement, backend, packings
):
    model = build(model_class, norm_placement=placement, attn_implementation=backend).train()
    assert_paths_agree(model, model_class, batch())
    assert packings, "the padding-free run never packed the batch"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())))
@pytest.mark.parametrize("placement", ["post", "pre", "resi_dual"])
def test_every_position_type_norm_and_activation_agrees_between_the_paths(placement, variant):
    model = build(encoderstack.EncoderStackForMaskedLM, norm_placement=placement, **variant).train()
    assert_paths_agree(model, encoderstack.EncoderStackForMaskedLM, batch())


@pytest.mark.parametrize("position_embedding_type", ["absolute", "sinusoidal", "rope"])
def test_positions_stay_each_sequences_own_when_packed(position_embedding_type):
    """Left padding and explicit position ids: a packed token keeps the position it has in the padded batch. (The
    pooler reads position 0, as BERT's does, which under left padding is padding: only the tokens are compared.)"""
    model = build(EncoderStackModel, position_embedding_type=position_embedding_type)
    inputs = batch()
    left = {key: value.flip(-1) for key, value in inputs.items()}
    shifted = {**inputs, "position_ids": (torch.arange(9) + 3).expand(3, -1)}
    for case in (left, shifted):
        with torch.no_grad():
            padded = model(**case, padding_free=False).last_hidden_state
            free = model(**case).last_hidden_state
        mask = case["attention_mask"]
        torch.testing.assert_close(real(free, mask), real(padded, mask), atol=1e-5, rtol=0)


def test_flex_attention_runs_padding_free_with_the_same_outputs():
    """FlexAttention is forward-only on CPU (torch has no CPU backward for it)."""
    inputs = batch()
    mask = inputs["attention_mask"]
    for placement in REPRESENTATIVE_PLACEMENTS:
        model = build(EncoderStackModel, norm_placement=placement, attn_implementation="flex_attention")
        with torch.no_grad():
            padded = model(**inputs, padding_free=False)
            free = model(**inputs)
        torch.testing.assert_close(
            real(free.last_hidden_state, mask), real(padded.last_hidden_state, mask), atol=1e-5, rtol=0
        )
        torch.testing.assert_close(free.pooler_output, padded.pooler_output, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_class", TOKEN_LEVEL + (EncoderStackModel,), ids=lambda c: c.__name__)
def test_padded_positions_of_every_per_token_output_are_exactly_zero(model_class):
    """Except the span logits, which are masked to the dtype's minimum on every path (a span never starts there)."""
    model = build(model_class)
    inputs = batch()
    with torch.no_grad():
        out = first_output(model(**inputs))
    padding = inputs["attention_mask"] == 0
    expected = torch.finfo(out.dtype).min if model_class is encoderstack.EncoderStackForQuestionAnswering else 0.0
    assert torch.equal(out[padding], torch.full_like(out[padding], expected))


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("placement", REPRESENTATIVE_PLACEMENTS)
def test_a_row_of_only_padding_is_finite_and_zero_and_leaves_the_other_rows_unchanged(placement, backend):
    model = build(
        encoderstack.EncoderStackForSequenceClassification, norm_placement=placement, attn_implementation=backend
    )
    inputs = batch(lengths=(9, 0, 4))
    with torch.no_grad():
        padded = model.model(**inputs, padding_free=False)
        free = model.model(**inputs)
        logits = model(**inputs).logits
    assert torch.isfinite(free.last_hidden_state).all() and torch.isfinite(free.pooler_output).all()
    assert torch.isfinite(logits).all()
    assert torch.equal(free.last_hidden_state[1], torch.zeros_like(free.last_hidden_state[1]))
    for row in (0, 2):
        mask = inputs["attention_mask"][row].bool()
        torch.testing.assert_close(
            free.last_hidden_state[row][mask], padded.last_hidden_state[row][mask], atol=1e-5, rtol=0
        )
        torch.testing.assert_close(free.pooler_output[row], padded.pooler_output[row], atol=1e-5, rtol=0)


def test_a_batch_of_only_padding_takes_the_padded_path_and_stays_finite(packings):
    model = build(encoderstack.EncoderStackForMaskedLM)
    with torch.no_grad():
        logits = model(**batch(lengths=(0, 0, 0))).logits
    assert torch.isfinite(logits).all()
    assert not packings


def test_a_batch_of_one_padded_sequence_agrees_between_the_paths():
    inputs = batch(batch_size=1, lengths=(6,))
    for model_class in (encoderstack.EncoderStackForMaskedLM, encoderstack.EncoderStackForSequenceClassification):
        assert_paths_agree(build(model_class).train(), model_class, inputs)


@pytest.mark.parametrize("attention_mask", ["none", "all ones"])
def test_a_batch_without_padding_takes_the_cheap_path_and_never_packs(attention_mask, packings):
    model = build(encoderstack.EncoderStackForMaskedLM)
    inputs = batch(lengths=(9, 9, 9))
    if attention_mask == "none":
        del inputs["attention_mask"]
    with torch.no_grad():
        model(**inputs)
    assert not packings


def test_a_padded_batch_is_packed_once_per_forward_even_with_a_token_level_head(packings):
    with torch.no_grad():
        build(encoderstack.EncoderStackForMaskedLM)(**batch())
    assert len(packings) == 1
    assert packings[0].lengths == [9, 5, 7]


@pytest.mark.parametrize("switch", ["config", "call"])
def test_the_switch_turns_padding_free_off(switch, packings):
    inputs = batch()
    config_value, call = (False, {}) if switch == "config" else (True, {"padding_free": False})
    model = build(EncoderStackModel, padding_free=config_value)
    reference = build(EncoderStackModel, padding_free=True)
    with torch.no_grad():
        off = model(**inputs, **call).last_hidden_state
        assert not packings
        on = reference(**inputs).last_hidden_state
    padding = inputs["attention_mask"] == 0
    assert packings and off[padding].abs().sum() > 0 and on[padding].abs().sum() == 0


def test_the_call_switch_overrides_the_config(packings):
    model = build(EncoderStackModel, padding_free=False)
    with torch.no_grad():
        model(**batch(), padding_free=True)
    assert len(packings) == 1


def test_labels_at_padded_positions_count_for_nothing_padding_free():
    model = build(encoderstack.EncoderStackForMaskedLM)
    inputs = batch()
    labels = head_labels(encoderstack.EncoderStackForMaskedLM, inputs)["labels"]
    with torch.no_grad():
        expected = model(**inputs, labels=labels).loss
        actual = model(**inputs, labels=labels.masked_fill(inputs["attention_mask"] == 0, 7)).loss
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)


def test_an_invalid_padding_free_value_is_refused():
    model = build(EncoderStackModel)
    with pytest.raises(ValueError, match=r"`padding_free` must be True, False or None, got 'yes'"):
        model(**batch(), padding_free="yes")
    with pytest.raises(Exception, match="padding_free"):
        EncoderStackConfig(padding_free="yes")


def test_requested_hidden_states_and_attentions_come_from_the_padded_path(packings):
    model = build(EncoderStackModel, attn_implementation="eager")
    inputs = batch()
    with torch.no_grad():
        recorded = model(**inputs, output_hidden_states=True, output_attentions=True)
        padded = model(**inputs, padding_free=False, output_hidden_states=True, output_attentions=True)
    assert not packings
    for a, b in zip(
        recorded.hidden_states + recorded.attentions, padded.hidden_states + padded.attentions, strict=True
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize("placement", ["post", "resi_dual"])
def test_activation_checkpointing_recomputes_every_layer_and_gives_the_same_gradients_padding_free(placement):
    inputs = batch()
    model_class = encoderstack.EncoderStackForMaskedLM
    grads = []
    for checkpointing in (False, True):
        model = build(model_class, norm_placement=placement).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        calls = []
        for layer in model.model.layers:  # the layer's own hooks fire once: the recompute calls its forward
            layer.mlp.register_forward_pre_hook(lambda module, args: calls.append(module))
        grads.append(run(model, model_class, inputs, head_labels(model_class, inputs))[1])
        assert len(calls) == model.config.num_hidden_layers * (2 if checkpointing else 1)  # backward recomputes
    assert_same(grads[1], grads[0])


def test_inputs_embeds_are_packed_like_input_ids():
    model = build(EncoderStackModel)
    inputs = batch()
    embeds = {**inputs, "inputs_embeds": model.embeddings.word_embeddings(inputs.pop("input_ids")).detach()}
    del embeds["input_ids"]
    assert_paths_agree(model, EncoderStackModel, embeds, labels={})


def test_training_with_dropout_runs_padding_free_and_is_finite():
    model = build(
        encoderstack.EncoderStackForMaskedLM, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1
    ).train()
    inputs = batch()
    loss = model(**inputs, **head_labels(encoderstack.EncoderStackForMaskedLM, inputs)).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_the_padded_path_traces_under_torch_compile_without_a_graph_break():
    """Under torch.compile the model runs the padded path (packed shapes would recompile with every batch)."""
    model = build(EncoderStackModel)
    inputs = batch()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        expected = model(**inputs, padding_free=False).last_hidden_state
        actual = compiled(**inputs).last_hidden_state
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)


BF16_TOLERANCE = 4 * 2**-8  # four bfloat16 roundings (8-bit significand) of the output's largest value


@pytest.mark.parametrize("placement", REPRESENTATIVE_PLACEMENTS)
@pytest.mark.parametrize("model_class", HEADS, ids=lambda c: c.__name__)
def test_in_bfloat16_padding_free_gives_the_padded_batchs_outputs_for_every_head_and_placement(model_class, placement):
    """The paths sum in different orders, so bfloat16 cannot agree to float32's 1e-5; measured: up to 1% of the
    largest value, as far as bfloat16 itself is from float32 on these models. Attending across sequences, or a
    float32 detour, would be well beyond."""
    model = build(model_class, norm_placement=placement).to(torch.bfloat16)
    inputs = head_inputs(model_class, batch())
    mask = inputs["attention_mask"]
    with torch.no_grad():
        padded = outputs_on_real_tokens(model(**inputs, padding_free=False), mask)
        free = outputs_on_real_tokens(model(**inputs), mask)
    assert free.keys() == padded.keys()
    for key, expected in padded.items():
        assert free[key].dtype == torch.bfloat16, key
        difference = (free[key].float() - expected.float()).abs().max()
        assert difference <= BF16_TOLERANCE * expected.float().abs().max(), key
