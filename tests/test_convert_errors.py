"""A checkpoint that cannot be converted gets a one-line error naming the file and key, and nothing is written."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_convert_bert import bert_folder, rewrite_weights

import encoderstack
from encoderstack import ConversionError, cli
from encoderstack.conversion import converter as convert_module


@pytest.fixture
def source(tmp_path):
    return bert_folder(tmp_path / "bert", "ForMaskedLM")


def assert_refused(source, output, match, **kwargs):
    with pytest.raises(ConversionError, match=match):
        encoderstack.convert(source, output, **kwargs)
    assert not output.exists()
    assert [p.name for p in output.parent.iterdir() if p.name.startswith(f".{output.name}")] == []


def test_a_folder_without_weights_is_refused(source, tmp_path):
    (source / "model.safetensors").unlink()
    assert_refused(source, tmp_path / "out", r"bert: no weights found \(looked for model.safetensors")


def test_a_truncated_safetensors_file_is_refused(source, tmp_path):
    data = (source / "model.safetensors").read_bytes()
    (source / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_refused(source, tmp_path / "out", r"model.safetensors: not a readable safetensors file")


def test_a_truncated_pytorch_bin_is_refused(source, tmp_path):
    rewrite_weights(source, fmt="bin")
    data = (source / "pytorch_model.bin").read_bytes()
    (source / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    assert_refused(source, tmp_path / "out", r"pytorch_model.bin: not a readable PyTorch checkpoint")


class NotATensor:
    pass


def test_a_pickle_with_arbitrary_objects_is_refused_without_running_it(source, tmp_path):
    (source / "model.safetensors").unlink()
    torch.save({"bert.embeddings.word_embeddings.weight": NotATensor()}, source / "pytorch_model.bin")
    assert_refused(
        source,
        tmp_path / "out",
        r"pytorch_model.bin: not a readable PyTorch checkpoint \(refused by torch.load\(weights_only=True\): "
        r"Unsupported global: GLOBAL test_convert_errors.NotATensor",
    )


def test_a_missing_shard_is_refused(source, tmp_path):
    rewrite_weights(source, shards=2)
    (source / "model-00002-of-00002.safetensors").unlink()
    assert_refused(source, tmp_path / "out", r"model.safetensors.index.json: shard model-00002-of-00002.safetensors")


def test_a_checkpoint_of_another_architecture_is_refused(tmp_path):
    gpt2 = transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=99))
    gpt2.save_pretrained(tmp_path / "gpt2")
    assert_refused(tmp_path / "gpt2", tmp_path / "out", r"model_type 'gpt2' is not a BERT-family checkpoint")


def test_a_config_that_disagrees_with_the_tensor_shapes_is_refused(source, tmp_path):
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    assert_refused(
        source,
        tmp_path / "out",
        r"tensor 'bert.encoder.layer.0.intermediate.dense.bias' has shape \[37\], "
        r"but 'model.layers.0.mlp.up.bias' needs \[40\] for this config",
    )


def test_an_unknown_tensor_is_refused_by_name(source, tmp_path):
    state = load_file(source / "model.safetensors")
    state["bert.encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(3)
    save_file(state, source / "model.safetensors")
    assert_refused(source, tmp_path / "out", r"unknown tensor 'bert.encoder.layer.0.attention.self.rotary.weight'")


def test_a_missing_encoder_tensor_is_refused_by_name(source, tmp_path):
    state = load_file(source / "model.safetensors")
    del state["bert.encoder.layer.0.output.dense.bias"]
    save_file(state, source / "model.safetensors")
    assert_refused(
        source, tmp_path / "out", r"missing tensors for EncoderStackForMaskedLM: model.layers.0.mlp.down.bias"
    )


def test_an_unreadable_config_is_refused(source, tmp_path):
    (source / "config.json").write_text("{not json")
    assert_refused(source, tmp_path / "out", r"config.json: not readable JSON")


def test_a_config_outside_what_encoderstack_describes_is_refused(source, tmp_path):
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "position_embedding_type": "relative_key"}))
    assert_refused(source, tmp_path / "out", r"position_embedding_type 'relative_key' is not supported")


def test_a_parity_failure_fails_the_conversion_and_leaves_no_folder(source, tmp_path, monkeypatch):
    original = convert_module.write_safetensors

    def corrupting_writer(path, tensors, mapped):  # a converter bug: one bias entry is off by 1e-3
        original(path, tensors, mapped)
        state = load_file(path)
        state["model.layers.0.mlp.down.bias"][0] += 1e-3  # one entry: a uniform shift would vanish in the LN
        save_file(state, path, metadata={"format": "pt"})

    monkeypatch.setattr(convert_module, "write_safetensors", corrupting_writer)
    assert_refused(source, tmp_path / "out", r"parity above 1e-05 on logits \(eager\): .*; hidden_states \(eager\)")


def test_the_command_line_reports_an_expected_failure_in_one_line_without_a_traceback(source, tmp_path):
    (source / "config.json").write_text("{not json")
    result = subprocess.run(
        [sys.executable, "-m", "encoderstack", "convert", str(source), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("encoderstack: error: ") and "config.json: not readable JSON" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def set_tensor(folder, key, value):
    state = load_file(folder / "model.safetensors")
    state[key] = value
    save_file(state, folder / "model.safetensors")


def set_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_weight_holding_nan_or_inf_is_refused_by_name_even_without_verification(source, tmp_path, value):
    set_tensor(source, "bert.encoder.layer.0.output.dense.bias", torch.full((32,), value))
    assert_refused(
        source,
        tmp_path / "out",
        r"model.safetensors: tensor 'bert.encoder.layer.0.output.dense.bias' "
        r"holds NaN or infinite values",
        verify=False,
    )


def test_from_pretrained_refuses_a_bert_folder_with_a_nan_weight(source, tmp_path):
    set_tensor(source, "bert.embeddings.LayerNorm.weight", torch.full((32,), float("nan")))
    with pytest.raises(ConversionError, match=r"tensor 'bert.embeddings.LayerNorm.weight' holds NaN"):
        encoderstack.EncoderStackForMaskedLM.from_pretrained(source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert"]


def test_nan_in_the_converted_model_s_outputs_fails_verification(source, tmp_path, monkeypatch):
    original = convert_module.write_safetensors

    def nan_writer(path, tensors, mapped):  # a converter bug that writes a NaN
        original(path, tensors, mapped)
        state = load_file(path)
        state["model.layers.0.mlp.down.bias"][0] = float("nan")
        save_file(state, path, metadata={"format": "pt"})

    monkeypatch.setattr(convert_module, "write_safetensors", nan_writer)
    assert_refused(
        source,
        tmp_path / "out",
        r"\AEncoderStack \(eager\) output logits, hidden_states has NaN/inf "
        r"on real tokens\Z",
    )


def test_outputs_that_overflow_in_the_reference_fail_verification(source, tmp_path):
    set_tensor(source, "bert.embeddings.word_embeddings.weight", torch.full((99, 32), 3e38))  # finite, sums to inf
    assert_refused(
        source,
        tmp_path / "out",
        r"\Athe reference BertForMaskedLM \(eager\) output logits, hidden_states, attentions has NaN/inf on "
        r"real tokens\Z",
    )


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_a_weight_stored_as_an_integer_is_refused_naming_file_key_and_dtype(source, tmp_path, dtype):
    set_tensor(source, "bert.encoder.layer.0.output.dense.bias", torch.ones(32, dtype=dtype))
    assert_refused(
        source,
        tmp_path / "out",
        rf"model.safetensors: tensor 'bert.encoder.layer.0.output.dense.bias' "
        rf"is stored as {dtype}; a BERT weight is floating point",
    )


def test_a_classifier_with_zero_labels_is_refused(tmp_path):
    source = bert_folder(tmp_path / "bert", "ForSequenceClassification")
    set_config(source, id2label={}, label2id={}, num_labels=0)
    set_tensor(source, "classifier.weight", torch.zeros(0, 32))
    set_tensor(source, "classifier.bias", torch.zeros(0))
    assert_refused(source, tmp_path / "out", r"bert/config.json: num_labels is 0; a classifier needs 1 or more")


@pytest.mark.parametrize("name", ["./does-not-exist", "../bert", "-bad-", "x" * 200])
def test_a_missing_path_is_no_such_folder_and_never_sent_to_the_hub(name, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("asked the Hub"))
    monkeypatch.chdir(tmp_path)
    assert_refused(name, tmp_path / "out", rf"\A{re.escape(name)}: no such folder\Z")


def test_the_command_line_says_no_such_folder_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["convert", "./does-not-exist", "out"]) == 2
    assert capsys.readouterr().err == "encoderstack: error: ./does-not-exist: no such folder\n"


def test_a_source_that_is_a_symlink_loop_is_refused_in_one_line(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert_refused(tmp_path / "a", tmp_path / "out", r"/a: a symlink loop\Z")


@pytest.mark.parametrize("links", [{"a": "b", "b": "a"}, {"self": "."}, {"1_Pooling/up": ".."}])
def test_a_symlink_loop_inside_the_source_is_refused_in_one_line(source, tmp_path, links):
    (source / "1_Pooling").mkdir()
    for name, target in links.items():
        (source / name).symlink_to(target)
    assert_refused(source, tmp_path / "out", r"bert/(a|b|self|1_Pooling/up): a symlink loop")


@pytest.mark.parametrize(
    "weight_map",
    [
        ["model-00001-of-00002.safetensors"],
        "model-00001-of-00002.safetensors",
        {"bert.embeddings.word_embeddings.weight": 3},
    ],
)
def test_a_shard_index_whose_weight_map_is_not_an_object_of_file_names_is_refused(source, tmp_path, weight_map):
    rewrite_weights(source, shards=2)
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_refused(
        source,
        tmp_path / "out",
        r"model.safetensors.index.json: weight_map must be an object of tensor "
        r"name -> shard file name",
    )


def test_a_stray_index_file_does_not_make_a_bert_folder_a_tensorflow_checkpoint(source, tmp_path):
    (source / "notes.index").write_text("an index of my notes")
    (source / "search.index").write_bytes(b"\0" * 64)
    folder = encoderstack.convert(source, tmp_path / "out", verify=False)
    assert json.loads((folder / "conversion.json").read_text())["source_format"] == "safetensors"


def test_export_bert_refuses_a_folder_that_is_not_encoderstack(source, tmp_path, capsys):
    assert cli.main(["export-bert", str(source), str(tmp_path / "back")]) == 2
    assert capsys.readouterr().err == f"encoderstack: error: {source}: not an EncoderStack folder (model_type 'bert')\n"
    assert not (tmp_path / "back").exists()


class RunsACommand:
    def __reduce__(self):
        return os.system, ("echo this pickle ran a command",)


def test_a_hostile_pickle_is_refused_naming_the_global_and_never_advising_weights_only_false(source, tmp_path):
    (source / "model.safetensors").unlink()
    torch.save({"bert.embeddings.word_embeddings.weight": RunsACommand()}, source / "pytorch_model.bin")
    with pytest.raises(ConversionError) as refused:
        encoderstack.convert(source, tmp_path / "out")
    message = str(refused.value)
    assert re.search(
        r"pytorch_model.bin: not a readable PyTorch checkpoint \(refused by "
        r"torch.load\(weights_only=True\): .*GLOBAL (posix|os|nt)\.system",
        message,
    ), message
    assert "weights_only=False" not in message and "`weights_only` set to `False`" not in message
    assert "\n" not in message


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_config_value_is_named_in_the_source_config(source, tmp_path, value):
    set_config(source, layer_norm_eps=value)
    assert_refused(source, tmp_path / "out", rf"\A{re.escape(str(source / 'config.json'))}: layer_norm_eps is {value}")


@pytest.mark.parametrize("pad_token_id", [99, 50283, -1])
def test_a_pad_token_id_outside_the_vocabulary_is_named_with_the_vocabulary_size(source, tmp_path, pad_token_id):
    set_config(source, pad_token_id=pad_token_id)
    message = (
        f"{source / 'config.json'}: config cannot describe an EncoderStack: `pad_token_id` must be None or an id of "
        f"the vocabulary, in [0, 98] (`vocab_size` 99), got {pad_token_id}."
    )
    assert_refused(source, tmp_path / "out", rf"\A{re.escape(message)}\Z")
    with pytest.raises(ConversionError) as by_load:
        encoderstack.EncoderStackForMaskedLM.from_pretrained(source)
    assert str(by_load.value) == message


def test_an_unknown_architecture_names_the_config_file(source, tmp_path):
    set_config(source, architectures=["BertLMHeadModel"])
    assert_refused(
        source,
        tmp_path / "out",
        rf"\A{re.escape(str(source / 'config.json'))}: architecture 'BertLMHeadModel' cannot be converted",
    )


def test_a_tokenizer_with_ids_beyond_the_embeddings_is_refused(source, tmp_path):
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(150)] + ["the", "quick"]
    (tmp_path / "vocab.txt").write_text("\n".join(tokens))
    transformers.BertTokenizer(str(tmp_path / "vocab.txt")).save_pretrained(source)
    assert_refused(source, tmp_path / "out", r"bert: the tokenizer gives token id 156, but vocab_size is 99")


TINY = {"vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 37}


@pytest.mark.parametrize(("family", "model_type"), [("Longformer", "longformer"), ("BigBird", "big_bird")])
def test_from_pretrained_refuses_a_folder_of_a_family_it_cannot_express_as_convert_does(tmp_path, family, model_type):
    """transformers would load it into EncoderStack with most weights newly initialized, and only a load report."""
    folder = tmp_path / family.lower()
    config = getattr(transformers, family + "Config")(**TINY)
    getattr(transformers, family + "Model")(config).save_pretrained(folder)
    with pytest.raises(ConversionError) as refused_by_convert:
        encoderstack.convert(folder, tmp_path / "out")
    assert f"model_type '{model_type}' cannot be converted: " in str(refused_by_convert.value)
    for model_class in (encoderstack.EncoderStackModel, encoderstack.EncoderStackForSequenceClassification):
        with pytest.raises(ConversionError) as refused_by_load:
            model_class.from_pretrained(folder)
        assert str(refused_by_load.value) == str(refused_by_convert.value)
