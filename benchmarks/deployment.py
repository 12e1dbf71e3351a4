"""CPU inference paths: real tokens per second of ONNX Runtime (float32, int8), OpenVINO (float32, bf16, int8),
BertModel in bfloat16 and EncoderStack in float32 (torch's kernels, oneDNN's, and oneDNN's with prepacked weights) and
bfloat16 (attention fused by oneDNN Graph, and in SDPA; plain and prepacked weights), as ratios to BertModel-SDPA
float32, same process, interleaved.
OpenVINO's precision is pinned per column (`INFERENCE_PRECISION_HINT`): its CPU plugin would otherwise pick bf16 by
itself on CPUs with AVX-512 BF16 or AMX.

    python benchmarks/deployment.py --threads 2                 # minilm, 32x128 and 8x512, full and uniform lengths
    python benchmarks/deployment.py --quick                     # minilm, 32x128, 3 rounds

The exports run in child processes (`encoderstack export-onnx` / `export-openvino --quantize int8 --force`): a module
that torch.export has traced runs ~3x slower afterwards, and nothing timed here should carry that. ONNX Runtime and
OpenVINO get as many threads as torch, and run as users run them, through `ExportedModel.from_pretrained`.
"""

import copy
import statistics
import subprocess
import sys
from pathlib import Path

import common
import torch
from common import encoderstack, transformers

VARIANTS = (
    "ORT fp32",
    "ORT int8",
    "OpenVINO fp32",
    "OpenVINO bf16",
    "OpenVINO int8",
    "BertModel bf16",
    "EncoderStack fp32",
    "EncoderStack fp32 oneDNN",
    "EncoderStack fp32 prepacked",
    "EncoderStack bf16 SDPA",
    "EncoderStack bf16",
    "EncoderStack bf16 prepacked",
)
WORKLOADS = ("full", "uniform")
LIMIT_SIZE = 2048  # the side of the square GEMMs that measure the limit (one per library and precision, each cell)
OF_LIMIT = {  # columns of achieved FLOP/s on real tokens / the best GEMM in that precision
    "EncoderStack fp32": torch.float32,
    "EncoderStack fp32 oneDNN": torch.float32,
    "EncoderStack fp32 prepacked": torch.float32,
    "OpenVINO fp32": torch.float32,
    "EncoderStack bf16": torch.bfloat16,
    "EncoderStack bf16 prepacked": torch.bfloat16,
    "OpenVINO bf16": torch.bfloat16,
}


def export(folder: Path, format_name: str) -> Path:
    out = folder / format_name
    command = [sys.executable, "-m", "encoderstack", f"export-{format_name}", str(folder / "encoderstack"), str(out)]
    result = subprocess.run([*command, "--quantize", "int8", "--force"], capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"export failed: {result.stderr.strip()}")
    print("\n".join(line for line in result.stdout.splitlines() if "OK" in line or "cosine" in line))
    return out


def runtimes(folder: Path, threads: int) -> dict:
    """The exports, loaded as users load them (OpenVINO's precision pinned), each with `threads` intra-op threads."""
    import onnxruntime
    from transformers.exporters import ExportedModel

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    onnx, openvino = export(folder, "onnx"), export(folder, "openvino")

    def ov_config(precision):
        return {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": precision}

    return {
        "ORT fp32": ExportedModel.from_pretrained(onnx, device="cpu", session_options=options),
        "ORT int8": ExportedModel.from_pretrained(onnx / "int8", device="cpu", session_options=options),
        "OpenVINO fp32": ExportedModel.from_pretrained(openvino, device="cpu", config=ov_config("f32")),
        "OpenVINO bf16": ExportedModel.from_pretrained(openvino, device="cpu", config=ov_config("bf16")),
        "OpenVINO int8": ExportedModel.from_pretrained(openvino / "int8", device="cpu", config=ov_config("f32")),
    }


def sdpa_in_bf16(model, batch):
    """The bf16 forward with attention in torch's SDPA kernel, as before `gemm_attention` and `fused_attention`."""
    with common.cpu_attention("SDPA"):
        return model(**batch)


def main():
    parser = common.common_arguments(__doc__.splitlines()[0], sizes="32x128,8x512", models="minilm")
    args = parser.parse_args()
    if args.quick:
        args.models, args.sizes = "minilm", args.sizes.split(",")[0]
    if args.device != "cpu" or args.dtype != "float32":
        raise SystemExit("this benchmark compares CPU paths and their dtypes itself: no --device or --dtype")
    iterations = args.iterations or (3 if args.quick else 5)
    common.setup(args)
    common.header("CPU inference paths", args.device)
    # without AVX-512 BF16 or AMX, oneDNN has no bf16 matmul kernel and torch's fallback is several times slower
    print(f"oneDNN bf16 kernels on this CPU: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    tokenizer = common.tokenizer()
    rows, achieved, limits = [], [], {}  # achieved: FLOP/s per row; limits: dtype -> library -> GEMM FLOP/s

    def best(rates):  # the fastest library's median
        return max(statistics.median(values) for values in rates.values())

    for spec in common.parse_models(args.models):
        with common.scratch_folder() as scratch:
            bert, ours = common.load_pair(spec, transformers.BertModel, encoderstack.EncoderStackModel, scratch)
            ours.save_pretrained(Path(scratch) / "encoderstack")
            if len(tokenizer) <= ours.config.vocab_size:  # the parity and int8 checks then run on real text
                tokenizer.save_pretrained(Path(scratch) / "encoderstack")
            exported = runtimes(Path(scratch), torch.get_num_threads())
            bert, ours = common.with_backend(bert, "sdpa"), common.with_backend(ours, "sdpa")
        bert_bf16, ours_bf16 = (copy.deepcopy(model).to(torch.bfloat16) for model in (bert, ours))
        ours_onednn, ours_prepacked, ours_bf16_prepacked = (copy.deepcopy(m) for m in (ours, ours, ours_bf16))
        ours_onednn.set_cpu_kernels("onednn")
        ours_prepacked.set_cpu_kernels("onednn-prepacked")
        ours_bf16_prepacked.set_cpu_kernels("onednn-prepacked")
        for batch_size, max_length in common.parse_sizes(args.sizes):
            for workload in WORKLOADS:
                lengths, width, batch, _ = common.workload_batch(
                    workload, batch_size, max_length, bert.config.vocab_size, tokenizer, args.seed, "cpu"
                )
                batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
                variants = {
                    "BertModel-sdpa": lambda: bert(**batch),
                    "BertModel bf16": lambda: bert_bf16(**batch),
                    "EncoderStack fp32": lambda: ours(**batch),
                    "EncoderStack fp32 oneDNN": lambda: ours_onednn(**batch),
                    "EncoderStack fp32 prepacked": lambda: ours_prepacked(**batch),
                    "EncoderStack bf16 SDPA": lambda: sdpa_in_bf16(ours_bf16, batch),
                    "EncoderStack bf16": lambda: ours_bf16(**batch),
                    "EncoderStack bf16 prepacked": lambda: ours_bf16_prepacked(**batch),
                    **{name: (lambda m=model: m(**batch)) for name, model in exported.items()},
                }
                with torch.inference_mode():
                    seconds, _ = common.interleave(variants, iterations, "cpu", peak_size=64)
                    for dtype in (torch.float32, torch.bfloat16):
                        for library, rate in common.gemm_rates("cpu", LIMIT_SIZE, dtype).items():
                            limits.setdefault(dtype, {}).setdefault(library, []).append(rate)
                flops = common.encoder_flops(bert.config, lengths)
                reference = seconds["BertModel-sdpa"]
                rows.append(
                    [
                        common.model_name(spec),
                        f"{batch_size}x{width}",
                        workload,
                        f"{sum(lengths) / (batch_size * width):.0%}",
                        common.format_rate(sum(lengths) / reference),
                        *(f"{reference / seconds[name]:.2f}" for name in VARIANTS),
                    ]
                )
                achieved.append({name: flops / seconds[name] for name in OF_LIMIT})
    print(
        f"{iterations} interleaved rounds per cell, medians; cells: speed-up over BertModel-sdpa float32 in real "
        "tokens/s"
    )
    for dtype, rates in limits.items():
        each = ", ".join(f"{library} {statistics.median(values) / 1e9:.0f}" for library, values in rates.items())
        print(f"limit in {str(dtype).removeprefix('torch.')}: the best {LIMIT_SIZE}^2 GEMM ({each} GFLOP/s, medians)")
    print("'% limit' columns: achieved FLOP/s on the real tokens / the run's limit in that column's precision")
    for row, rate in zip(rows, achieved):
        row.extend(f"{rate[name] / best(limits[dtype]):.0%}" for name, dtype in OF_LIMIT.items())
    limit_columns = [f"{name} % limit" for name in OF_LIMIT]
    common.print_table(rows, ["model", "batch", "lengths", "real", "BertModel-sdpa tok/s", *VARIANTS, *limit_columns])
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()
