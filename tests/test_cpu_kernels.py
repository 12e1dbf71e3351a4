"""On the CPU the model's projections run in oneDNN (faster than torch's MKL linear, measured in docs/performance.md):
in bf16 where the CPU has it, and in float32 where `config.cpu_kernels="onednn"` asks (by default float32 keeps the
reference classes' own kernels); in inference and in training, with F.linear's numbers within float32's resolution;
autocast and compilers keep F.linear. With "onednn-prepacked" inference reads each weight from a copy in oneDNN's
layout, kept while the weight is unchanged, with the same numbers."""

import json

import pytest
import torch
from conftest import batch, build

import encoderstack
from encoderstack import execution_encoderstack

# A torch built without oneDNN (some non-x86 builds) has no such op: there `linear` is F.linear and nothing here
# applies. The project's pinned CPU torch has it, so on its machines these tests always run.
pytestmark = pytest.mark.skipif(not execution_encoderstack.ONEDNN_LINEAR, reason="torch built without oneDNN")


@pytest.fixture
def onednn_calls(monkeypatch):
    calls = []

    def counted(*args):
        calls.append(args[3])  # the post-op
        return torch.ops.mkldnn._linear_pointwise(*args)

    monkeypatch.setattr(execution_encoderstack, "onednn_linear", counted)
    return calls


def projections(model) -> int:
    return sum(isinstance(module, encoderstack.modeling_encoderstack.Linear) for module in model.modules())


def test_float32_inference_runs_every_projection_through_onednn_with_f_linear_s_numbers(onednn_calls, monkeypatch):
    model = build(encoderstack.EncoderStackForMaskedLM, cpu_kernels="onednn")
    with torch.no_grad():
        fast = model(**batch()).logits
    assert len(onednn_calls) == projections(model) > 0  # the tied decoder too
    monkeypatch.setattr(execution_encoderstack, "ONEDNN_LINEAR", False)
    with torch.no_grad():
        plain = model(**batch()).logits
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=0)


def test_inference_runs_exact_gelu_in_the_up_projection_s_gemm_with_torch_s_numbers(onednn_calls):
    model = build(encoderstack.EncoderStackModel, hidden_act="gelu", cpu_kernels="onednn")
    with torch.no_grad():
        fused = model(**batch()).last_hidden_state
    assert onednn_calls.count("gelu") == model.config.num_hidden_layers
    for layer in model.layers:
        layer.mlp.fused_act = None
    with torch.no_grad():
        separate = model(**batch()).last_hidden_state
    torch.testing.assert_close(fused, separate, atol=1e-6, rtol=0)


def gradients(model, monkeypatch, onednn: bool) -> dict:
    monkeypatch.setattr(execution_encoderstack, "ONEDNN_LINEAR", onednn)
    model.zero_grad()
    model(**batch(), labels=torch.tensor([0, 1, 0])).loss.backward()
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


def test_training_runs_every_projection_s_three_gemms_through_onednn_with_f_linear_s_gradients(
    onednn_calls, monkeypatch
):
    # eval: no dropout, the same graph twice
    model = build(encoderstack.EncoderStackForSequenceClassification, cpu_kernels="onednn")
    expected = gradients(model, monkeypatch, onednn=False)
    assert onednn_calls == []
    actual = gradients(model, monkeypatch, onednn=True)
    layer_projections = projections(model.model)
    assert len(onednn_calls) == 3 * layer_projections  # forward, input gradient, weight gradient
    assert actual.keys() == expected.keys() and len(expected) > 0
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


def test_frozen_weights_with_a_recorded_input_get_the_input_gradient_alone(onednn_calls, monkeypatch):
    model = build(encoderstack.EncoderStackModel, cpu_kernels="onednn").requires_grad_(False)
    embeds = torch.randn(2, 5, model.config.hidden_size, requires_grad=True)
    model(inputs_embeds=embeds).last_hidden_state.sum().backward()
    projections_run = len(onednn_calls) // 2
    assert len(onednn_calls) == 2 * projections_run > 0  # no weight gradient computed
    fast = embeds.grad.clone()
    monkeypatch.setattr(execution_encoderstack, "ONEDNN_LINEAR", False)
    embeds.grad = None
    model(inputs_embeds=embeds).last_hidden_state.sum().backward()
    torch.testing.assert_close(fast, embeds.grad, atol=1e-5, rtol=1e-5)


def test_float32_keeps_the_reference_classes_kernels_by_default_and_switches_on_the_model(onednn_calls):
    model = build(encoderstack.EncoderStackModel)
    with torch.no_grad():
        plain = model(**batch()).last_hidden_state
    assert model.config.cpu_kernels == "torch" and onednn_calls == []
    model.set_cpu_kernels("onednn")
    with torch.no_grad():
        fast = model(**batch()).last_hidden_state
    assert len(onednn_calls) == projections(model)
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=0)
    model.set_cpu_kernels("torch")
    with torch.no_grad():
        assert torch.equal(model(**batch()).last_hidden_state, plain)
    assert len(onednn_calls) == projections(model)
    choices = "'torch', 'onednn', 'onednn-prepacked'"
    with pytest.raises(ValueError, match=f"`cpu_kernels` must be one of {choices}, got 'mkl'"):
        model.set_cpu_kernels("mkl")


def test_the_choice_is_saved_with_the_config_and_given_at_load(tmp_path):
    build(encoderstack.EncoderStackModel, cpu_kernels="onednn").save_pretrained(tmp_path)
    assert encoderstack.EncoderStackModel.from_pretrained(tmp_path).layers[0].mlp.up.cpu_kernels == "onednn"
    loaded = encoderstack.EncoderStackModel.from_pretrained(tmp_path, cpu_kernels="torch")
    assert loaded.layers[0].mlp.up.cpu_kernels == "torch"


def test_a_config_saved_with_the_field_s_earlier_name_cpu_linear_loads_its_choice(tmp_path):
    build(encoderstack.EncoderStackModel).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["cpu_kernels"]
    (tmp_path / "config.json").write_text(json.dumps({**saved, "cpu_linear": "onednn"}))
    loaded = encoderstack.EncoderStackModel.from_pretrained(tmp_path)
    assert loaded.config.cpu_kernels == loaded.layers[0].mlp.up.cpu_kernels == "onednn"
    assert "cpu_linear" not in loaded.config.to_dict()


def test_autocast_keeps_f_linear(onednn_calls):
    model = build(encoderstack.EncoderStackModel, cpu_kernels="onednn")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(**batch()).pooler_output.dtype == torch.bfloat16  # a linear and tanh: autocast ran it
    assert onednn_calls == []


def test_bfloat16_weights_run_in_onednn_exactly_where_the_cpu_has_native_bf16(onednn_calls):
    model = build(encoderstack.EncoderStackModel).to(torch.bfloat16)
    with torch.no_grad():
        model(**batch())
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (torch.bfloat16 in execution_encoderstack.ONEDNN_DTYPES) == native
    assert len(onednn_calls) == (projections(model) if native else 0)


def test_a_compiled_model_keeps_f_linear(onednn_calls):
    model = build(encoderstack.EncoderStackModel, cpu_kernels="onednn")
    compiled = torch.compile(model, backend="eager", fullgraph=False)
    with torch.no_grad():
        compiled(**batch())
    assert onednn_calls == []


DTYPES = [torch.float32] + ([torch.bfloat16] if torch.bfloat16 in execution_encoderstack.ONEDNN_DTYPES else [])


def packed_weights_of(model) -> int:
    linears = (module for module in model.modules() if isinstance(module, encoderstack.modeling_encoderstack.Linear))
    return sum(module.weight in execution_encoderstack.prepacked_weights for module in linears)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prepacked_weights_give_the_plain_weights_numbers_bit_for_bit(monkeypatch, dtype):
    model = build(encoderstack.EncoderStackForMaskedLM, cpu_kernels="onednn").to(dtype)
    read = []
    monkeypatch.setattr(  # the weight each GEMM reads: plain or oneDNN's blocked copy
        execution_encoderstack,
        "onednn_linear",
        lambda *args: read.append(args[1].is_mkldnn) or torch.ops.mkldnn._linear_pointwise(*args),
    )
    with torch.inference_mode():
        plain = model(**batch()).logits
        model.set_cpu_kernels("onednn-prepacked")
        packed = model(**batch()).logits
    assert read == [False] * projections(model) + [True] * projections(model)
    assert torch.equal(packed, plain)


def test_a_weight_is_packed_once_and_again_only_after_it_changes(monkeypatch):
    model = build(encoderstack.EncoderStackModel, cpu_kernels="onednn-prepacked")
    packs, reorder = [], torch.ops.mkldnn._reorder_linear_weight

    def counted(weight):
        packs.append(weight)
        return reorder(weight)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", counted)
    with torch.no_grad():
        model(**batch())
        model(**batch())
    assert len(packs) == packed_weights_of(model) == projections(model)
    other = build(encoderstack.EncoderStackModel, seed=1)
    model.load_state_dict(other.state_dict())  # in place: every weight's version moves
    with torch.no_grad():
        assert torch.equal(model(**batch()).last_hidden_state, other(**batch()).last_hidden_state)
    assert len(packs) == 2 * projections(model)


def test_new_storage_for_a_weight_is_packed_anew_even_at_the_same_address_and_version():
    up = build(encoderstack.EncoderStackModel, cpu_kernels="onednn-prepacked").layers[0].mlp.up
    memory, x = bytearray(up.weight.numel() * up.weight.element_size()), torch.ones(2, up.in_features)

    def storage_on(memory):  # a new storage each call, at the address of `memory`
        return torch.frombuffer(memory, dtype=up.weight.dtype).view(up.weight.shape)

    with torch.no_grad():
        storage_on(memory).copy_(up.weight)
        up.weight.data = storage_on(memory)
        first = up(x)
        storage_on(memory).zero_()
        address, version = up.weight.data_ptr(), up.weight._version
        up.weight.data = storage_on(memory)  # `.data =` keeps the version; the packed storage is freed
        assert (up.weight.data_ptr(), up.weight._version) == (address, version)
        assert torch.equal(up(x), up.bias.expand(2, -1)) and not torch.equal(first, up(x))


def test_moving_the_model_or_leaving_prepacked_frees_the_packed_copies():
    model = build(encoderstack.EncoderStackModel, cpu_kernels="onednn-prepacked")
    with torch.no_grad():
        model(**batch())
    assert packed_weights_of(model) == projections(model)
    model.double()
    assert packed_weights_of(model) == 0
    model.float()
    with torch.no_grad():
        model(**batch())
    model.set_cpu_kernels("onednn")
    assert packed_weights_of(model) == 0


def test_training_with_prepacked_kernels_reads_the_plain_weights_and_packs_nothing(onednn_calls, monkeypatch):
    model = build(encoderstack.EncoderStackForSequenceClassification, cpu_kernels="onednn-prepacked")
    expected = gradients(model, monkeypatch, onednn=False)
    actual = gradients(model, monkeypatch, onednn=True)
    assert len(onednn_calls) == 3 * projections(model.model) and packed_weights_of(model) == 0
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)
