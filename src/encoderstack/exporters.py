"""EncoderStack -> ONNX or OpenVINO through `transformers.exporters`, checked against PyTorch on real tokens,
optionally int8.

The output folder is the one `transformers.exporters.ExportedModel.from_pretrained` loads (the exporter's manifest
`export.json`, `model.onnx` + `model.onnx.data` or `openvino_model.xml` + `.bin`, `config.json`), plus the tokenizer
and `encoderstack_export.json`, the record of what was exported and how well it matched; an int8 model is a second
such folder, `int8/`. Nothing appears until the whole folder is written and checked.
"""

import contextlib
import copy
import csv
import dataclasses
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import warnings
from pathlib import Path

import torch
import transformers
from torch import nn

from . import modeling_encoderstack
from .checkpoint import expected_tensors, sha256
from .configuration_encoderstack import EncoderStackConfig
from .conversion.keymap import ConversionError, task_named
from .conversion.sources import require_hf_weights
from .conversion.verify import OUTPUTS, fitting, sample_batches
from .data import SENTIMENT
from .jsonfile import read_json_object
from .modeling_encoderstack import EncoderStackForMultipleChoice, EncoderStackModel, EncoderStackPreTrainedModel
from .output_folder import OutputFolder
from .parity import real_tokens
from .version import __version__

RECORD = "encoderstack_export.json"
INT8_FOLDER = "int8"
TOLERANCE = 1e-4
MIN_INT8_COSINE = 0.99
# OpenVINO's CPU plugin runs in bf16 by default where the CPU has AVX-512 BF16 or AMX, whatever the graph's recorded
# precision says (checked on OpenVINO 2026.4): a compile property pins it. A bf16 export is checked by direction
# (bf16 keeps 8 bits, so ~1e-2 absolute on hidden states), not by the float32 tolerance.
PRECISIONS = ("f32", "bf16")
PRECISION_HINT = "INFERENCE_PRECISION_HINT"
MIN_BF16_COSINE = 0.999
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
QUANTIZATIONS = ("int8",)
# torch.onnx writes opset 18 and converts it with onnxscript's version converter, which supports 18 to 25 (onnxscript
# 0.7); below 18 it falls back to ONNX's converter, which cannot lower RMSNormalization, and writes 18 after all.
OPSETS = range(18, 26)
POOLER = {"pooler.dense.weight", "pooler.dense.bias"}
NORMALIZATIONS = ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization")
SMOOTHING_ALPHA = 0.5
CALIBRATION_TEXT = SENTIMENT / "train.csv"  # shipped sentences, none of them the verification text
CALIBRATION_SENTENCES = 160


@dataclasses.dataclass(frozen=True)
class Format:
    """One export format: the exporter and config class names in `transformers.exporters`, the runtime that runs it
    (for the record and the parity table), the packages it needs and the extra that installs them."""

    exporter: str
    config: str
    runtime: str
    packages: tuple[str, ...]
    extra: str


FORMATS = {
    "onnx": Format("OnnxExporter", "OnnxConfig", "onnxruntime", ("onnx", "onnxscript", "onnxruntime"), "onnx"),
    "openvino": Format("OpenVINOExporter", "OpenVINOConfig", "openvino", ("openvino",), "openvino"),
}


class ExportError(ValueError):
    """A model that cannot be exported as asked, or an export that failed its checks; the message says which."""


LIBRARY_LOGGERS = ("transformers.exporters", "torch.onnx", "onnxscript", "nncf", "")


@contextlib.contextmanager
def quiet():
    """Silence the libraries' loggers, warnings and progress prints for the duration (the exporters' notes that they
    are experimental, torch.onnx's progress lines, the quantizers' advice on the root logger)."""
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def load_model(model_or_folder, task: str | None) -> tuple[EncoderStackPreTrainedModel, str, Path | None, object]:
    """The model to export (float32, eval, a copy when the caller passed one), its description, its folder and its
    tokenizer (None without one)."""
    if isinstance(model_or_folder, nn.Module):
        if not isinstance(model_or_folder, EncoderStackPreTrainedModel):
            raise ExportError(
                f"{type(model_or_folder).__name__} is not an EncoderStack model; convert it first "
                "(encoderstack convert)"
            )
        if task is not None:
            raise ExportError(f"task={task!r} chooses the head to load from a folder; pass the model of that head")
        # a module that torch.export traced runs ~3x slower afterwards: keep the caller's own model untouched
        model = copy.deepcopy(model_or_folder)
        folder = Path(model.name_or_path) if model.name_or_path and Path(model.name_or_path).is_dir() else None
        tokenizer = load_tokenizer(folder, model.config.vocab_size)
        return model.float().cpu().eval(), f"<{type(model).__name__} instance>", folder, tokenizer
    folder = Path(model_or_folder)
    if not folder.is_dir():
        raise ExportError(f"{folder}: no such folder")
    config = read_json_object(folder / "config.json", ExportError)
    if config.get("model_type") != EncoderStackConfig.model_type:
        raise ExportError(
            f"{folder / 'config.json'}: model_type {config.get('model_type')!r} is not an EncoderStack "
            "model; convert it first (encoderstack convert)"
        )
    class_name = (
        task_named(task, ExportError).encoderstack_class
        if task
        else (config.get("architectures") or ["EncoderStackModel"])[0]
    )
    if class_name not in modeling_encoderstack.__all__ or not class_name.startswith("EncoderStack"):
        raise ExportError(f"{folder / 'config.json'}: architecture {class_name!r} is not an EncoderStack model class")
    tokenizer = load_tokenizer(folder, config.get("vocab_size"))  # before the weights: a mismatch fails fast
    missing = missing_tensors(folder, class_name)
    # A bare model is whole without BERT's pooler (BERT's add_pooling_layer=False): exported without pooler_output.
    options = {"add_pooling_layer": False} if class_name == "EncoderStackModel" and missing == POOLER else {}
    if missing and not options:
        raise ExportError(
            f"{folder}: no weights for {', '.join(sorted(missing))} of {class_name} (the export would hold them "
            "randomly initialized); export the folder's own head, or fine-tune this one first"
        )
    try:
        model = getattr(modeling_encoderstack, class_name).from_pretrained(folder, **options)
    except (OSError, ValueError) as error:
        raise ExportError(f"{folder}: cannot load {class_name}: {error}") from None
    return model.float().eval(), str(model_or_folder), folder, tokenizer


def missing_tensors(folder: Path, class_name: str) -> set[str]:
    """The tensors of `class_name` that the folder's weights lack (the `model.` prefix of the heads aside); weights
    that are absent or do not read (a truncated file) are refused as `convert` refuses them."""
    try:
        config = EncoderStackConfig.from_pretrained(folder)
        tensors = require_hf_weights(folder)
    except ConversionError as error:
        raise ExportError(str(error)) from None
    except (OSError, ValueError) as error:  # the config's own validation says what is wrong
        raise ExportError(f"{folder / 'config.json'}: {' '.join(str(error).split())}") from None
    try:
        held = {key.removeprefix("model.") for key in tensors.keys()}  # noqa: SIM118  (a lazy weights reader)
    finally:
        tensors.close()
    return {key.removeprefix("model.") for key in expected_tensors(config, class_name)} - held


def load_tokenizer(folder: Path | None, vocab_size: int | None):
    if folder is None:
        return None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError):
        return None
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ExportError(
            f"{folder}: the tokenizer has {len(tokenizer)} tokens, more than the model's vocab_size "
            f"{vocab_size} in config.json"
        )
    return tokenizer


def multiple_choice(model) -> bool:
    return isinstance(model, EncoderStackForMultipleChoice)


def axes(choices: bool) -> tuple[str, ...]:
    return ("batch_size", "num_choices", "sequence_length") if choices else ("batch_size", "sequence_length")


def graph_inputs(config) -> tuple[str, ...]:
    """The inputs the graph takes: token types only where the model has more than one (RoBERTa's and the modern
    encoders' tokenizers return none, and their one type is what the model adds without them)."""
    return INPUTS if config.type_vocab_size > 1 else INPUTS[:2]


def example_inputs(config, choices: bool) -> dict:
    """What the export traces: a shape that no verification batch has (3 x 8, or 3 x 3 choices x 8), padded."""
    generator = torch.Generator().manual_seed(0)
    shape = (3, 3, 8) if choices else (3, 8)
    mask = torch.ones(shape, dtype=torch.long)
    mask[1, ..., 5:] = 0
    ids = torch.randint(1, config.vocab_size, shape, generator=generator) * mask
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    return {name: inputs[name] for name in graph_inputs(config)}


def output_names(model, inputs) -> list[str]:
    with torch.no_grad():
        outputs = model(**inputs, return_dict=True)
    return [name for name in outputs if name in OUTPUTS]


def export_config(format_name: str, config, choices: bool, opset: int | None):
    """The exporter's config: every input's axes dynamic and named (batch_size, [num_choices,] sequence_length), the
    sequence no longer than the learned position table where there is one."""
    from transformers import exporters

    longest = {"max": fitting(config)["max_length"]} if config.position_embedding_type == "absolute" else {}
    dims = [torch.export.Dim(axis, **(longest if axis == "sequence_length" else {})) for axis in axes(choices)]
    dynamic = {name: dict(enumerate(dims)) for name in graph_inputs(config)}
    options = {"opset_version": opset} if format_name == "onnx" else {}
    return getattr(exporters, FORMATS[format_name].config)(dynamic_shapes=dynamic, **options)


def export_program(model, inputs: dict, format_name: str, choices: bool, opset: int | None):
    """Trace the padded path (the packed path branches on the mask's values) with transformers' exporter."""
    from transformers import exporters

    padding_free, model.config.padding_free = model.config.padding_free, False
    try:
        with quiet():  # a failed opset conversion logs a traceback there
            exporter = getattr(exporters, FORMATS[format_name].exporter)()
            return exporter.export(model, inputs, export_config(format_name, model.config, choices, opset))
    except Exception as error:  # the exporters' failures are many and long: keep the type and the first line
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ExportError(f"{FORMATS[format_name].exporter} failed: {type(error).__name__}: {first_line}") from error
    finally:
        model.config.padding_free = padding_free


def name_axes(program, choices: bool) -> None:
    """Give the ONNX graph's symbolic axes the names the export asked for (torch.export numbers them s0, s1, ...), in
    every value that carries them, so that the file says `[batch_size, sequence_length]`."""
    import onnx_ir

    names = {dim.value: name for dim, name in zip(program.graph.inputs[0].shape.dims, axes(choices))}
    values = [*program.graph.inputs, *program.graph.outputs, *(out for node in program.graph for out in node.outputs)]
    for value in values:
        if value.shape is not None and any(getattr(dim, "value", None) in names for dim in value.shape.dims):
            dims = [names.get(getattr(dim, "value", None), dim) for dim in value.shape.dims]
            value.shape = onnx_ir.Shape(dims)


def written_opset(exported) -> int:
    return exported.program.opset_imports[""]


def load_exported(folder: Path, precision: str | None = None):
    """The folder as users load it, running on this machine's CPU; an OpenVINO program compiled at `precision`
    (default: the precision its record states, float32 without a record), never at the CPU plugin's own choice."""
    from transformers.exporters import ExportedModel

    folder = Path(folder)
    options = {}
    if read_json_object(folder / "export.json", ExportError).get("export_format") == "openvino":
        options["config"] = runtime_config(precision or recorded_precision(folder))
    with quiet():
        return ExportedModel.from_pretrained(folder, device="cpu", **options)


def runtime_config(precision: str) -> dict:
    """OpenVINO's compile properties that pin `precision` (`ExportedModel.from_pretrained(..., config=...)`)."""
    return {PRECISION_HINT: precision}


def recorded_precision(folder: Path) -> str:
    record = folder / RECORD
    if not record.exists():
        return "f32"
    return read_json_object(record, ExportError).get("precision", {}).get("runs_at", "f32")


def compiled_precision(exported) -> str:
    """The precision OpenVINO actually compiled the program at (a CPU without bf16 runs f32 whatever it is asked)."""
    (runner,) = exported.runners.values()
    return runner.compiled_model.get_property(PRECISION_HINT).to_string()


def run_exported(exported, names, batch: dict) -> dict:
    outputs = exported(**batch)
    return {name: outputs[name] for name in names}


def run_torch(model, names, batch: dict) -> dict:
    with torch.no_grad():
        outputs = model(**batch, return_dict=True)
    return {name: outputs[name] for name in names}


def verification_batches(folder: Path, config, choices: bool) -> tuple[list[dict], str]:
    """The tokenizer's encoding of sentences and pairs (random ids without a tokenizer), with the graph's inputs."""
    batches = [graph_feeds(batch, config) for batch in sample_batches(folder, config, choices)]
    source = "tokenizer: sentences and sentence pairs" if len(batches) > 1 else "random ids"
    shapes = ", ".join("x".join(map(str, batch["input_ids"].shape)) for batch in batches)
    return batches, f"{source}, padded, shapes {shapes}"


def flat_mask(batch: dict) -> torch.Tensor:
    return batch["attention_mask"].reshape(-1, batch["attention_mask"].shape[-1]).bool()


def check_finite(name: str, expected: torch.Tensor, got: torch.Tensor, runtime: str) -> None:
    if not torch.isfinite(expected).all():
        raise ExportError(f"the PyTorch model itself gives non-finite {name} on the verification inputs")
    if not torch.isfinite(got).all():
        raise ExportError(f"the export gives non-finite {name} in {runtime} where PyTorch's are finite")


def check_parity(model, names, exported, runtime: str, batches: list[dict], inputs: str, precision="f32") -> dict:
    """max |PyTorch - the reloaded export| per output on the real tokens, and in bf16 the worst cosine of a decision
    (`decisions`) too; a failure (float32: above TOLERANCE; bf16: a cosine below MIN_BF16_COSINE) raises."""
    worst, worst_cosine = dict.fromkeys(names, 0.0), dict.fromkeys(names, 1.0)
    for batch in batches:
        mask = flat_mask(batch)
        expected, got = run_torch(model, names, batch), run_exported(exported, names, batch)
        for name in names:
            a, b = real_tokens(expected[name], mask), real_tokens(got[name].float(), mask)
            check_finite(name, a, b, runtime)
            worst[name] = max(worst[name], (a - b).abs().max().item() if a.numel() else 0.0)
            if precision != "f32":
                pairs = decisions(expected[name], mask), decisions(got[name].float(), mask)
                worst_cosine[name] = min(worst_cosine[name], cosines(*pairs).min().item())
    rows = [{"output": name, "max_abs_diff": worst[name]} for name in names]
    if precision == "f32":
        failures = [f"{name}: {value:.2e}" for name, value in worst.items() if value > TOLERANCE]
        bound = f"above {TOLERANCE:g}"
    else:
        rows = [{**row, "min_cosine": worst_cosine[row["output"]]} for row in rows]
        failures = [f"{name}: cosine {value:.5f}" for name, value in worst_cosine.items() if value < MIN_BF16_COSINE]
        bound = f"in {precision} below cosine {MIN_BF16_COSINE}"
    if failures:
        raise ExportError(f"the export differs from PyTorch in {runtime} {bound} on {'; '.join(failures)}")
    threshold = {"tolerance": TOLERANCE} if precision == "f32" else {"min_cosine": MIN_BF16_COSINE}
    return {"reference": runtime, "inputs": inputs, **threshold, "results": {runtime: rows}}


def mean_pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)


def decisions(tensor: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """One vector per decision a head makes: per real token (token heads), per sequence's real positions (span
    starts/ends), per row (sequence heads, multiple choice)."""
    if tensor.dim() == 3 and tuple(tensor.shape[:2]) == tuple(mask.shape):
        return list(tensor[mask])
    if tensor.dim() == 2 and tuple(tensor.shape) == tuple(mask.shape):
        return [row[keep] for row, keep in zip(tensor, mask)]
    return list(tensor.reshape(tensor.shape[0], -1))


def cosines(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([nn.functional.cosine_similarity(x.double(), y.double(), dim=0) for x, y in zip(a, b)])


def int8_agreement(fp32, int8, names, batches: list[dict], base: bool) -> list[dict]:
    """int8 against fp32 (both exported, in the same runtime): cosine of mean-pooled embeddings for the base model;
    cosine and argmax agreement of the logits for the heads."""
    rows = {}
    for batch in batches:
        mask, ours, theirs = flat_mask(batch), run_exported(fp32, names, batch), run_exported(int8, names, batch)
        if base:
            hidden_shape = (mask.shape[0], mask.shape[1], -1)
            pooled = [list(mean_pooled(out["last_hidden_state"].reshape(hidden_shape), mask)) for out in (ours, theirs)]
            rows.setdefault("mean-pooled last_hidden_state", []).append((cosines(*pooled), None))
            continue
        for name in names:
            a, b = decisions(ours[name], mask), decisions(theirs[name], mask)
            agree = torch.tensor([x.argmax() == y.argmax() for x, y in zip(a, b)], dtype=torch.float)
            rows.setdefault(name, []).append((cosines(a, b), agree))
    results = []
    for name, parts in rows.items():
        cosine = torch.cat([c for c, _ in parts])
        row = {"output": name, "min_cosine": cosine.min().item(), "mean_cosine": cosine.mean().item()}
        if parts[0][1] is not None:
            row["argmax_agreement"] = torch.cat([a for _, a in parts]).mean().item()
        results.append(row)
    return results


def graph_feeds(batch: dict, config) -> dict:
    """The graph's inputs from a tokenizer's batch: int64, token types 0 where the tokenizer gives none."""
    return {name: batch.get(name, torch.zeros_like(batch["input_ids"])).long() for name in graph_inputs(config)}


def calibration_batches(folder: Path, config, choices: bool) -> tuple[list[dict], str]:
    """The shipped sentiment sentences through the tokenizer, 16 a batch (random ids without a tokenizer), and what
    they are."""
    tokenizer = load_tokenizer(folder, config.vocab_size)
    if tokenizer is None:
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(1, config.vocab_size, (32, 16), generator=generator)
        batches, described = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], "random ids"
    else:
        with open(CALIBRATION_TEXT, newline="") as file:
            texts = [row["text"] for row in csv.DictReader(file)][:CALIBRATION_SENTENCES]
        batches = [
            dict(tokenizer(texts[i : i + 16], padding=True, return_tensors="pt", **fitting(config)))
            for i in range(0, len(texts), 16)
        ]
        described = f"{CALIBRATION_TEXT.name}: first {CALIBRATION_SENTENCES} sentences"
    batches = [graph_feeds(batch, config) for batch in batches]
    if choices:
        batches = [{name: value.view(-1, 2, value.shape[-1]) for name, value in batch.items()} for batch in batches]
    return batches, described


def normalized_matmuls(graph) -> dict[str, list]:
    """The MatMuls with a constant weight that read a normalization's output, by that output (Q, K, V, FFN up)."""
    weights = {tensor.name for tensor in graph.initializer}
    normalized = {name for node in graph.node if node.op_type in NORMALIZATIONS for name in node.output[:1]}
    readers = {}
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[0] in normalized and node.input[1] in weights:
            readers.setdefault(node.input[0], []).append(node)
    return readers


def activation_maxima(model, names: list[str], batches) -> dict:
    """max |x| per channel of each named tensor over the calibration feeds, run in ONNX Runtime."""
    import numpy as np
    import onnx
    import onnxruntime

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in names)
    session = onnxruntime.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    maxima = {}
    for feed in batches:
        for name, value in zip(names, session.run(names, feed)):
            value = np.abs(value.reshape(-1, value.shape[-1])).max(0)
            maxima[name] = np.maximum(maxima[name], value) if name in maxima else value
    return maxima


def smooth(model, batches) -> list[str]:
    """SmoothQuant on the MatMuls that read a normalization: x @ W becomes (x / s) @ (s W) per input channel, with
    s = max|x|^0.5 / max|W|^0.5, so that a few outlier channels of the normalized activations (max 28 against a
    median of 1.3 on all-MiniLM-L6-v2) no longer set the per-tensor int8 scale. Exact in float; `batches` are ONNX
    Runtime feeds; returns the names of the smoothed MatMuls."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    readers = normalized_matmuls(graph)
    if not readers:
        return []
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    maxima = activation_maxima(model, list(readers), batches)
    scales = {}
    for name, nodes in readers.items():
        weights = [numpy_helper.to_array(initializers[node.input[1]]) for node in nodes]
        weight_max = np.max([np.abs(weight).max(1) for weight in weights], axis=0)
        scale = (
            np.clip(maxima[name], 1e-5, None) ** SMOOTHING_ALPHA
            / np.clip(weight_max, 1e-5, None) ** (1 - SMOOTHING_ALPHA)
        ).astype(np.float32)
        for node, weight in zip(nodes, weights):
            initializers[node.input[1]].CopyFrom(numpy_helper.from_array(weight * scale[:, None], node.input[1]))
            node.input[0] = name + "_smoothed"
        graph.initializer.append(numpy_helper.from_array(1 / scale, name + "_smoothing"))
        scales[name] = helper.make_node("Mul", [name, name + "_smoothing"], [name + "_smoothed"], name=name + "_smooth")
    nodes = []
    for node in graph.node:  # each Mul right after the normalization it divides: the graph stays in order
        nodes += [node] + [scales[output] for output in node.output if output in scales]
    del graph.node[:]
    graph.node.extend(nodes)
    return [node.name for nodes in readers.values() for node in nodes]


def onnx_feeds(batches: list[dict]) -> list[dict]:
    return [{name: value.numpy() for name, value in batch.items()} for batch in batches]


def smoothquant_int8(program, calibration: list[dict]) -> tuple[object, int, str]:
    """SmoothQuant, then ONNX Runtime's dynamic int8 (through transformers' `OnnxRuntimeQuantizer`) of the smoothed
    MatMuls only: the attention output and FFN down projections stay float32. Per-channel 7-bit weights
    (`reduce_range`): at 8 bits the smoothed weights saturate the int16 pair sums of AVX2's u8 x s8 kernel. It won
    against the exporters' own quantizers (docs/benchmarks/int8-quantizers.txt). Returns the quantized program, how
    many MatMuls it quantized and how."""
    import onnx_ir
    from onnxruntime.quantization import QuantType
    from transformers.exporters import ExportFormat, OnnxRuntimeDynamicConfig, OnnxRuntimeQuantizer

    proto = onnx_ir.to_proto(program)
    smoothed = smooth(proto, onnx_feeds(calibration))
    config = OnnxRuntimeDynamicConfig(
        weight_type=QuantType.QInt8,
        per_channel=True,
        reduce_range=True,
        nodes_to_quantize=smoothed or None,
        op_types_to_quantize=["MatMul"],
    )
    with quiet():  # the quantizer logs its advice to pre-process (it changed nothing here)
        quantized = OnnxRuntimeQuantizer(config).quantize(onnx_ir.from_proto(proto), {}, ExportFormat.ONNX)
    if not smoothed:
        plain = "no MatMul reads a LayerNormalization (nothing to smooth): quantize_dynamic of every MatMul"
        return quantized, sum(node.op_type == "MatMulInteger" for node in quantized.graph), plain
    method = (
        "SmoothQuant (alpha 0.5) on the MatMuls that read a normalization, then ONNX Runtime's quantize_dynamic of "
        "those MatMuls (QInt8 per-channel 7-bit weights); attention output and FFN down projections stay float32"
    )
    return quantized, len(smoothed), method


def reads_a_layer_norm(matmul) -> bool:
    """Whether an OpenVINO MatMul's activation comes from a LayerNorm (MVN, then its scale and shift)."""
    source = matmul.input_value(0).get_node()
    for _ in range(3):
        if source.get_type_name() not in ("Add", "Multiply", "Convert"):
            break
        source = source.input_value(0).get_node()
    return source.get_type_name() == "MVN"


def nncf_int8(program, calibration: list[dict]) -> tuple[object, int, str]:
    """NNCF's post-training int8 (transformer preset, with its own SmoothQuant) of the MatMuls that read a LayerNorm
    only, the rule SmoothQuant follows for ONNX: on all-MiniLM-L6-v2 NNCF on every MatMul keeps a worst-sentence
    cosine of 0.962, on these 0.994 (docs/benchmarks/int8-quantizers.txt)."""
    import nncf
    from transformers.exporters import ExportFormat, NNCFOpenVINOQuantizer, NNCFQuantizationConfig

    matmuls = [op for op in program.get_ordered_ops() if op.get_type_name() == "MatMul"]
    others = [op.get_friendly_name() for op in matmuls if not reads_a_layer_norm(op)]
    method = (
        "NNCF post-training int8 (nncf.quantize, ModelType.TRANSFORMER) of the MatMuls that read a LayerNorm; "
        "attention output and FFN down projections stay float32"
    )
    if len(others) == len(matmuls):  # no LayerNorm (rmsnorm, dyt): every MatMul, as for ONNX
        others, method = [], "no MatMul reads a LayerNorm: NNCF post-training int8 of every MatMul"
    config = NNCFQuantizationConfig(ignored_scope=nncf.IgnoredScope(names=others) if others else None)
    with quiet():
        quantized = NNCFOpenVINOQuantizer(config, calibration).quantize(program, calibration[0], ExportFormat.OPENVINO)
    return quantized, len(matmuls) - len(others), method


INT8_METHODS = {"onnx": smoothquant_int8, "openvino": nncf_int8}


def saved_program(format_name: str, folder: Path):
    """The saved float32 program read again, weights in memory, for a quantizer to change."""
    from transformers.exporters import OnnxExporter, OpenVINOExporter

    if format_name == "openvino":
        return OpenVINOExporter.load_program(folder / "openvino_model.xml")
    import onnx_ir

    program = OnnxExporter.load_program(folder / "model.onnx")
    onnx_ir.external_data.load_to_model(program)
    program.meta.pop("path")  # the quantized program is saved elsewhere
    return program


def quantize_int8(format_name: str, exported, folder: Path, calibration: tuple[list[dict], str]) -> dict:
    """The int8 export in `folder/int8`, an ExportedModel folder of its own with the float32 export's metadata."""
    from transformers.exporters import ExportedComponent, ExportedModel

    batches, calibrated_on = calibration
    quantized, layers, method = INT8_METHODS[format_name](saved_program(format_name, folder), batches)
    (component,) = exported.components.values()
    int8 = ExportedModel(
        {"model": ExportedComponent(quantized, copy.deepcopy(component.metadata))},
        exported.export_format,
        config=exported.config,
    )
    with quiet():
        int8.save_pretrained(folder / INT8_FOLDER)
    return {"folder": INT8_FOLDER, "method": method, "calibration": calibrated_on, "quantized_layers": layers}


def check_int8(record: dict, fp32, int8, names, batches, inputs: str, base: bool, force: bool) -> dict:
    """int8 against float32 on the verification inputs; below MIN_INT8_COSINE the export fails unless `force`."""
    results = int8_agreement(fp32, int8, names, batches, base)
    worst = min(row["min_cosine"] for row in results)
    if worst < MIN_INT8_COSINE and not force:
        raise ExportError(
            f"int8 cosine similarity to fp32 is {worst:.4f} on the verification inputs ({inputs}), below "
            f"{MIN_INT8_COSINE}; pass --force (force=True) to keep {INT8_FOLDER}/ anyway"
        )
    accepted = worst >= MIN_INT8_COSINE
    return {
        **record,
        "inputs": inputs,
        "threshold": MIN_INT8_COSINE,
        "min_cosine": worst,
        "accepted": accepted,
        "results": results,
    }


def check_installed(format_name: str, quantize: str | None) -> None:
    needed = FORMATS[format_name].packages + (("nncf",) if format_name == "openvino" and quantize else ())
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        extra = FORMATS[format_name].extra
        raise ExportError(f"{format_name} export needs {', '.join(missing)}: pip install 'encoderstack[{extra}]'")


def runtime_version(format_name: str) -> str:
    runtime = FORMATS[format_name].runtime
    return f"{runtime} {importlib.metadata.version(runtime)}"


def check_arguments(format_name: str, opset, quantize, precision) -> None:
    if format_name not in FORMATS:
        raise ExportError(f"format {format_name!r} is not one of {', '.join(FORMATS)}")
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision != "f32" and format_name != "openvino":
        raise ExportError(f"precision {precision!r} is an OpenVINO setting; a {format_name} export runs in float32")
    if precision != "f32" and quantize is not None:
        raise ExportError("quantize='int8' is checked against float32: export it with precision 'f32'")
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ExportError(f"quantize={quantize!r} is not one of {', '.join(QUANTIZATIONS)}")
    if opset is not None and format_name != "onnx":
        raise ExportError(f"opset is an ONNX setting; a {format_name} export has none")
    if opset is not None and not (isinstance(opset, int) and not isinstance(opset, bool) and opset in OPSETS):
        raise ExportError(
            f"opset {opset!r} is not one torch.onnx {torch.__version__.split('+')[0]} can write here; "
            f"choose {OPSETS.start} to {OPSETS.stop - 1}"
        )


def export(
    model_or_folder,
    out,
    format: str = "onnx",
    task: str | None = None,
    opset: int | None = None,
    quantize: str | None = None,
    verify: bool = True,
    force: bool = False,
    precision: str = "f32",
) -> Path:
    """Export an EncoderStack model (an instance or a saved folder) to `out` with transformers' `OnnxExporter` or
    `OpenVINOExporter`; returns the output folder, which `transformers.exporters.ExportedModel.from_pretrained` loads.

    The graph is the padded path (padding-free execution stays a PyTorch feature), with int64 inputs `input_ids`,
    `attention_mask` and, where the model has more than one token type, `token_type_ids`; dynamic batch (and choices)
    and sequence axes, and the model's output fields.
    `task` picks the head to load from a folder (default: the folder's architecture). With `verify`, the saved folder
    is loaded back through `ExportedModel` and its outputs compared with PyTorch's on the tokenizer's encoding of
    sample sentences; a difference above 1e-4 fails the export. `quantize="int8"` adds `out/int8/` (ONNX: SmoothQuant,
    then ONNX Runtime's dynamic int8; OpenVINO: NNCF) and refuses it when its cosine similarity to float32 falls below
    0.99, unless `force`. `force` also replaces an existing `out`. On any failure nothing is written.

    `precision` ("f32" or "bf16", OpenVINO only) is the precision the export is verified and recorded at, and the one
    `load_exported` compiles it at: OpenVINO's CPU plugin picks bf16 by itself where the CPU has AVX-512 BF16 or
    AMX, so a plain `ExportedModel.from_pretrained(out)` runs there at bf16 unless given
    `config={"INFERENCE_PRECISION_HINT": "f32"}` (the record says so)."""
    check_arguments(format, opset, quantize, precision)
    check_installed(format, quantize)
    given_folder = isinstance(model_or_folder, (str, os.PathLike))
    output = OutputFolder(out, force, inputs=[model_or_folder] if given_folder else [])
    model, source, _, tokenizer = load_model(model_or_folder, task)
    choices = multiple_choice(model)
    inputs = example_inputs(model.config, choices)
    names = output_names(model, inputs)
    with output as folder:
        exported = export_program(model, inputs, format, choices, opset)
        if format == "onnx":
            name_axes(exported.program, choices)
        else:  # the graph's own record of its precision (which OpenVINO 2026.4's CPU plugin does not apply by itself)
            exported.program.set_rt_info(precision, ["runtime_options", PRECISION_HINT])
        with quiet():
            exported.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        record = {
            "encoderstack_version": __version__,
            "format": format,
            "source": source,
            "encoderstack_class": type(model).__name__,
            "norm_placement": model.config.norm_placement,
            "graph": "padded path (padding_free=False), float32",
            "inputs": {name: f"int64 [{', '.join(axes(choices))}]" for name in graph_inputs(model.config)},
            "outputs": names,
            "runtime": runtime_version(format),
        }
        if format == "openvino":
            record["precision"] = {
                "runs_at": precision,
                "load_with": f"ExportedModel.from_pretrained(folder, config={runtime_config(precision)!r})",
                "plain_load": "OpenVINO's CPU default: bf16 on CPUs with AVX-512 BF16 or AMX, f32 elsewhere",
            }
        if format == "onnx":
            record["opset"] = written_opset(exported)
            if opset is not None and record["opset"] != opset:  # the exporter falls back when it cannot convert
                raise ExportError(
                    f"torch.onnx could not write opset {opset} for this model (it wrote {record['opset']})"
                )
        if verify or quantize:
            batches, described = verification_batches(folder, model.config, choices)
            fp32 = load_exported(folder, precision)
        if verify:
            runtime = FORMATS[format].runtime
            record["parity"] = check_parity(model, names, fp32, runtime, batches, described, precision)
            if format == "openvino":
                record["precision"]["verified_at"] = compiled_precision(fp32)
        if quantize == "int8":
            made = quantize_int8(format, exported, folder, calibration_batches(folder, model.config, choices))
            int8 = load_exported(folder / INT8_FOLDER)
            base = isinstance(model, EncoderStackModel)
            record["quantization"] = check_int8(made, fp32, int8, names, batches, described, base, force)
        record["files"] = {
            str(path.relative_to(folder)): sha256(path)
            for path in sorted(folder.rglob("*"))
            if path.suffix in (".onnx", ".data", ".xml", ".bin")
        }
        (folder / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return output.path


def export_onnx(model_or_folder, out, task=None, opset=None, quantize=None, verify=True, force=False) -> Path:
    """`export(..., format="onnx")`: `out/model.onnx`, run by ONNX Runtime."""
    return export(model_or_folder, out, "onnx", task, opset, quantize, verify, force)


def export_openvino(model_or_folder, out, task=None, quantize=None, verify=True, force=False, precision="f32") -> Path:
    """`export(..., format="openvino")`: `out/openvino_model.xml` and `.bin`, run by OpenVINO at `precision`."""
    return export(model_or_folder, out, "openvino", task, None, quantize, verify, force, precision)
