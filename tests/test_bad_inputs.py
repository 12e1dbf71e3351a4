"""Inputs the model cannot honour raise a ValueError that names the problem and the numbers."""

import pytest
import torch
from conftest import batch, build

import encoderstack
from encoderstack import EncoderStackForSequenceClassification, EncoderStackModel


@pytest.fixture(scope="module")
def model():
    return build(EncoderStackModel)


def test_input_ids_outside_the_vocabulary_are_rejected(model):
    with pytest.raises(ValueError, match=r"`input_ids` must lie in \[0, 98\], got values from 1 to 99"):
        model(torch.tensor([[1, 5, 99]]))


def test_negative_input_ids_are_rejected(model):
    with pytest.raises(ValueError, match=r"`input_ids` must lie in \[0, 98\], got values from -1"):
        model(torch.tensor([[-1, 5]]))


def test_token_type_ids_outside_the_type_vocabulary_are_rejected(model):
    with pytest.raises(ValueError, match=r"`token_type_ids` must lie in \[0, 1\], got values from 0 to 2"):
        model(torch.tensor([[1, 2, 3]]), token_type_ids=torch.tensor([[0, 1, 2]]))


def test_a_sequence_longer_than_the_learned_positions_is_rejected(model):
    with pytest.raises(
        ValueError, match=r"Sequence length 65 exceeds the 64 learned positions \(`max_position_embeddings` 64\)"
    ):
        model(torch.ones(1, 65, dtype=torch.long))


def test_rotary_positions_accept_sequences_longer_than_max_position_embeddings():
    rope = build(EncoderStackModel, position_embedding_type="rope")
    assert rope(torch.ones(1, 65, dtype=torch.long)).last_hidden_state.shape == (1, 65, 32)


def test_an_attention_mask_of_another_shape_is_rejected(model):
    with pytest.raises(ValueError, match=r"`attention_mask` has shape \(2, 4\), but the inputs have shape \(2, 5\)"):
        model(torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4, dtype=torch.long))


def test_both_input_ids_and_inputs_embeds_are_rejected(model):
    with pytest.raises(ValueError, match="exactly one of `input_ids` and `inputs_embeds`"):
        model(torch.ones(1, 3, dtype=torch.long), inputs_embeds=torch.zeros(1, 3, 32))


def test_neither_input_ids_nor_inputs_embeds_is_rejected(model):
    with pytest.raises(ValueError, match="exactly one of `input_ids` and `inputs_embeds`"):
        model()


def test_inputs_embeds_give_the_same_result_as_the_ids_they_embed(model):
    inputs = batch()
    ids = inputs.pop("input_ids")
    with torch.no_grad():
        expected = model(ids, **inputs).last_hidden_state
        actual = model(inputs_embeds=model.embeddings.word_embeddings(ids), **inputs).last_hidden_state
    assert torch.equal(actual, expected)


def test_heads_report_bad_inputs_the_same_way():
    head = build(EncoderStackForSequenceClassification)
    with pytest.raises(ValueError, match="`input_ids` must lie in"):
        head(torch.tensor([[1, 500]]))


WRONG_LABELS = [
    (
        encoderstack.EncoderStackForMaskedLM,
        {"labels": (3, 11)},
        r"`labels` has shape \(3, 11\), but the inputs need shape \(3, 9\)",
    ),
    (
        encoderstack.EncoderStackForTokenClassification,
        {"labels": (3, 8)},
        r"`labels` has shape \(3, 8\), but the inputs",
    ),
    (
        encoderstack.EncoderStackForPreTraining,
        {"labels": (2, 9), "next_sentence_label": (3,)},
        r"`labels` has shape \(2, 9\)",
    ),
    (
        encoderstack.EncoderStackForPreTraining,
        {"labels": (3, 9), "next_sentence_label": (4,)},
        r"`next_sentence_label` has shape \(4,\), but the sequences need shape \(3,\)",
    ),
    (
        EncoderStackForSequenceClassification,
        {"labels": (4,)},
        r"`labels` has shape \(4,\), but the sequences need shape \(3,\)",
    ),
    (
        encoderstack.EncoderStackForQuestionAnswering,
        {"start_positions": (2,), "end_positions": (2,)},
        r"`start_positions/end_positions` has shape \(2,\), but the sequences need shape \(3,\)",
    ),
]


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize(
    ("model_class", "shapes", "message"),
    WRONG_LABELS,
    ids=lambda value: value.__name__ if isinstance(value, type) else None,
)
def test_labels_of_another_shape_than_the_inputs_are_refused_on_both_paths(model_class, shapes, message, padding_free):
    model = build(model_class)
    labels = {name: torch.zeros(shape, dtype=torch.long) for name, shape in shapes.items()}
    with pytest.raises(ValueError, match=message):
        model(**batch(), **labels, padding_free=padding_free)


def test_multiple_choice_labels_of_another_shape_are_refused():
    model = build(encoderstack.EncoderStackForMultipleChoice)
    inputs = {key: value.unsqueeze(1).repeat(1, 2, 1) for key, value in batch().items()}
    with pytest.raises(ValueError, match=r"`labels` has shape \(2,\), but the questions need shape \(3,\)"):
        model(**inputs, labels=torch.zeros(2, dtype=torch.long))


def test_class_labels_outside_the_classes_are_refused():
    model = build(EncoderStackForSequenceClassification)
    with pytest.raises(ValueError, match=r"Class labels must lie in \[0, 2\]"):
        model(**batch(), labels=torch.tensor([0, 3, 1]))


def test_float_ids_are_refused_with_their_dtype(model):
    with pytest.raises(TypeError, match="`input_ids` must hold integer ids, got torch.float32"):
        model(torch.ones(1, 3))


def test_an_attention_mask_with_values_other_than_0_and_1_is_refused(model):
    with pytest.raises(ValueError, match=r"must hold 1 for real tokens and 0 for padding, got values \[0, 1, 2\]"):
        model(torch.ones(1, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 2, 0]]))
