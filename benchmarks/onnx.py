"""ONNX Runtime throughput: real tokens per second of the exported model (float32 and int8) against our PyTorch padded
and padding-free paths, as ratios to BertModel with SDPA, same process, interleaved rounds.

    python benchmarks/onnx.py                 # minilm, 32x128 and 8x512
    python benchmarks/onnx.py --quick         # minilm, 32x128, 3 rounds

The export runs in a child process (`encoderstack export-onnx --quantize int8 --force`): a module that
torch.onnx.export has traced runs ~3x slower afterwards, and nothing timed here should carry that.
"""

import subprocess
import sys
from pathlib import Path

import common
from common import encoderstack, transformers

sys.path.remove(str(Path(__file__).resolve().parent))  # this file is named onnx.py: let `import onnx` find the library

import onnxruntime  # noqa: E402
import torch  # noqa: E402

VARIANTS = ("EncoderStack padded", "EncoderStack padding-free", "ORT fp32", "ORT int8")


def export(ours, tokenizer, scratch: Path) -> Path:
    ours.save_pretrained(scratch / "encoderstack")
    if len(tokenizer) <= ours.config.vocab_size:  # the parity and int8 checks then run on real text
        tokenizer.save_pretrained(scratch / "encoderstack")
    command = [
        sys.executable,
        "-m",
        "encoderstack",
        "export-onnx",
        str(scratch / "encoderstack"),
        str(scratch / "onnx"),
        "--quantize",
        "int8",
        "--force",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"export failed: {result.stderr.strip()}")
    summary = [line for line in result.stdout.splitlines() if "parity" in line or "int8" in line or "cosine" in line]
    print("\n".join(summary))
    return scratch / "onnx"


def session(path: Path, threads: int):
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main():
    parser = common.common_arguments(__doc__.splitlines()[0], sizes="32x128,8x512", models="minilm")
    args = parser.parse_args()
    if args.quick:
        args.models, args.sizes = "minilm", args.sizes.split(",")[0]
    if args.device != "cpu":
        raise SystemExit("ONNX Runtime runs on the CPU here (onnxruntime's CPU build)")
    iterations = args.iterations or (3 if args.quick else 5)
    common.setup(args)
    common.header("ONNX Runtime inference", args.device)
    print(f"onnxruntime {onnxruntime.__version__}, {torch.get_num_threads()} intra-op threads for both")
    tokenizer = common.tokenizer()
    rows = []
    for spec in common.parse_models(args.models):
        with common.scratch_folder() as scratch:
            bert, ours = common.load_pair(spec, transformers.BertModel, encoderstack.EncoderStackModel, scratch)
            onnx_folder = export(ours, tokenizer, Path(scratch))
            fp32, int8 = (
                session(onnx_folder / name, torch.get_num_threads()) for name in ("model.onnx", "model_quantized.onnx")
            )
        bert, ours = common.with_backend(bert, "sdpa"), common.with_backend(ours, "sdpa")
        for batch_size, max_length in common.parse_sizes(args.sizes):
            for workload in common.WORKLOADS:
                lengths, width, batch, _ = common.workload_batch(
                    workload, batch_size, max_length, bert.config.vocab_size, tokenizer, args.seed, "cpu"
                )
                batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
                feeds = {name: value.numpy() for name, value in batch.items()}
                variants = {
                    "BertModel-sdpa": lambda: bert(**batch),
                    "EncoderStack padded": lambda: ours(**batch, padding_free=False),
                    "EncoderStack padding-free": lambda: ours(**batch, padding_free=True),
                    "ORT fp32": lambda: fp32.run(None, feeds),
                    "ORT int8": lambda: int8.run(None, feeds),
                }
                with torch.inference_mode():
                    seconds, _ = common.interleave(variants, iterations, "cpu", peak_size=64)
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
    print(f"{iterations} interleaved rounds per cell, medians; cells: speed-up over BertModel-sdpa in real tokens/s")
    common.print_table(rows, ["model", "batch", "lengths", "real", "BertModel-sdpa tok/s", *VARIANTS])
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()
