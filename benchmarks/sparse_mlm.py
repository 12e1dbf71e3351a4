"""Sparse masked-LM prediction: one training step (forward, backward, AdamW) of EncoderStackForMaskedLM with the
prediction head on the labelled tokens only (`config.sparse_prediction`, the default) and on every token, as ratios
to BertForMaskedLM (SDPA) on the same weights and batch; 15% of the real tokens carry a label.

    python benchmarks/sparse_mlm.py --quick            # minilm, 32x128, 3 rounds
"""

import common
import torch
from training import labels_for, training_step

VARIANTS = ("EncoderStack dense head", "EncoderStack sparse head")


def main():
    parser = common.common_arguments(__doc__.splitlines()[0], sizes="32x128", models="minilm")
    args = parser.parse_args()
    iterations = args.iterations or (3 if args.quick else 5)
    common.setup(args)
    common.header("masked-LM training step (forward + backward + AdamW, dropout on)", args.device)
    tokenizer = common.tokenizer()
    rows = []
    for spec in common.parse_models(args.models):
        bert, ours = common.mlm_training_pair(spec, args.device)
        optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-5) for m in (bert, ours)}

        def step(sparse, batch):
            def run():
                ours.config.sparse_prediction = sparse
                training_step(ours, optimizers[id(ours)], batch)()

            return run

        for batch_size, max_length in common.parse_sizes(args.sizes):
            for workload in ("full", "text"):
                lengths, width, batch, rng = common.workload_batch(
                    workload, batch_size, max_length, bert.config.vocab_size, tokenizer, args.seed, args.device
                )
                batch["labels"] = labels_for("mlm", batch, rng).to(args.device)
                steps = {
                    "BERT-sdpa": training_step(bert, optimizers[id(bert)], batch),
                    VARIANTS[0]: step(False, batch),
                    VARIANTS[1]: step(True, batch),
                }
                seconds, _ = common.interleave(steps, iterations, args.device, 64)
                reference = seconds["BERT-sdpa"]
                rows.append(
                    [
                        common.model_name(spec),
                        f"{batch_size}x{width}",
                        workload,
                        f"{sum(lengths) / (batch_size * width):.0%}",
                        f"{reference * 1000:.0f} ms",
                        *(f"{reference / seconds[name]:.2f}" for name in VARIANTS),
                        f"{seconds[VARIANTS[0]] / seconds[VARIANTS[1]]:.2f}",
                    ]
                )
    print(f"{iterations} interleaved rounds per cell, medians; cells: speed-up over BERT-sdpa (BertForMaskedLM)")
    common.print_table(rows, ["model", "batch", "lengths", "real", "BERT-sdpa step", *VARIANTS, "sparse over dense"])
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()
