"""Training throughput: real tokens per second of one training step (forward, backward, AdamW) of BERT and
EncoderStack on the same weights, for masked LM and sequence classification, as ratios to BERT with SDPA. Masked LM
also runs the batch's sequences as `DataCollatorWithFlattening` gives them (one row, restarting position ids).

    python benchmarks/training.py                      # minilm and bert-base, 32x128 and 8x512 (over an hour)
    python benchmarks/training.py --quick              # minilm, 32x128, 3 rounds
"""

import copy

import common
import torch
from common import encoderstack, transformers

TASKS = {
    "mlm": (transformers.BertForMaskedLM, encoderstack.EncoderStackForMaskedLM),
    "classification": (transformers.BertForSequenceClassification, encoderstack.EncoderStackForSequenceClassification),
}
VARIANTS = ("BERT-eager", "EncoderStack padded", "EncoderStack padding-free", "EncoderStack flattened")


def labels_for(task, batch, rng):
    """MLM: 15% of the real tokens carry a label (the rest -100), as BERT's collator does; classification: 2 classes."""
    if task == "classification":
        return torch.tensor([rng.randrange(2) for _ in range(batch["input_ids"].shape[0])])
    chosen = torch.rand(batch["input_ids"].shape, generator=torch.Generator().manual_seed(rng.randrange(2**31))) < 0.15
    chosen &= batch["attention_mask"].bool().cpu()
    return torch.where(chosen, batch["input_ids"].cpu(), -100)


def flattened(batch):
    """The padded batch's sequences as `DataCollatorWithFlattening` would give them (with the flash kwargs)."""
    rows = [
        {"input_ids": ids[mask.bool()].tolist(), "labels": labels[mask.bool()].tolist()}
        for ids, mask, labels in zip(batch["input_ids"].cpu(), batch["attention_mask"].cpu(), batch["labels"].cpu())
    ]
    device = batch["input_ids"].device
    collated = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(rows)
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in collated.items()}


def training_step(model, optimizer, batch, **kwargs):
    def step():
        optimizer.zero_grad(set_to_none=True)
        model(**batch, **kwargs).loss.backward()
        optimizer.step()

    return step


def step_flops(task, config, lengths, labelled):
    """Useful FLOPs of one step on the real tokens: 3x the forward (backward is twice the forward), with the MLM
    head's transform and decoder on the `labelled` tokens, the only ones the loss reads (counted on every real token,
    EncoderStack's sparse prediction read above 100% of the peak)."""
    forward = common.encoder_flops(config, lengths)
    if task == "mlm":
        forward += 2 * labelled * (config.hidden_size**2 + config.hidden_size * config.vocab_size)
    return 3 * forward


def main():
    parser = common.common_arguments(__doc__.splitlines()[0], sizes="32x128,8x512", models="minilm,bert-base")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    parser.add_argument("--peak-size", type=int, default=4096, help="side of the square matmul that measures peak")
    args = parser.parse_args()
    if args.quick:
        args.models, args.sizes = "minilm", args.sizes.split(",")[0]
    iterations = args.iterations or 3
    common.setup(args)
    common.header("training step (forward + backward + AdamW, dropout on)", args.device)
    tokenizer = common.tokenizer()
    rows = []
    for spec in common.parse_models(args.models):
        for task in args.tasks.split(","):
            bert_class, ours_class = TASKS[task]
            with common.scratch_folder() as folder:
                bert, ours = common.load_pair(spec, bert_class, ours_class, folder, num_labels=2)
            bert = common.place(common.with_backend(bert, "sdpa"), args.device).train()
            bert_eager = common.with_backend(copy.deepcopy(bert), "eager")
            ours = common.place(common.with_backend(ours, "sdpa"), args.device).train()
            flash = {
                f"{name} {backend}": common.with_backend(copy.deepcopy(model), backend)
                for backend in common.flash_attention_backends(args.device)
                for name, model in (("BERT", bert), ("EncoderStack", ours))
            }
            optimizers = {
                id(m): torch.optim.AdamW(m.parameters(), lr=1e-5) for m in (bert, bert_eager, ours, *flash.values())
            }
            for batch_size, max_length in common.parse_sizes(args.sizes):
                for workload in common.WORKLOADS:
                    lengths, width, batch, rng = common.workload_batch(
                        workload, batch_size, max_length, bert.config.vocab_size, tokenizer, args.seed, args.device
                    )
                    batch["labels"] = labels_for(task, batch, rng).to(args.device)
                    steps = {
                        "BERT-sdpa": training_step(bert, optimizers[id(bert)], batch),
                        "BERT-eager": training_step(bert_eager, optimizers[id(bert_eager)], batch),
                        "EncoderStack padded": training_step(ours, optimizers[id(ours)], batch, padding_free=False),
                        "EncoderStack padding-free": training_step(ours, optimizers[id(ours)], batch),
                    }
                    if task == "mlm":
                        steps["EncoderStack flattened"] = training_step(ours, optimizers[id(ours)], flattened(batch))
                    steps.update(
                        {name: training_step(model, optimizers[id(model)], batch) for name, model in flash.items()}
                    )
                    seconds, peak = common.interleave(steps, iterations, args.device, args.peak_size)
                    flops = step_flops(task, bert.config, lengths, int((batch["labels"] != -100).sum()))
                    reference = seconds["BERT-sdpa"]
                    ideal = batch_size * width / sum(lengths)
                    cells = [
                        f"{reference / seconds[name]:.2f} ({flops / seconds[name] / peak:.0%})"
                        if name in seconds
                        else "-"
                        for name in (*VARIANTS, *flash)
                    ]
                    rows.append(
                        [
                            common.model_name(spec),
                            task,
                            f"{batch_size}x{width}",
                            workload,
                            f"{sum(lengths) / (batch_size * width):.0%}",
                            f"{common.format_rate(sum(lengths) / reference)} ({flops / reference / peak:.0%})",
                            *cells,
                            f"{ideal:.2f}",
                        ]
                    )
    print(f"{common.peak_line(args.peak_size)}; {iterations} interleaved rounds per cell, medians")
    print(
        "cells: speed-up over BERT-sdpa (BertForMaskedLM / BertForSequenceClassification) in real tokens/s "
        "(achieved FLOP/s on real tokens / matmul peak)"
    )
    flash_columns = [
        f"{name} {backend}"
        for backend in common.flash_attention_backends(args.device)
        for name in ("BERT", "EncoderStack")
    ]
    common.print_table(
        rows, ["model", "task", "batch", "lengths", "real", "BERT-sdpa tok/s", *VARIANTS, *flash_columns, "ideal"]
    )
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()
