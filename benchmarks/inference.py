"""Inference throughput: real tokens per second of BERT and EncoderStack on the same weights, as ratios to BertModel
with SDPA, on full and mixed-length batches; plus achieved FLOP/s as a fraction of this machine's matmul peak.

    python benchmarks/inference.py                     # minilm and bert-base, 32x128 and 8x512 (about 15 minutes)
    python benchmarks/inference.py --quick             # minilm, 32x128, 3 rounds
    python benchmarks/inference.py --compile           # adds torch.compile (which runs the padded path)
"""

import copy

import common
import torch
from common import encoderstack, transformers

VARIANTS = ("BertModel-eager", "EncoderStack padded", "EncoderStack padding-free")


def main():
    parser = common.common_arguments(__doc__.splitlines()[0], sizes="32x128,8x512", models="minilm,bert-base")
    parser.add_argument("--peak-size", type=int, default=4096, help="side of the square matmul that measures peak")
    parser.add_argument("--compile", action="store_true", help="add EncoderStack under torch.compile")
    args = parser.parse_args()
    if args.quick:
        args.models, args.sizes = "minilm", args.sizes.split(",")[0]
    iterations = args.iterations or (3 if args.quick else 5)
    common.setup(args)
    flash = common.flash_attention_backends(args.device)
    variants = (
        VARIANTS
        + (("EncoderStack compiled",) if args.compile else ())
        + tuple(name for backend in flash for name in (f"BertModel-{backend}", f"EncoderStack {backend}"))
    )
    common.header("inference", args.device)
    tokenizer = common.tokenizer()
    rows = []
    for spec in common.parse_models(args.models):
        with common.scratch_folder() as folder:
            bert, ours = common.load_pair(spec, transformers.BertModel, encoderstack.EncoderStackModel, folder)
        bert = common.place(common.with_backend(bert, "sdpa"), args.device)
        bert_eager = common.with_backend(copy.deepcopy(bert), "eager")
        ours = common.place(common.with_backend(ours, "sdpa"), args.device)
        models = {
            "BertModel-sdpa": lambda batch: bert(**batch),
            "BertModel-eager": lambda batch: bert_eager(**batch),
            "EncoderStack padded": lambda batch: ours(**batch, padding_free=False),
            "EncoderStack padding-free": lambda batch: ours(**batch),
        }
        for backend in flash:
            models[f"BertModel-{backend}"] = lambda batch, m=common.with_backend(copy.deepcopy(bert), backend): m(
                **batch
            )
            models[f"EncoderStack {backend}"] = lambda batch, m=common.with_backend(copy.deepcopy(ours), backend): m(
                **batch
            )
        if args.compile:
            models["EncoderStack compiled"] = lambda batch, compiled=torch.compile(ours): compiled(**batch)
        for batch_size, max_length in common.parse_sizes(args.sizes):
            for workload in common.WORKLOADS:
                lengths, width, batch, _ = common.workload_batch(
                    workload, batch_size, max_length, bert.config.vocab_size, tokenizer, args.seed, args.device
                )
                with torch.inference_mode():
                    seconds, peak = common.interleave(
                        {name: (lambda f=f: f(batch)) for name, f in models.items()},
                        iterations,
                        args.device,
                        args.peak_size,
                    )
                flops = common.encoder_flops(bert.config, lengths)
                reference = seconds["BertModel-sdpa"]
                ideal = batch_size * width / sum(lengths)
                cells = [f"{reference / seconds[name]:.2f} ({flops / seconds[name] / peak:.0%})" for name in variants]
                rows.append(
                    [
                        common.model_name(spec),
                        f"{batch_size}x{width}",
                        workload,
                        f"{sum(lengths) / (batch_size * width):.0%}",
                        f"{common.format_rate(sum(lengths) / reference)} ({flops / reference / peak:.0%})",
                        *cells,
                        f"{ideal:.2f}",
                        f"{reference / seconds['EncoderStack padding-free'] / ideal:.0%}",
                    ]
                )
    print(f"{common.peak_line(args.peak_size)}; {iterations} interleaved rounds per cell, medians")
    print("cells: speed-up over BertModel-sdpa in real tokens/s (achieved FLOP/s on real tokens / matmul peak)")
    common.print_table(
        rows, ["model", "batch", "lengths", "real", "BertModel-sdpa tok/s", *variants, "ideal", "padding-free/ideal"]
    )
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()
