"""Float32 CPU inference runs the model's projections through oneDNN (faster than torch's MKL linear, measured in
docs/performance.md), with F.linear's numbers; training, autocast and compilers keep F.linear."""

import pytest
import torch
from conftest import batch, build

import encoderstack
from encoderstack import execution_encoderstack

pytestmark = pytest.mark.skipif(not execution_encoderstack.ONEDNN_LINEAR, reason="torch built without oneDNN")


@pytest.fixture
def onednn_calls(monkeypatch):
    calls = []

    def counted(*args):
        calls.append(args[0].dtype)
        return execution_encoderstack.torch.ops.mkldnn._linear_pointwise(*args)

    monkeypatch.setattr(execution_encoderstack, "onednn_linear", counted)
    return calls


def projections(model) -> int:
    return sum(isinstance(module, encoderstack.modeling_encoderstack.Linear) for module in model.modules())


def test_float32_inference_runs_every_projection_through_onednn_with_f_linear_s_numbers(onednn_calls, monkeypatch):
    model = build(encoderstack.EncoderStackForMaskedLM)
    with torch.no_grad():
        fast = model(**batch()).logits
    assert len(onednn_calls) == projections(model) > 0  # the tied decoder too
    monkeypatch.setattr(execution_encoderstack, "ONEDNN_LINEAR", False)
    with torch.no_grad():
        plain = model(**batch()).logits
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=0)


def test_a_forward_that_records_gradients_keeps_f_linear_and_its_gradients(onednn_calls):
    model = build(encoderstack.EncoderStackForSequenceClassification).train()
    model(**batch(), labels=torch.tensor([0, 1, 0])).loss.backward()
    assert onednn_calls == []
    assert model.model.layers[0].attention.query.weight.grad.abs().sum() > 0


def test_inference_with_frozen_weights_but_a_recorded_input_keeps_f_linear(onednn_calls):
    model = build(encoderstack.EncoderStackModel).requires_grad_(False)
    embeds = torch.randn(2, 5, model.config.hidden_size, requires_grad=True)
    model(inputs_embeds=embeds).last_hidden_state.sum().backward()
    assert onednn_calls == [] and embeds.grad is not None


def test_autocast_and_bfloat16_weights_keep_f_linear(onednn_calls):
    model = build(encoderstack.EncoderStackModel)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(**batch()).pooler_output.dtype == torch.bfloat16  # a linear and tanh: autocast ran it
    with torch.no_grad():
        model.to(torch.bfloat16)(**batch())
    assert onednn_calls == []


def test_a_compiled_model_keeps_f_linear(onednn_calls):
    model = build(encoderstack.EncoderStackModel)
    compiled = torch.compile(model, backend="eager", fullgraph=False)
    with torch.no_grad():
        compiled(**batch())
    assert onednn_calls == []
