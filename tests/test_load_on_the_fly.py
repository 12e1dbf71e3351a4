"""`EncoderStack*.from_pretrained` on a BERT-family folder loads through transformers' key mapping, with no copy of
the weights, into exactly the model that `convert` writes; bad input gets `convert`'s own error; a TensorFlow release
still goes through a temporary conversion."""

import json
import re
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
import transformers
from conftest import real
from safetensors.torch import load_file, save_file
from test_convert_bert import bert_folder
from test_convert_family import FAMILIES, family_folder, right_padded_batch, suffixes
from test_convert_modern import FAMILIES as MODERN_FAMILIES
from test_convert_modern import family_folder as modern_folder
from test_convert_rope_families import FAMILIES as ROPE_FAMILIES
from test_convert_rope_families import rope_folder

import encoderstack
from encoderstack.conversion import converter, on_the_fly
from encoderstack.conversion.keymap import (
    BERT_TASKS,
    TASKS,
    ConversionError,
    task_for_architecture,
    task_for_encoderstack_class,
)

BERT_CASES = [("Bert", task.bert_suffix) for task in TASKS.values() if task.name in BERT_TASKS]
CASES = (
    BERT_CASES
    + [("MegatronBert", "ForMaskedLM")]
    + [(family, suffix) for family in FAMILIES for suffix in suffixes(family) if suffix != "ForPreTraining"]
)
CASES += [("electra", "ForPreTraining"), ("albert", "ForPreTraining")]


def source_folder(folder, family, suffix):
    if family in ("Bert", "MegatronBert"):
        return bert_folder(folder, suffix, family=family)
    return family_folder(folder, family, suffix)


def encoderstack_class(folder):
    """The class an architecture converts to, and the task its `from_pretrained` loads the folder as (an NSP
    checkpoint loaded as sequence classification keeps its encoder and starts a new classifier)."""
    _, task = task_for_architecture(json.loads((folder / "config.json").read_text())["architectures"][0])
    return getattr(encoderstack, task.encoderstack_class), task_for_encoderstack_class(task.encoderstack_class)


def through_the_converter(source, output, model_class, task):
    folder = encoderstack.convert(source, output, task=task.name, verify=False)
    return model_class.from_pretrained(folder)


def assert_same_model(loaded, converted):
    ours, theirs = loaded.state_dict(), converted.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    config, expected = loaded.config.to_dict(), converted.config.to_dict()
    for name in ("_name_or_path", "architectures", "auto_map"):
        config.pop(name, None), expected.pop(name, None)
    assert config == expected


@pytest.mark.parametrize(("family", "suffix"), CASES)
def test_every_family_and_head_loads_bit_for_bit_what_the_converter_writes(family, suffix, tmp_path):
    source = source_folder(tmp_path / "source", family, suffix)
    model_class, task = encoderstack_class(source)
    torch.manual_seed(0)  # for a head the source lacks, which both start from the usual initialization
    loaded = model_class.from_pretrained(source)
    torch.manual_seed(0)
    assert_same_model(loaded, through_the_converter(source, tmp_path / "out", model_class, task))


def test_loading_writes_no_copy_of_the_weights(tmp_path, monkeypatch):
    source = bert_folder(tmp_path / "bert", "ForPreTraining")

    def no_copy(*args, **kwargs):
        raise AssertionError("the weights were written to a temporary folder")

    monkeypatch.setattr(converter, "write_safetensors", no_copy)
    monkeypatch.setattr(on_the_fly, "convert", no_copy)
    model = encoderstack.EncoderStackForPreTraining.from_pretrained(source)
    assert model.model.layers[0].attention.query.weight.abs().sum() > 0
    assert {path.name for path in tmp_path.iterdir()} == {"bert"}


def test_the_load_report_shows_no_planned_skip_and_the_model_saves_under_its_own_names(tmp_path):
    source = bert_folder(tmp_path / "bert", "ForMaskedLM")
    state = load_file(source / "model.safetensors")  # an older save: the position buffer and the tied decoder bias
    state["bert.embeddings.position_ids"] = torch.arange(64)[None]
    state["cls.predictions.decoder.bias"] = state["cls.predictions.bias"].clone()
    save_file(state, source / "model.safetensors")
    model, info = encoderstack.EncoderStackForMaskedLM.from_pretrained(source, output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert "model.embeddings.norm.weight" in saved and not any(key.startswith("bert.") for key in saved)
    assert_same_model(encoderstack.EncoderStackForMaskedLM.from_pretrained(tmp_path / "saved"), model)


def test_a_head_the_source_lacks_starts_as_the_converter_s_does_and_config_kwargs_apply(tmp_path):
    source = bert_folder(tmp_path / "bert", "Model")
    model_class = encoderstack.EncoderStackForSequenceClassification
    torch.manual_seed(3)
    loaded, info = model_class.from_pretrained(source, num_labels=5, output_loading_info=True)
    torch.manual_seed(3)
    folder = encoderstack.convert(source, tmp_path / "out", task="text-classification", verify=False)
    assert_same_model(loaded, model_class.from_pretrained(folder, num_labels=5))
    assert loaded.config.num_labels == 5 and info["missing_keys"] == {"classifier.weight", "classifier.bias"}


def refusals(source, tmp_path, model_class=encoderstack.EncoderStackForMaskedLM, task="fill-mask"):
    with pytest.raises(ConversionError) as by_convert:
        encoderstack.convert(source, tmp_path / "out", task=task, verify=False)
    with pytest.raises(ConversionError) as by_load:
        model_class.from_pretrained(source)
    return str(by_load.value), str(by_convert.value)


def edit_weights(folder, edit):
    state = load_file(folder / "model.safetensors")
    edit(state)
    save_file(state, folder / "model.safetensors")


BAD_WEIGHTS = {
    "an unknown tensor": (lambda s: s.update({"bert.encoder.layer.0.extra.weight": torch.ones(3)}), "unknown tensor"),
    "a missing tensor": (lambda s: s.pop("bert.encoder.layer.0.output.dense.weight"), "missing tensors"),
    "a wrong shape": (
        lambda s: s.update({"bert.encoder.layer.0.attention.self.query.weight": torch.ones(32, 31)}),
        "has shape \\[32, 31\\]",
    ),
    "a NaN": (lambda s: s["bert.encoder.layer.0.output.dense.bias"].fill_(float("nan")), "holds NaN"),
}


@pytest.mark.parametrize("case", BAD_WEIGHTS)
def test_bad_weights_are_refused_with_the_converter_s_own_message(case, tmp_path):
    source = bert_folder(tmp_path / "bert", "ForMaskedLM", tie_word_embeddings=True)
    edit, message = BAD_WEIGHTS[case]
    edit_weights(source, edit)
    by_load, by_convert = refusals(source, tmp_path)
    assert by_load == by_convert
    assert re.search(message, by_load)


def test_a_refused_family_is_refused_by_name(tmp_path):
    folder = tmp_path / "longformer"
    config = transformers.LongformerConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37
    )
    transformers.LongformerModel(config).save_pretrained(folder)
    by_load, by_convert = refusals(folder, tmp_path, encoderstack.EncoderStackModel, "feature-extraction")
    assert by_load == by_convert and "model_type 'longformer' cannot be converted" in by_load


def test_a_load_that_strays_from_the_plan_is_refused(tmp_path, monkeypatch):
    """transformers alone would report a tensor that went nowhere and initialize its target at random."""
    source = bert_folder(tmp_path / "bert", "ForMaskedLM")
    planned = on_the_fly.key_mapping

    def one_rename_lost(conversion):
        mapping = planned(conversion)
        mapping.pop(next(key for key, target in mapping.items() if target == "model.layers.0.mlp.up.weight"))
        return mapping

    monkeypatch.setattr(on_the_fly, "key_mapping", one_rename_lost)
    with pytest.raises(ConversionError, match=r"did not follow the plan \(missing: model.layers.0.mlp.up.weight; "):
        encoderstack.EncoderStackForMaskedLM.from_pretrained(source)


def test_a_mapping_whose_target_is_another_source_name_is_left_to_the_converter():
    whole = {"a.x": (converter.SourceRows("b.x"),), "c.x": (converter.SourceRows("a.x"),)}
    plan = converter.Plan("bert", TASKS["feature-extraction"], None, whole, {}, [])
    assert on_the_fly.key_mapping(plan) is None  # transformers would rename a.x -> c.x after b.x -> a.x
    plan.mapped = {"c.x": (converter.SourceRows("a.x"),)}
    assert on_the_fly.key_mapping(plan) == {r"^a\.x$": "c.x"}


def test_a_target_built_from_rows_of_a_fused_tensor_is_left_to_the_converter():
    rows = {"q": (converter.SourceRows("qkv", rows=(0, 1)),), "k": (converter.SourceRows("qkv", rows=(2, 3)),)}
    assert on_the_fly.key_mapping(converter.Plan("x", TASKS["feature-extraction"], None, rows, {}, [])) is None


def test_a_tensorflow_release_still_loads_through_a_temporary_conversion(tmp_path):
    folder = tmp_path / "tf"
    shutil.copytree(Path(__file__).parent / "fixtures" / "tf" / "pretraining", folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    model = encoderstack.EncoderStackForPreTraining.from_pretrained(folder)
    expected = through_the_converter(
        folder, tmp_path / "out", encoderstack.EncoderStackForPreTraining, TASKS["pretraining"]
    )
    assert_same_model(model, expected)
    assert {path.name for path in tmp_path.iterdir()} == {"tf", "out"}


@pytest.mark.parametrize("family", ["gte", "nomic_bert", "jina_embeddings_v3"])
def test_a_family_with_fused_projections_loads_through_a_temporary_conversion(family, tmp_path, monkeypatch):
    """Their query, key and value are rows of one stored tensor: no renaming reaches them."""
    source = rope_folder(tmp_path / "source", family, "ForMaskedLM")
    converted = []
    monkeypatch.setattr(on_the_fly, "convert", lambda *a, **k: converted.append(a) or encoderstack.convert(*a, **k))
    model = encoderstack.EncoderStackForMaskedLM.from_pretrained(source)
    assert len(converted) == 1
    expected = through_the_converter(source, tmp_path / "out", encoderstack.EncoderStackForMaskedLM, TASKS["fill-mask"])
    assert_same_model(model, expected)


# Every family with a masked-LM head that transformers has a class for: its class and a builder of a tiny folder.
MASKED_LM_FAMILIES = {
    "bert": ("Bert", lambda folder: bert_folder(folder, "ForMaskedLM")),
    "megatron-bert": ("MegatronBert", lambda folder: bert_folder(folder, "ForMaskedLM", family="MegatronBert")),
    **{
        family: (prefix, partial(family_folder, family=family, suffix="ForMaskedLM"))
        for family, prefix in FAMILIES.items()
    },
    **{
        family: (prefix, partial(rope_folder, family=family, suffix="ForMaskedLM"))
        for family, (prefix, _, _) in ROPE_FAMILIES.items()
    },
    **{
        family: (prefix, partial(modern_folder, family=family, suffix="ForMaskedLM"))
        for family, (prefix, _) in MODERN_FAMILIES.items()
    },
}


def set_tied(folder, tied):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": tied}))


def with_a_decoder_apart(folder, reference_class):
    """The folder with a decoder stored apart from the word embeddings and different from them, while its config.json
    says `tie_word_embeddings: true` (a release whose decoder was trained untied, its config left at the default)."""
    set_tied(folder, False)
    model = reference_class.from_pretrained(folder)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.get_output_embeddings().parameters():  # BERT's and RoBERTa's: a bias of its own too
            param.normal_(0, 0.5)
    model.save_pretrained(folder)
    set_tied(folder, True)
    return folder


@pytest.mark.parametrize("family", sorted(MASKED_LM_FAMILIES))
def test_a_decoder_stored_apart_from_tied_embeddings_is_kept_as_transformers_keeps_it(family, tmp_path):
    """transformers leaves a decoder that differs from the embeddings untied (with a warning), and reads the decoder's
    own bias where the head stores another: loading on the fly and `convert` (verified) give its logits, and the
    converted config says tie_word_embeddings=false."""
    prefix, build = MASKED_LM_FAMILIES[family]
    reference_class = getattr(transformers, prefix + "ForMaskedLM")
    source = with_a_decoder_apart(build(tmp_path / "source"), reference_class)
    reference = reference_class.from_pretrained(source).eval()
    assert not torch.equal(reference.get_output_embeddings().weight, reference.get_input_embeddings().weight)
    folder = encoderstack.convert(source, tmp_path / "out")
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
    inputs, _ = right_padded_batch("ForMaskedLM")
    mask = inputs["attention_mask"].bool()
    with torch.no_grad():
        expected = real(reference(**inputs).logits, mask)
        for model in (
            encoderstack.EncoderStackForMaskedLM.from_pretrained(source),
            encoderstack.EncoderStackForMaskedLM.from_pretrained(folder),
        ):
            torch.testing.assert_close(real(model.eval()(**inputs).logits, mask), expected, atol=1e-5, rtol=0)
