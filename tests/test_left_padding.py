"""A first-token head pools each row's first real token, so left and right padding mean the same text, on the
padded and the padding-free path alike (BERT would pool a padding token under left padding)."""

import pytest
import torch
from conftest import batch, build, head_inputs, head_labels

import encoderstack

SEQUENCE_LEVEL = {  # every head whose output comes from the pooled first token, and that output
    encoderstack.EncoderStackModel: "pooler_output",
    encoderstack.EncoderStackForSequenceClassification: "logits",
    encoderstack.EncoderStackForMultipleChoice: "logits",
    encoderstack.EncoderStackForPreTraining: "seq_relationship_logits",
}


def left_padded(inputs):
    """The same rows with their padding moved to the front, and the positions each token had under right padding."""
    mask = inputs["attention_mask"]
    shifts = (mask.shape[1] - mask.sum(-1)).tolist()
    moved = {key: torch.stack([row.roll(shift) for row, shift in zip(value, shifts)]) for key, value in inputs.items()}
    moved["position_ids"] = (moved["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return moved


def padded_side(side):
    inputs = batch()
    return inputs if side == "right" else left_padded(inputs)


def pooled(model, model_class, inputs, **kwargs):
    """The head's sequence-level output and every parameter's gradient (of the loss, else of the output's mean
    square, as in test_padding_free)."""
    model.zero_grad()
    outputs = model(**head_inputs(model_class, inputs), **head_labels(model_class, inputs), **kwargs)
    value = outputs[SEQUENCE_LEVEL[model_class]]
    (outputs.loss if outputs.get("loss") is not None else value.pow(2).mean()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return value.detach(), grads


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("placement", ["post", "pre", "resi_dual"])
@pytest.mark.parametrize("model_class", SEQUENCE_LEVEL, ids=lambda c: c.__name__)
def test_the_padded_and_padding_free_paths_pool_the_same_token_on_either_padding_side(model_class, placement, side):
    model = build(model_class, norm_placement=placement)
    inputs = padded_side(side)
    padded, padded_grads = pooled(model, model_class, inputs, padding_free=False)
    free, free_grads = pooled(model, model_class, inputs)
    torch.testing.assert_close(free, padded, atol=1e-5, rtol=0)
    assert free_grads.keys() == padded_grads.keys()
    for name in padded_grads:
        torch.testing.assert_close(free_grads[name], padded_grads[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("position_embedding_type", ["absolute", "sinusoidal", "rope"])
@pytest.mark.parametrize("model_class", SEQUENCE_LEVEL, ids=lambda c: c.__name__)
def test_a_left_padded_row_gives_what_the_same_row_gives_right_padded(
    model_class, position_embedding_type, padding_free
):
    model = build(model_class, position_embedding_type=position_embedding_type)
    right, left = batch(), left_padded(batch())
    right["position_ids"] = torch.arange(right["input_ids"].shape[1]).expand_as(right["input_ids"])
    with torch.no_grad():
        expected = model(**head_inputs(model_class, right), padding_free=padding_free)[SEQUENCE_LEVEL[model_class]]
        actual = model(**head_inputs(model_class, left), padding_free=padding_free)[SEQUENCE_LEVEL[model_class]]
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("padding_free", [True, False])
def test_left_padded_rows_of_different_texts_get_different_answers(padding_free):
    model = build(encoderstack.EncoderStackForSequenceClassification)
    inputs = left_padded(batch())
    with torch.no_grad():
        probabilities = model(**inputs, padding_free=padding_free).logits.softmax(-1)
    for row in range(1, len(probabilities)):
        assert not torch.allclose(probabilities[row], probabilities[0], atol=1e-3), row
