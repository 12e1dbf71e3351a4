"""Converted BERT checkpoints reproduce transformers' own classes: every architecture, shape and file format."""

import hashlib
import json

import pytest
import torch
import transformers
from conftest import real
from safetensors.torch import load_file, save_file

import encoderstack
from encoderstack.conversion.keymap import FAMILIES, TASKS
from encoderstack.conversion.verify import OUTPUTS

SHAPES = {
    "one-layer": {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 37},
    "many-heads": {"num_hidden_layers": 2, "hidden_size": 48, "num_attention_heads": 12, "intermediate_size": 64},
    "relu": {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "intermediate_size": 50,
        "hidden_act": "relu",
    },
    "gelu_new": {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "intermediate_size": 37,
        "hidden_act": "gelu_new",
    },
}
ARCHITECTURES = [task.bert_suffix for task in TASKS.values() if task.name in FAMILIES["bert"].tasks]


def bert_folder(folder, suffix="ForMaskedLM", family="Bert", shape="one-layer", seed=0, **extra):
    """A randomly initialized transformers model of that architecture, saved as a checkpoint folder."""
    config_class = transformers.MegatronBertConfig if family == "MegatronBert" else transformers.BertConfig
    config = config_class(
        vocab_size=99,
        max_position_embeddings=64,
        type_vocab_size=2,
        **SHAPES[shape],
        id2label={0: "neg", 1: "neutral", 2: "pos"},
        label2id={"neg": 0, "neutral": 1, "pos": 2},
        **extra,
    )
    if suffix in ("ForQuestionAnswering", "ForNextSentencePrediction"):
        config.num_labels = 2
    torch.manual_seed(seed)
    model = getattr(transformers, family + suffix)(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # away from the init so that no weight is trivially 0 or 1
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(folder)
    return folder


def inputs_for(suffix):
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 99, (4, 10), generator=generator)
    lengths = torch.tensor([10, 6, 3, 8])
    mask = (torch.arange(10) < lengths[:, None]).long()
    types = ((torch.arange(10) >= lengths[:, None] // 2) & mask.bool()).long()
    batch = {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": types}
    if suffix == "ForMultipleChoice":
        batch = {key: value.view(2, 2, 10) for key, value in batch.items()}
    return batch


def labels_for(suffix, batch):
    """Labels of every kind the head takes, one per sequence or per token (class 0 stands for no label)."""
    generator = torch.Generator().manual_seed(6)
    shape = batch["input_ids"].shape
    per_token = torch.randint(0, 3, shape, generator=generator)
    per_row = torch.randint(0, 2, shape[:1], generator=generator)
    return {
        "Model": {},
        "ForMaskedLM": {"labels": per_token},
        "ForPreTraining": {"labels": per_token, "next_sentence_label": per_row},
        "ForNextSentencePrediction": {"labels": per_row},
        "ForSequenceClassification": {"labels": per_row},
        "ForTokenClassification": {"labels": per_token},
        "ForQuestionAnswering": {
            "start_positions": torch.tensor([1, 0, 2, 9]),
            "end_positions": torch.tensor([3, 5, 2, 9]),
        },
        "ForMultipleChoice": {"labels": per_row},
    }[suffix]


def assert_same_loss(reference, converted, batch, suffix):
    """Without padding, the loss equals BERT's (with padding it differs on purpose: padded positions never count)."""
    full = {**batch, "attention_mask": torch.ones_like(batch["attention_mask"])}
    labels = labels_for(suffix, full)
    if not labels:
        return
    with torch.no_grad():
        expected, actual = reference(**full, **labels).loss, converted(**full, **labels).loss
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0, msg="loss")


def main_outputs(outputs):
    return {name: getattr(outputs, name) for name in OUTPUTS if getattr(outputs, name, None) is not None}


def assert_parity(reference, converted, suffix, backend):
    batch = inputs_for(suffix)
    mask = batch["attention_mask"].reshape(-1, 10)
    reference.set_attn_implementation(backend if reference._supports_sdpa else "eager")  # Megatron: eager only
    converted.set_attn_implementation(backend)
    eager = backend == "eager"
    expected = reference(**batch, output_hidden_states=True, output_attentions=eager)
    actual = converted(**batch, output_hidden_states=True, output_attentions=eager)
    expected_main, actual_main = main_outputs(expected), main_outputs(actual)
    assert expected_main.keys() == actual_main.keys()
    for name in expected_main:
        torch.testing.assert_close(
            real(actual_main[name], mask), real(expected_main[name], mask), atol=1e-5, rtol=0, msg=name
        )
    assert len(actual.hidden_states) == len(expected.hidden_states)
    for a, e in zip(actual.hidden_states, expected.hidden_states):
        torch.testing.assert_close(real(a, mask), real(e, mask), atol=1e-5, rtol=0)
    assert_same_loss(reference, converted, batch, suffix)
    if eager:
        for a, e in zip(actual.attentions, expected.attentions, strict=True):
            torch.testing.assert_close(
                a.transpose(1, 2)[mask.bool()], e.transpose(1, 2)[mask.bool()], atol=1e-5, rtol=0
            )
    # One backward pass through the real-token outputs: the gradients agree too, to 1e-5 of their largest entry
    # (outputs are O(1), so 1e-5 absolute; a gradient's scale is the loss's, so it is normalized first).
    loss = lambda out: sum(real(v, mask).pow(2).sum() for v in main_outputs(out).values())  # noqa: E731
    loss(expected).backward()
    loss(actual).backward()
    for ours, theirs in (
        (converted.get_input_embeddings(), reference.get_input_embeddings()),
        (converted.base_model.layers[0].attention.query, query_of(reference)),
    ):
        scale = theirs.weight.grad.abs().max()
        torch.testing.assert_close(ours.weight.grad / scale, theirs.weight.grad / scale, atol=1e-5, rtol=0)


def query_of(reference):
    return reference.base_model.encoder.layer[0].attention.self.query


def convert_and_load(source, output, suffix, family="Bert", **kwargs):
    folder = encoderstack.convert(source, output, **kwargs)
    task = next(t for t in TASKS.values() if t.bert_suffix == suffix)
    reference = getattr(transformers, family + suffix).from_pretrained(source).eval()
    converted = getattr(encoderstack, task.encoderstack_class).from_pretrained(folder).eval()
    return reference, converted


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("suffix", ARCHITECTURES)
def test_every_bert_architecture_converts_with_parity(suffix, backend, tmp_path):
    source = bert_folder(tmp_path / "bert", suffix)
    reference, converted = convert_and_load(source, tmp_path / "out", suffix)
    assert_parity(reference, converted, suffix, backend)


@pytest.mark.parametrize("shape", SHAPES)
def test_bert_shapes_and_activations_convert_with_parity(shape, tmp_path):
    source = bert_folder(tmp_path / "bert", "ForPreTraining", shape=shape)
    reference, converted = convert_and_load(source, tmp_path / "out", "ForPreTraining")
    for backend in ("eager", "sdpa"):
        assert_parity(reference, converted, "ForPreTraining", backend)


@pytest.mark.parametrize("suffix", ["Model", "ForMaskedLM", "ForSequenceClassification"])
def test_megatron_bert_converts_to_pre_ln_with_parity(suffix, tmp_path):
    source = bert_folder(tmp_path / "megatron", suffix, family="MegatronBert", shape="many-heads")
    reference, converted = convert_and_load(source, tmp_path / "out", suffix, family="MegatronBert")
    assert (converted.config.norm_placement, converted.config.embedding_norm) == ("pre", False)
    for backend in ("eager", "sdpa"):
        assert_parity(reference, converted, suffix, backend)


def rewrite_weights(folder, rename=lambda key: key, fmt="safetensors", shards=1):
    """The same checkpoint in another on-disk format or with other key spellings."""
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    state = {rename(key): value.contiguous() for key, value in state.items()}
    if fmt == "bin":
        torch.save(state, folder / "pytorch_model.bin")
        return folder
    keys = sorted(state)
    weight_map = {}
    for shard in range(shards):
        name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = {key: state[key] for key in keys[shard::shards]}
        save_file(part, folder / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


LEGACY = lambda key: key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")  # noqa: E731,E501
FORMATS = {
    "sharded-safetensors": {"shards": 3},
    "pytorch_model.bin": {"fmt": "bin"},
    "legacy-gamma-beta": {"rename": LEGACY},
    "legacy-gamma-beta-bin": {"rename": LEGACY, "fmt": "bin"},
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("suffix", ["ForPreTraining", "ForTokenClassification"])
def test_every_source_format_converts_with_parity(suffix, fmt, tmp_path):
    pristine = bert_folder(tmp_path / "pristine", suffix)
    source = rewrite_weights(bert_folder(tmp_path / "bert", suffix), **FORMATS[fmt])
    folder = encoderstack.convert(source, tmp_path / "out")
    reference = getattr(transformers, "Bert" + suffix).from_pretrained(pristine).eval()
    task = next(t for t in TASKS.values() if t.bert_suffix == suffix)
    converted = getattr(encoderstack, task.encoderstack_class).from_pretrained(folder).eval()
    assert_parity(reference, converted, suffix, "sdpa")


def test_base_model_keys_with_the_bert_prefix_convert_with_parity(tmp_path):
    source = rewrite_weights(bert_folder(tmp_path / "bert", "Model"), rename=lambda key: "bert." + key)
    reference, converted = convert_and_load(source, tmp_path / "out", "Model")
    assert_parity(reference, converted, "Model", "sdpa")


def test_the_label_maps_and_problem_type_carry_over(tmp_path):
    source = bert_folder(tmp_path / "bert", "ForSequenceClassification", problem_type="multi_label_classification")
    config = encoderstack.EncoderStackForSequenceClassification.from_pretrained(
        encoderstack.convert(source, tmp_path / "out")
    ).config
    assert config.id2label == {0: "neg", 1: "neutral", 2: "pos"}
    assert config.label2id == {"neg": 0, "neutral": 1, "pos": 2}
    assert config.problem_type == "multi_label_classification"


def test_next_sentence_prediction_becomes_two_way_sequence_classification(tmp_path):
    source = bert_folder(tmp_path / "bert", "ForNextSentencePrediction")
    folder = encoderstack.convert(source, tmp_path / "out")
    converted = encoderstack.EncoderStackForSequenceClassification.from_pretrained(folder).eval()
    assert converted.config.num_labels == 2
    reference = transformers.BertForNextSentencePrediction.from_pretrained(source).eval()
    assert_parity(reference, converted, "ForNextSentencePrediction", "eager")


def test_a_task_override_keeps_the_encoder_and_reports_the_head_it_drops(tmp_path):
    source = bert_folder(tmp_path / "bert", "ForPreTraining")
    folder = encoderstack.convert(source, tmp_path / "out", task="masked-lm")
    report = json.loads((folder / "conversion.json").read_text())
    assert report["encoderstack_class"] == "EncoderStackForMaskedLM"
    assert (
        report["skipped"]["cls.seq_relationship.weight"] == "head of task 'pretraining', not used by task 'masked-lm'"
    )
    reference = transformers.BertForMaskedLM.from_pretrained(source).eval()
    assert_parity(reference, encoderstack.EncoderStackForMaskedLM.from_pretrained(folder).eval(), "ForMaskedLM", "sdpa")


def test_a_task_override_to_a_new_head_lists_what_it_initialized(tmp_path):
    source = bert_folder(tmp_path / "bert", "Model")
    folder = encoderstack.convert(source, tmp_path / "out", task="token-classification")
    report = json.loads((folder / "conversion.json").read_text())
    assert report["initialized"] == ["classifier.bias", "classifier.weight"]


@pytest.mark.parametrize("suffix", ["ForMaskedLM", "ForPreTraining"])
def test_an_untied_head_reads_its_decoders_own_bias_as_transformers_does(suffix, tmp_path):
    """With tie_word_embeddings=false, transformers keeps `cls.predictions.bias` and the decoder's own bias apart (both
    stored) and its forward reads the decoder's."""
    source = bert_folder(tmp_path / "bert", suffix, tie_word_embeddings=False)
    state = load_file(source / "model.safetensors")
    assert not torch.equal(state["cls.predictions.bias"], state["cls.predictions.decoder.bias"])
    reference, converted = convert_and_load(source, tmp_path / "out", suffix)
    report = json.loads((tmp_path / "out" / "conversion.json").read_text())
    assert report["mapped"]["cls.predictions.decoder.bias"] == "lm_head.decoder.bias"
    assert "cls.predictions.bias" in report["skipped"]
    assert_parity(reference, converted, suffix, "sdpa")


def test_the_conversion_report_accounts_for_every_source_tensor(tmp_path):
    source = bert_folder(tmp_path / "bert", "ForPreTraining")
    folder = encoderstack.convert(source, tmp_path / "out")
    report = json.loads((folder / "conversion.json").read_text())
    source_keys = set(load_file(source / "model.safetensors"))
    assert set(report["mapped"]) | set(report["skipped"]) == source_keys
    assert not set(report["mapped"]) & set(report["skipped"])
    digest = hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()
    assert report["source_files"] == {"model.safetensors": digest}
    results = report["parity"]["results"]
    assert set(results) == {"eager", "sdpa"}
    assert all(row["max_abs_diff"] <= 1e-5 for rows in results.values() for row in rows)
    assert {row["output"] for row in results["eager"]} == {
        "hidden_states",
        "attentions",
        "prediction_logits",
        "seq_relationship_logits",
    }


def test_the_output_folder_is_a_drop_in_replacement_for_the_source(tmp_path):
    source = bert_folder(tmp_path / "bert", "ForMaskedLM")
    (source / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    (source / "1_Pooling").mkdir()
    (source / "1_Pooling" / "config.json").write_text("{}")
    folder = encoderstack.convert(source, tmp_path / "out")
    names = {path.name for path in folder.iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "configuration_encoderstack.py",
        "execution_encoderstack.py",
        "modeling_encoderstack.py",
        "conversion.json",
        "README.md",
        "vocab.txt",
        "1_Pooling",
    }
    assert (folder / "vocab.txt").read_text() == "[PAD]\n[UNK]\n"
    assert json.loads((folder / "config.json").read_text())["auto_map"] == encoderstack.AUTO_MAP


def test_from_pretrained_converts_a_bert_folder_on_the_fly(tmp_path):
    source = bert_folder(tmp_path / "bert", "ForMaskedLM")
    converted = encoderstack.EncoderStackForMaskedLM.from_pretrained(source).eval()
    reference = transformers.BertForMaskedLM.from_pretrained(source).eval()
    assert_parity(reference, converted, "ForMaskedLM", "sdpa")
    assert {path.name for path in tmp_path.iterdir()} == {"bert"}


def test_export_bert_round_trip_gives_identical_tensors(tmp_path):
    for suffix in ARCHITECTURES:
        if suffix == "ForNextSentencePrediction":
            continue  # converts to sequence classification, which exports as BertForSequenceClassification
        source = bert_folder(tmp_path / suffix, suffix)
        folder = encoderstack.convert(source, tmp_path / f"{suffix}-es", verify=False)
        back = encoderstack.export_bert(folder, tmp_path / f"{suffix}-bert")
        assert json.loads((back / "config.json").read_text())["architectures"] == ["Bert" + suffix]
        original = getattr(transformers, "Bert" + suffix).from_pretrained(source).state_dict()
        exported = getattr(transformers, "Bert" + suffix).from_pretrained(back).state_dict()
        assert original.keys() == exported.keys()
        for key in original:
            assert torch.equal(original[key], exported[key]), (suffix, key)


@pytest.mark.parametrize("suffix", ["ForMaskedLM", "ForPreTraining"])
def test_export_bert_of_an_untied_head_keeps_the_decoder_bias_berts_class_reads(suffix, tmp_path):
    source = bert_folder(tmp_path / "bert", suffix, tie_word_embeddings=False)
    back = encoderstack.export_bert(encoderstack.convert(source, tmp_path / "es"), tmp_path / "back")
    original = getattr(transformers, "Bert" + suffix).from_pretrained(source).eval()
    exported = getattr(transformers, "Bert" + suffix).from_pretrained(back).eval()
    batch = inputs_for(suffix)
    with torch.no_grad():
        for name, value in main_outputs(original(**batch)).items():
            torch.testing.assert_close(getattr(exported(**batch), name), value, atol=1e-5, rtol=0, msg=name)


def test_export_bert_refuses_a_placement_bert_cannot_express(tmp_path):
    model = encoderstack.EncoderStackModel(
        encoderstack.EncoderStackConfig(
            vocab_size=99,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=37,
            norm_placement="sandwich",
        )
    )
    model.save_pretrained(tmp_path / "sandwich")
    with pytest.raises(encoderstack.ConversionError, match="BERT cannot express norm_placement='sandwich'"):
        encoderstack.export_bert(tmp_path / "sandwich", tmp_path / "bert")
    assert not (tmp_path / "bert").exists()


def test_a_hub_id_is_resolved_through_the_normal_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    snapshot = tmp_path / "hub" / "models--someone--tiny-bert" / "snapshots" / ("0" * 40)
    bert_folder(snapshot, "ForMaskedLM")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    folder = encoderstack.convert("someone/tiny-bert", tmp_path / "out")
    assert json.loads((folder / "conversion.json").read_text())["source"] == "someone/tiny-bert"
