"""Sparse masked-LM prediction (ModernBERT's `sparse_prediction`): in training with labels, the head, its logits and
its loss run on the labelled tokens only, with the dense head's loss and gradients, on every input kind."""

import pytest
import torch
from conftest import batch, build
from test_packed_sequences import flattened, sequences

import encoderstack

MLM_HEADS = (encoderstack.EncoderStackForMaskedLM, encoderstack.EncoderStackForPreTraining)


def labelled(inputs, seed=0):
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.rand(inputs["input_ids"].shape, generator=generator) < 0.3
    return torch.where(chosen, inputs["input_ids"], -100)


def loss_and_grads(model, inputs, labels, sparse, **kwargs):
    model.config.sparse_prediction = sparse
    model.zero_grad()
    out = model(**inputs, labels=labels, **kwargs)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def pretraining_labels(model_class, inputs):
    if model_class is encoderstack.EncoderStackForPreTraining:
        rows = 5 if "position_ids" in inputs else inputs["input_ids"].shape[0]
        return {"next_sentence_label": torch.arange(rows) % 2}
    return {}


@pytest.mark.parametrize("route", ["padded", "padded-not-padding-free", "flattened"])
@pytest.mark.parametrize("model_class", MLM_HEADS, ids=lambda c: c.__name__)
def test_sparse_prediction_gives_the_dense_heads_loss_and_gradients(model_class, route):
    model = build(model_class).train()
    inputs = flattened(sequences()) if route == "flattened" else batch()
    kwargs = {"padding_free": False} if route == "padded-not-padding-free" else {}
    labels = labelled(inputs)
    kwargs.update(pretraining_labels(model_class, inputs))
    dense, dense_grads = loss_and_grads(model, inputs, labels, False, **kwargs)
    sparse, sparse_grads = loss_and_grads(model, inputs, labels, True, **kwargs)
    torch.testing.assert_close(sparse.loss, dense.loss, atol=1e-6, rtol=0)
    assert sparse_grads.keys() == dense_grads.keys()
    for name, grad in dense_grads.items():
        torch.testing.assert_close(sparse_grads[name], grad, atol=1e-5, rtol=0, msg=name)


def test_sparse_logits_are_the_labelled_tokens_rows_and_eval_logits_stay_per_token():
    model = build(encoderstack.EncoderStackForMaskedLM).train()
    inputs = batch()
    labels = labelled(inputs)
    labels[inputs["attention_mask"] == 0] = 5  # a label at padding counts for nothing
    sparse = model(**inputs, labels=labels).logits
    counted = (labels != -100) & inputs["attention_mask"].bool()
    model.config.sparse_prediction = False
    dense = model(**inputs, labels=labels).logits
    torch.testing.assert_close(sparse, dense[counted], atol=1e-6, rtol=0)
    model.config.sparse_prediction = True
    assert model.eval()(**inputs, labels=labels).logits.shape == (*inputs["input_ids"].shape, 99)
