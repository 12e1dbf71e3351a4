"""EncoderStack -> ONNX: the padded path traced by torch.onnx (dynamo), checked in ONNX Runtime, optionally int8.

The output folder is laid out as optimum writes one (`model.onnx`, `config.json`, the tokenizer files, and
`model_quantized.onnx` for int8), plus `export.json`, the record of what was exported and how well it matched.
Nothing appears until the whole folder is written and checked.
"""

import contextlib
import copy
import csv
import importlib.metadata
import importlib.util
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
from .conversion.keymap import TASKS, ConversionError
from .conversion.sources import require_hf_weights
from .conversion.verify import OUTPUTS, sample_batches
from .finetune import DATA
from .jsonfile import read_json_object
from .modeling_encoderstack import EncoderStackForMultipleChoice, EncoderStackModel, EncoderStackPreTrainedModel
from .output_folder import OutputFolder
from .parity import real_tokens
from .version import __version__

TOLERANCE = 1e-4
MIN_INT8_COSINE = 0.99
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
EXTERNAL_DATA_OVER = 2 * 1024**3  # protobuf's limit on one file
QUANTIZATIONS = ("int8",)
# torch.onnx writes opset 18 and converts it with onnxscript's version converter, which supports 18 to 25 (onnxscript
# 0.7); below 18 it falls back to ONNX's converter, which cannot lower RMSNormalization, and writes 18 after all.
OPSETS = range(18, 26)
POOLER = {"pooler.dense.weight", "pooler.dense.bias"}
NORMALIZATIONS = ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization")
SMOOTHING_ALPHA = 0.5
CALIBRATION_TEXT = DATA / "train.csv"  # shipped sentences, none of them the verification text
CALIBRATION_SENTENCES = 160


class ExportError(ValueError):
    """A model that cannot be exported as asked, or an export that failed its checks; the message says which."""


class PaddedGraph(nn.Module):
    """What the ONNX graph records: the model's padded path, three positional inputs, a flat tuple of outputs."""

    def __init__(self, model: EncoderStackPreTrainedModel, output_names: list[str]):
        super().__init__()
        self.model = model
        self.output_names = output_names

    def forward(self, input_ids, attention_mask, token_type_ids):
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            padding_free=False,
            return_dict=True,
        )
        return tuple(outputs[name] for name in self.output_names)


@contextlib.contextmanager
def quiet(logger_name: str | None):
    """Silence a library's logger and warnings for the duration (the exporter's notes, the quantizer's advice)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
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
        # a module that torch.onnx.export traced runs ~3x slower afterwards: keep the caller's own model untouched
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
    if task is not None and task not in TASKS:
        raise ExportError(f"task {task!r} is not one of {', '.join(sorted(TASKS))}")
    class_name = TASKS[task].encoderstack_class if task else (config.get("architectures") or ["EncoderStackModel"])[0]
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


def example_inputs(config, choices: bool) -> dict:
    """What the export traces: a shape that no verification batch has (3 x 8, or 3 x 3 choices x 8), padded."""
    generator = torch.Generator().manual_seed(0)
    shape = (3, 3, 8) if choices else (3, 8)
    mask = torch.ones(shape, dtype=torch.long)
    mask[1, ..., 5:] = 0
    ids = torch.randint(1, config.vocab_size, shape, generator=generator) * mask
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


def output_names(model, inputs) -> list[str]:
    with torch.no_grad():
        outputs = model(**inputs, padding_free=False, return_dict=True)
    return [name for name in outputs if name in OUTPUTS]


def export_graph(graph: PaddedGraph, inputs: dict, choices: bool, path: Path, opset: int | None) -> int:
    """Trace and save; returns the opset of the saved file. Weights go to `model.onnx_data` beside it over 2 GB."""
    dims = [torch.export.Dim(axis) for axis in axes(choices)]
    dynamic = {name: dict(enumerate(dims)) for name in INPUTS}
    try:
        with quiet("torch.onnx"), quiet("onnxscript"):  # a failed opset conversion logs a traceback there
            program = torch.onnx.export(
                graph,
                tuple(inputs[name] for name in INPUTS),
                dynamo=True,
                dynamic_shapes=dynamic,
                input_names=list(INPUTS),
                output_names=graph.output_names,
                opset_version=opset,
                verbose=False,
            )
    except Exception as error:  # the exporter's failures are many and long: keep the type and the first line
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ExportError(f"torch.onnx.export failed: {type(error).__name__}: {first_line}") from error
    written = program.model.opset_imports[""]
    if opset is not None and written != opset:  # the exporter falls back to its own opset when it cannot convert
        raise ExportError(f"torch.onnx could not write opset {opset} for this model (it wrote {written})")
    import onnx_ir

    big = (
        sum(
            value.const_value.nbytes
            for value in program.model.graph.initializers.values()
            if value.const_value is not None
        )
        > EXTERNAL_DATA_OVER
    )
    onnx_ir.save(program.model, path, external_data=path.name + "_data" if big else None)
    return written


def onnx_session(path: Path):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_onnx(session, batch: dict) -> dict:
    values = session.run(None, {name: batch[name].numpy() for name in INPUTS})
    return {output.name: torch.from_numpy(value) for output, value in zip(session.get_outputs(), values)}


def run_torch(model, names, batch: dict) -> dict:
    with torch.no_grad():
        outputs = model(**batch, padding_free=False, return_dict=True)
    return {name: outputs[name] for name in names}


def verification_batches(folder: Path, config, choices: bool) -> tuple[list[dict], str]:
    """The tokenizer's encoding of sentences and pairs (random ids without a tokenizer), with all three inputs."""
    batches = sample_batches(folder, config, choices)
    for batch in batches:
        batch.setdefault("token_type_ids", torch.zeros_like(batch["input_ids"]))
    batches = [{name: batch[name].long() for name in INPUTS} for batch in batches]
    source = "tokenizer: sentences and sentence pairs" if len(batches) > 1 else "random ids"
    shapes = ", ".join("x".join(map(str, batch["input_ids"].shape)) for batch in batches)
    return batches, f"{source}, padded, shapes {shapes}"


def flat_mask(batch: dict) -> torch.Tensor:
    return batch["attention_mask"].reshape(-1, batch["attention_mask"].shape[-1]).bool()


def check_finite(name: str, expected: torch.Tensor, got: torch.Tensor, path: Path) -> None:
    if not torch.isfinite(expected).all():
        raise ExportError(f"the PyTorch model itself gives non-finite {name} on the verification inputs")
    if not torch.isfinite(got).all():
        raise ExportError(f"{path.name} gives non-finite {name} in ONNX Runtime where PyTorch's are finite")


def check_parity(model, names, session, path: Path, batches: list[dict], inputs: str) -> dict:
    """max |PyTorch - ONNX Runtime| per output on the real tokens; a failure above TOLERANCE raises."""
    worst = dict.fromkeys(names, 0.0)
    for batch in batches:
        mask = flat_mask(batch)
        expected, got = run_torch(model, names, batch), run_onnx(session, batch)
        for name in names:
            a, b = real_tokens(expected[name], mask), real_tokens(got[name], mask)
            check_finite(name, a, b, path)
            worst[name] = max(worst[name], (a - b).abs().max().item() if a.numel() else 0.0)
    parity = {
        "reference": "ONNX Runtime",
        "inputs": inputs,
        "tolerance": TOLERANCE,
        "results": {"onnxruntime": [{"output": name, "max_abs_diff": value} for name, value in worst.items()]},
    }
    failures = [f"{name}: {value:.2e}" for name, value in worst.items() if value > TOLERANCE]
    if failures:
        raise ExportError(f"{path.name} differs from PyTorch above {TOLERANCE:g} on {'; '.join(failures)}")
    return parity


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
    """int8 against fp32 (both in ONNX Runtime): cosine of mean-pooled embeddings for the base model; cosine and
    argmax agreement of the logits for the heads."""
    rows = {}
    for batch in batches:
        mask, ours, theirs = flat_mask(batch), run_onnx(fp32, batch), run_onnx(int8, batch)
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


def calibration_batches(folder: Path, config, choices: bool) -> list[dict]:
    """The shipped sentiment sentences through the tokenizer, 16 a batch; random ids without a tokenizer."""
    tokenizer = load_tokenizer(folder, config.vocab_size)
    if tokenizer is None:
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(1, config.vocab_size, (32, 16), generator=generator)
        batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    else:
        with open(CALIBRATION_TEXT, newline="") as file:
            texts = [row["text"] for row in csv.DictReader(file)][:CALIBRATION_SENTENCES]
        batches = [
            dict(tokenizer(texts[i : i + 16], padding=True, return_tensors="pt")) for i in range(0, len(texts), 16)
        ]
    batches = [
        {name: batch.get(name, torch.zeros_like(batch["input_ids"])).long() for name in INPUTS} for batch in batches
    ]
    if choices:
        batches = [{name: value.view(-1, 2, value.shape[-1]) for name, value in batch.items()} for batch in batches]
    return batches


def normalized_matmuls(graph) -> dict[str, list]:
    """The MatMuls with a constant weight that read a normalization's output, by that output (Q, K, V, FFN up)."""
    weights = {tensor.name for tensor in graph.initializer}
    normalized = {name for node in graph.node if node.op_type in NORMALIZATIONS for name in node.output[:1]}
    readers = {}
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[0] in normalized and node.input[1] in weights:
            readers.setdefault(node.input[0], []).append(node)
    return readers


def activation_maxima(model, names: list[str], batches: list[dict]) -> dict:
    """max |x| per channel of each named tensor over the calibration batches, run in ONNX Runtime."""
    import numpy as np
    import onnx
    import onnxruntime

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in names)
    session = onnxruntime.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    maxima = {}
    for batch in batches:
        values = session.run(names, {name: batch[name].numpy() for name in INPUTS})
        for name, value in zip(names, values):
            value = np.abs(value.reshape(-1, value.shape[-1])).max(0)
            maxima[name] = np.maximum(maxima[name], value) if name in maxima else value
    return maxima


def smooth(model, batches: list[dict]) -> list[str]:
    """SmoothQuant on the MatMuls that read a normalization: x @ W becomes (x / s) @ (s W) per input channel, with
    s = max|x|^0.5 / max|W|^0.5, so that a few outlier channels of the normalized activations (max 28 against a
    median of 1.3 on all-MiniLM-L6-v2) no longer set the per-tensor int8 scale. Exact in float; returns the names of
    the smoothed MatMuls."""
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


def quantize_int8(
    folder: Path, session, names, batches: list[dict], inputs: str, base: bool, force: bool, calibration: list[dict]
) -> dict:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    target = folder / "model_quantized.onnx"
    big = (folder / "model.onnx_data").exists()
    model = onnx.load(folder / "model.onnx")
    quantized = smooth(model, calibration)
    smoothed = folder / "model_smoothed.onnx"
    onnx.save(model, smoothed, save_as_external_data=big, location=smoothed.name + "_data")
    try:
        with quiet(None):  # the quantizer logs its advice to pre-process (it changed nothing here) on the root logger
            # reduce_range (7-bit weights): the smoothed weights saturate AVX2's u8 x s8 int16 pair sums at 8 bits
            quantize_dynamic(
                smoothed,
                target,
                weight_type=QuantType.QInt8,
                per_channel=True,
                reduce_range=True,
                nodes_to_quantize=quantized or None,
                op_types_to_quantize=["MatMul"],
                use_external_data_format=big,
            )
    finally:
        for path in (smoothed, folder / (smoothed.name + "_data")):
            path.unlink(missing_ok=True)
    results = int8_agreement(session, onnx_session(target), names, batches, base)
    worst = min(row["min_cosine"] for row in results)
    if worst < MIN_INT8_COSINE and not force:
        raise ExportError(
            f"int8 cosine similarity to fp32 is {worst:.4f} on the verification inputs ({inputs}), below "
            f"{MIN_INT8_COSINE}; pass --force (force=True) to keep model_quantized.onnx anyway"
        )
    method = (
        "SmoothQuant (alpha 0.5) on the MatMuls that read a normalization, then quantize_dynamic of those "
        "MatMuls; attention output and FFN down projections stay float32"
        if quantized
        else "no MatMul reads a LayerNormalization (nothing to smooth): quantize_dynamic of every MatMul"
    )
    return {
        "file": target.name,
        "method": f"{method}; onnxruntime QInt8 per-channel 7-bit weights",
        "calibration": f"{CALIBRATION_TEXT.name}: first {CALIBRATION_SENTENCES} sentences"
        if len(calibration) > 1
        else "random ids",
        "quantized_matmuls": len(quantized),
        "inputs": inputs,
        "threshold": MIN_INT8_COSINE,
        "min_cosine": worst,
        "accepted": worst >= MIN_INT8_COSINE,
        "results": results,
    }


def versions() -> dict:
    return {
        name: importlib.metadata.version(name)
        for name in ("torch", "transformers", "onnx", "onnxscript", "onnxruntime")
    }


def check_installed() -> None:
    missing = [name for name in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"ONNX export needs {', '.join(missing)}: pip install 'encoderstack[onnx]'")


def write_folder(folder: Path, model, tokenizer) -> None:
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def export_onnx(
    model_or_folder,
    out,
    task: str | None = None,
    opset: int | None = None,
    quantize: str | None = None,
    verify: bool = True,
    force: bool = False,
) -> Path:
    """Export an EncoderStack model (an instance or a saved folder) to `out`/model.onnx; returns the output folder.

    The graph is the padded path (padding-free execution stays a PyTorch feature), with int64 inputs `input_ids`,
    `attention_mask`, `token_type_ids`, dynamic batch (and choices) and sequence axes, and outputs named as the
    model's output fields. `task` picks the head to load from a folder (default: the folder's architecture). With
    `verify`, ONNX Runtime's outputs are compared with PyTorch's on the tokenizer's encoding of sample sentences, and
    a difference above 1e-4 fails the export. `quantize="int8"` adds `model_quantized.onnx` (SmoothQuant, then dynamic
    quantization of the MatMuls that read a normalization) and refuses it when its cosine similarity to float32
    falls below 0.99, unless `force`. `force` also replaces an existing `out`. On any failure nothing is written."""
    check_installed()
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ExportError(f"quantize={quantize!r} is not one of {', '.join(QUANTIZATIONS)}")
    if opset is not None and not (isinstance(opset, int) and not isinstance(opset, bool) and opset in OPSETS):
        raise ExportError(
            f"opset {opset!r} is not one torch.onnx {torch.__version__.split('+')[0]} can write here; "
            f"choose {OPSETS.start} to {OPSETS.stop - 1}"
        )
    given_folder = isinstance(model_or_folder, (str, os.PathLike))
    output = OutputFolder(out, force, inputs=[model_or_folder] if given_folder else [])
    model, source, _, tokenizer = load_model(model_or_folder, task)
    choices = multiple_choice(model)
    inputs = example_inputs(model.config, choices)
    names = output_names(model, inputs)
    with output as folder:
        path = folder / "model.onnx"
        opset_used = export_graph(PaddedGraph(model, names).eval(), inputs, choices, path, opset)
        write_folder(folder, model, tokenizer)
        report = {
            "encoderstack_version": __version__,
            "source": source,
            "encoderstack_class": type(model).__name__,
            "norm_placement": model.config.norm_placement,
            "graph": "padded path (padding_free=False), float32",
            "opset": opset_used,
            "inputs": {name: f"int64 [{', '.join(axes(choices))}]" for name in INPUTS},
            "outputs": names,
            "versions": versions(),
        }
        if verify or quantize:
            batches, described = verification_batches(folder, model.config, choices)
            session = onnx_session(path)
        if verify:
            report["parity"] = check_parity(model, names, session, path, batches, described)
        if quantize == "int8":
            report["quantization"] = quantize_int8(
                folder,
                session,
                names,
                batches,
                described,
                isinstance(model, EncoderStackModel),
                force,
                calibration_batches(folder, model.config, choices),
            )
        report["files"] = {file.name: sha256(file) for file in sorted(folder.iterdir()) if ".onnx" in file.name}
        report["sha256"] = report["files"]["model.onnx"]
        (folder / "export.json").write_text(json.dumps(report, indent=2) + "\n")
    return output.path
