"""bf16 attention on the CPU: EncoderStack with `gemm_attention` (the plan's kernel where the CPU has native bf16
GEMMs) against the same model with torch's SDPA kernel (`execution_encoderstack.BF16_GEMMS = False`), same process,
interleaved: an inference forward in bf16 weights, and a training step (forward, backward, AdamW) of masked LM and
sequence classification in float32 weights under bf16 autocast (`Trainer(bf16=True)`), padding-free and padded.

    python benchmarks/cpu_attention.py --threads 2            # minilm, 32x128 and 8x512 (~10 minutes)
    python benchmarks/cpu_attention.py --quick                # minilm, 32x128, 3 rounds
"""

import common
import torch
from common import encoderstack, transformers

KERNELS = ("SDPA", "GEMMs")
TASKS = {
    "inference": (transformers.BertModel, encoderstack.EncoderStackModel),
    "mlm step": (transformers.BertForMaskedLM, encoderstack.EncoderStackForMaskedLM),
    "classification step": (
        transformers.BertForSequenceClassification,
        encoderstack.EncoderStackForSequenceClassification,
    ),
}


def run(model, batch, kernel, padding_free, training, optimizer):
    """One forward (inference) or training step with attention in `kernel`."""
    with common.bf16_gemms(kernel == "GEMMs"):
        if not training:
            with torch.inference_mode():
                return model(**batch, padding_free=padding_free)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch, padding_free=padding_free).loss
        loss.backward()
        optimizer.step()


def main():
    parser = common.common_arguments(__doc__.splitlines()[0], sizes="32x128,8x512", models="minilm")
    args = parser.parse_args()
    if args.quick:
        args.models, args.sizes = "minilm", args.sizes.split(",")[0]
    if args.device != "cpu" or args.dtype != "float32" or args.autocast:
        raise SystemExit("this benchmark sets the dtypes itself (bf16 weights, bf16 autocast): no --device/--dtype")
    iterations = args.iterations or (3 if args.quick else 5)
    common.setup(args)
    common.header("bf16 attention on the CPU (inference: the weights in bf16; steps: bf16 autocast over)", args.device)
    print(f"native bf16 GEMMs on this CPU: {encoderstack.execution_encoderstack.BF16_GEMMS}")
    tokenizer, rows = common.tokenizer(), []
    for spec in common.parse_models(args.models):
        for task, (bert_class, ours_class) in TASKS.items():
            training = task != "inference"
            with common.scratch_folder() as scratch:
                config = {"num_labels": 2} if "classification" in task else {}
                bert, model = common.load_pair(spec, bert_class, ours_class, scratch, **config)
            model = common.with_backend(model, "sdpa")
            model = model.train() if training else model.to(torch.bfloat16)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5) if training else None
            for batch_size, max_length in common.parse_sizes(args.sizes):
                for workload in ("full", "uniform", "text"):
                    lengths, width, batch, rng = common.workload_batch(
                        workload, batch_size, max_length, bert.config.vocab_size, tokenizer, args.seed, "cpu"
                    )
                    if task == "mlm step":
                        chosen = torch.rand(batch["input_ids"].shape, generator=torch.Generator().manual_seed(0)) < 0.15
                        batch["labels"] = batch["input_ids"].masked_fill(
                            ~(chosen & batch["attention_mask"].bool()), -100
                        )
                    elif training:
                        batch["labels"] = torch.tensor([rng.randrange(2) for _ in lengths])
                    for padding_free in (True, False):
                        variants = {
                            kernel: (lambda k=kernel: run(model, batch, k, padding_free, training, optimizer))
                            for kernel in KERNELS
                        }
                        seconds, _ = common.interleave(variants, iterations, "cpu", peak_size=64)
                        rows.append(
                            [
                                common.model_name(spec),
                                task,
                                f"{batch_size}x{width}",
                                workload,
                                "padding-free" if padding_free else "padded",
                                *(f"{seconds[kernel] * 1e3:.0f} ms" for kernel in KERNELS),
                                f"{seconds['SDPA'] / seconds['GEMMs']:.2f}",
                            ]
                        )
    print(f"{iterations} interleaved rounds per cell, medians; the last column: SDPA's time / the GEMM kernel's")
    common.print_table(rows, ["model", "task", "batch", "lengths", "path", *KERNELS, "speed-up"])
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()
