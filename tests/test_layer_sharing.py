"""Layer sharing (ALBERT's `num_hidden_groups` and `inner_group_num`) as a config choice: which stored layer each layer
runs, each stored once and saved once, gradients summed over its uses and recomputed per use under checkpointing,
any placement; configs whose shared layers would be built differently are refused by name."""

import json
import warnings

import pytest
import torch
import transformers
from conftest import batch, build, real, tiny_config
from huggingface_hub.errors import StrictDataclassClassValidationError
from safetensors.torch import load_file
from test_convert_family import save_random
from transformers.testing_utils import CaptureLogger

import encoderstack
from encoderstack import EncoderStackConfig


def test_without_groups_every_layer_runs_its_own_weights():
    assert EncoderStackConfig().stored_layer_of() == list(range(12))
    assert EncoderStackConfig(num_hidden_layers=4, inner_group_num=2).stored_layer_of() == [0, 1, 2, 3]
    assert len(build(encoderstack.EncoderStackModel).layers) == 3


@pytest.mark.parametrize(
    ("layers", "groups", "inner", "expected"),
    [
        (4, 1, 1, [0, 0, 0, 0]),  # ALBERT's releases: one layer for the whole stack
        (4, 2, 1, [0, 0, 1, 1]),
        (12, 5, 1, [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4]),  # int(i / 2.4): groups of unequal length
        (6, 2, 2, [0, 1, 0, 1, 2, 3]),  # ALBERT's 3 blocks of 2 layers: blocks 0 and 1 in group 0, block 2 in group 1
        (6, 3, 2, [0, 1, 2, 3, 4, 5]),
    ],
)
def test_layer_i_runs_the_stored_layer_of_albert_s_group_int_i_over_blocks_per_group(layers, groups, inner, expected):
    config = EncoderStackConfig(num_hidden_layers=layers, num_hidden_groups=groups, inner_group_num=inner)
    assert config.stored_layer_of() == expected


def test_shared_layers_are_stored_and_saved_once_and_load_back_exactly_without_warnings(tmp_path):
    model = build(encoderstack.EncoderStackForMaskedLM, num_hidden_layers=6, num_hidden_groups=2, inner_group_num=1)
    assert len(model.model.layers) == 2
    stored = {key.split(".")[2] for key in model.state_dict() if key.startswith("model.layers.")}
    assert stored == {"0", "1"}
    with (
        warnings.catch_warnings(record=True) as caught,
        CaptureLogger(transformers.logging.get_logger("transformers")) as log,
    ):
        warnings.simplefilter("always")
        model.save_pretrained(tmp_path)
        loaded = encoderstack.EncoderStackForMaskedLM.from_pretrained(tmp_path).eval()
    messages = [str(w.message) for w in caught] + [log.out]
    assert not [m for m in messages if "tie" in m.lower() or "share" in m.lower() or "missing" in m.lower()], messages
    saved = load_file(tmp_path / "model.safetensors")
    assert {key.split(".")[2] for key in saved if key.startswith("model.layers.")} == {"0", "1"}
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    inputs = batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, atol=0, rtol=0)


def unshared_copy(shared):
    """A model without sharing whose every layer starts as a copy of the stored layer its position runs."""
    config = shared.config.to_dict() | {"num_hidden_groups": None, "inner_group_num": 1}
    copy = type(shared)(EncoderStackConfig.from_dict(config)).eval()
    state = {
        key: value
        for key, value in shared.state_dict().items()
        if not key.startswith("model.layers.")  # the layers are filled below, one per position
    }
    for index, stored in enumerate(shared.model.layer_order):
        for name, value in shared.model.layers[stored].state_dict().items():
            state[f"model.layers.{index}.{name}"] = value
    copy.load_state_dict(state)
    return copy


def loss_and_grads(model, inputs):
    model.zero_grad()
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    model(**inputs, labels=labels).loss.backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def test_a_shared_layer_s_gradient_is_the_sum_of_its_uses_gradients():
    shared = build(encoderstack.EncoderStackForMaskedLM, num_hidden_layers=4, num_hidden_groups=2)
    unshared = unshared_copy(shared)
    inputs = batch()
    with torch.no_grad():
        torch.testing.assert_close(unshared(**inputs).logits, shared(**inputs).logits, atol=1e-6, rtol=0)
    mine, theirs = loss_and_grads(shared, inputs), loss_and_grads(unshared, inputs)
    for name, grad in mine.items():
        if not name.startswith("model.layers."):
            torch.testing.assert_close(grad, theirs[name], atol=1e-6, rtol=0, msg=name)
            continue
        stored, rest = name.split(".", 3)[2:]
        uses = [index for index, s in enumerate(shared.model.layer_order) if s == int(stored)]
        assert len(uses) == 2
        total = sum(theirs[f"model.layers.{index}.{rest}"] for index in uses)
        torch.testing.assert_close(grad, total, atol=1e-6, rtol=0, msg=name)
        if not name.endswith("key.bias"):  # a key bias shifts all of a query's scores alike: its gradient is 0
            assert not torch.allclose(theirs[f"model.layers.{uses[0]}.{rest}"], total), name  # each use adds its own


def test_gradient_checkpointing_recomputes_every_use_of_a_shared_layer_and_gives_the_same_gradients():
    model = build(encoderstack.EncoderStackForMaskedLM, num_hidden_layers=4, num_hidden_groups=1).train()
    inputs = batch()
    expected = loss_and_grads(model, inputs)
    calls = []
    # checkpointing wraps the layer's forward: its sublayers count each run, the recomputations included
    model.model.layers[0].mlp.register_forward_hook(lambda *args: calls.append(1))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    got = loss_and_grads(model, inputs)
    assert len(calls) == 8  # four uses in the forward, each recomputed in the backward
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("placement", ["pre", "sandwich", "deepnorm", "resi_dual", "hybrid"])
def test_a_shared_layer_model_trains_under_another_placement(placement):
    model = build(
        encoderstack.EncoderStackForMaskedLM, num_hidden_layers=4, num_hidden_groups=1, norm_placement=placement
    )
    assert len(model.model.layers) == 1
    if placement == "deepnorm":  # its N is the depth, the layers run
        assert model.model.layers[0].attention_residual.alpha == pytest.approx(8**0.25)
    inputs = batch()
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.8, losses


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"norm_placement": "mix", "mix_ln_ratio": 0.25}, r"Layers 0 and 1 share weights .* attention's norm row"),
        ({"norm_placement": "lns"}, r"Layers 0 and 1 share weights .* attention's scale and FFN's scale"),
        ({"norm_placement": "pre_skip_first"}, r"Layers 0 and 1 share weights .* attention's norm row"),
        ({"norm_placement": "admin"}, r"'admin' profiles a shortcut scale for every layer"),
        (
            {"layer_types": ["full_attention", "sliding_attention"] * 2, "sliding_window": 2},
            r"Layers 0 and 1 share weights .* layer type",
        ),
    ],
)
def test_sharing_refuses_layers_that_would_be_built_differently_by_name(overrides, message):
    with pytest.raises(StrictDataclassClassValidationError, match=message):
        tiny_config(num_hidden_layers=4, num_hidden_groups=1, **overrides)
    tiny_config(num_hidden_layers=4, **overrides)  # fine without sharing


def test_sharing_accepts_per_layer_properties_that_agree_within_each_group():
    layer_types = ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    config = tiny_config(num_hidden_layers=4, num_hidden_groups=2, layer_types=layer_types, sliding_window=2)
    model = encoderstack.EncoderStackModel(config)
    assert [layer.layer_type for layer in model.layers] == ["full_attention", "sliding_attention"]
    tiny_config(num_hidden_layers=4, num_hidden_groups=2, norm_placement="mix", mix_ln_ratio=0.5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"inner_group_num": 0}, r"`inner_group_num` must be a positive divisor of `num_hidden_layers` \(4\), got 0"),
        ({"inner_group_num": 3}, r"`inner_group_num` must be a positive divisor of `num_hidden_layers` \(4\), got 3"),
        ({"num_hidden_groups": 5}, r"`num_hidden_groups` must lie in \[1, 4\] .* got 5"),
        ({"num_hidden_groups": 3, "inner_group_num": 2}, r"`num_hidden_groups` must lie in \[1, 2\] .* got 3"),
        ({"num_hidden_groups": 0}, r"`num_hidden_groups` must lie in \[1, 4\] .* got 0"),
    ],
)
def test_impossible_groupings_are_refused_by_name(overrides, message):
    with pytest.raises(StrictDataclassClassValidationError, match=message):
        tiny_config(num_hidden_layers=4, **overrides)


def albert_folder(folder, suffix="Model", **overrides):
    tiny = {"vocab_size": 99, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 37}
    tiny |= {"max_position_embeddings": 20, "embedding_size": 16, "layer_norm_eps": 1e-5}
    config = transformers.AlbertConfig(**(tiny | overrides))
    return save_random(getattr(transformers, "Albert" + suffix), config, folder)


def test_albert_s_groups_of_several_layers_convert_in_order_with_every_hidden_state_at_parity(tmp_path):
    """ALBERT's 3 blocks in 2 groups of 2 layers: our 6 layers run stored layers 0, 1, 0, 1, 2, 3. A wrong group or a
    swapped order inside a group changes the hidden states (checked: swapping gives other numbers)."""
    source = albert_folder(tmp_path / "albert", num_hidden_layers=3, num_hidden_groups=2, inner_group_num=2)
    folder = encoderstack.convert(source, tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_hidden_groups"], config["inner_group_num"]) == (6, 2, 2)
    card = (folder / "README.md").read_text().splitlines()
    assert "| layers | 6, sharing 4 stored layers (`num_hidden_groups` 2, `inner_group_num` 2) |" in card
    assert "- albert" in card
    assert len(load_file(folder / "model.safetensors").keys() & {f"layers.{i}.mlp.up.weight" for i in range(6)}) == 4
    reference = transformers.AlbertModel.from_pretrained(source).eval()
    ours = encoderstack.EncoderStackModel.from_pretrained(folder).eval()
    inputs = {key: value for key, value in batch(vocab_size=20).items() if key != "token_type_ids"}
    mask = inputs["attention_mask"].bool()
    with torch.no_grad():
        expected = reference(**inputs, output_hidden_states=True).hidden_states
        got = ours(**inputs, output_hidden_states=True).hidden_states
        assert len(got) == len(expected) == 7
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(real(a, mask), real(b, mask), atol=1e-5, rtol=0)
        ours.layer_order = [1, 0, 1, 0, 3, 2]
        swapped = ours(**inputs).last_hidden_state
    assert (real(swapped, mask) - real(expected[-1], mask)).abs().max() > 1e-3


def test_albert_with_embeddings_as_wide_as_the_hidden_states_is_refused_by_name(tmp_path):
    source = albert_folder(tmp_path / "albert", num_hidden_layers=1, embedding_size=32)
    with pytest.raises(encoderstack.ConversionError, match="ALBERT's embedding_size equal to hidden_size"):
        encoderstack.convert(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_bert_writes_albert_s_groups_back_and_bert_refuses_shared_layers_by_name(tmp_path):
    source = albert_folder(
        tmp_path / "albert", "ForMaskedLM", num_hidden_layers=3, num_hidden_groups=2, inner_group_num=2
    )
    back = encoderstack.export_bert(encoderstack.convert(source, tmp_path / "es"), tmp_path / "back")
    config = json.loads((back / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_hidden_groups"], config["inner_group_num"]) == (3, 2, 2)
    original = transformers.AlbertForMaskedLM.from_pretrained(source).state_dict()
    exported = transformers.AlbertForMaskedLM.from_pretrained(back).state_dict()
    assert original.keys() == exported.keys()
    for key in original:
        assert torch.equal(original[key], exported[key]), key
    build(encoderstack.EncoderStackModel, num_hidden_groups=1).save_pretrained(tmp_path / "shared")
    with pytest.raises(encoderstack.ConversionError, match="bert cannot express num_hidden_groups=1"):
        encoderstack.export_bert(tmp_path / "shared", tmp_path / "bert")
    assert not (tmp_path / "bert").exists()
