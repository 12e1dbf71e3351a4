"""Pre-training throughput: real tokens per second of `encoderstack pretrain`'s step (each batch masked per sequence
and flattened into one row, no padding) against the step a user would otherwise write (`BertForMaskedLM` with
`DataCollatorForLanguageModeling` padding each batch to its longest sequence), on the same weights, the same
sequences of real text (the stdlib corpus) and so the same real tokens. The ideal speed-up is the baseline's padded
tokens / real tokens.

    python benchmarks/pretrain.py                      # minilm, 32x128, 8 batches, 3 rounds
    python benchmarks/pretrain.py --quick              # 4 batches, 2 rounds
"""

import random
import tempfile
from pathlib import Path

import common
import torch
from common import transformers

from encoderstack.diagnostics.corpus import stdlib_corpus
from encoderstack.pretrain import MaskedFlattening, chunker, documents


def corpus_sequences(tokenizer, max_length, corpus_bytes, seed):
    """The stdlib corpus's documents cut into sequences of at most `max_length` tokens, as pretrain cuts them,
    shuffled with the seed (pretrain's sampler shuffles too)."""
    with tempfile.TemporaryDirectory() as folder:
        path = stdlib_corpus(Path(folder) / "stdlib.txt", corpus_bytes)
        texts = [text for _, text in documents(path)]
    sequences = chunker(tokenizer, max_length, offsets=False)({"text": texts, "file": [0] * len(texts)})["input_ids"]
    random.Random(seed).shuffle(sequences)
    return sequences


def training_steps(model, optimizer, batches, collate):
    """One call = one training step (collation included) on each batch in turn."""

    def steps():
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            model(**collate(batch)).loss.backward()
            optimizer.step()

    return steps


def on_device(collate, device):
    return lambda batch: {k: v.to(device) if torch.is_tensor(v) else v for k, v in collate(batch).items()}


def main():
    parser = common.common_arguments(__doc__.splitlines()[0], sizes="32x128", models="minilm")
    parser.add_argument("--batches", type=int, default=8, help="batches per timed round")
    parser.add_argument("--corpus-bytes", type=int, default=300_000, help="of the stdlib corpus")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.sizes = 4, args.sizes.split(",")[0]
    iterations = args.iterations or (2 if args.quick else 3)
    common.setup(args)
    common.header("pre-training step (masked LM: forward + backward + AdamW, dropout on)", args.device)
    tokenizer = common.tokenizer()
    rows = []
    for spec in common.parse_models(args.models):
        bert, ours = common.mlm_training_pair(spec, args.device)
        for batch_size, max_length in common.parse_sizes(args.sizes):
            sequences = corpus_sequences(tokenizer, max_length, args.corpus_bytes, args.seed)
            if len(sequences) < batch_size * args.batches:
                raise SystemExit(f"the corpus gives {len(sequences)} sequences; raise --corpus-bytes")
            batches = [
                [{"input_ids": ids} for ids in sequences[i * batch_size : (i + 1) * batch_size]]
                for i in range(args.batches)
            ]
            padding = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, seed=args.seed)
            packing = MaskedFlattening(tokenizer, 0.15, False, seed=args.seed)
            steps = {
                "BERT padded": training_steps(
                    bert, torch.optim.AdamW(bert.parameters(), lr=1e-5), batches, on_device(padding, args.device)
                ),
                "EncoderStack pretrain": training_steps(
                    ours,
                    torch.optim.AdamW(ours.parameters(), lr=1e-5),
                    [
                        [{**example, "row": len(batch) * number + row} for row, example in enumerate(batch)]
                        for number, batch in enumerate(batches)
                    ],
                    on_device(packing, args.device),
                ),
            }
            seconds, _ = common.interleave(steps, iterations, args.device, peak_size=64)
            real = sum(len(example["input_ids"]) for batch in batches for example in batch)
            padded = sum(len(batch) * max(len(example["input_ids"]) for example in batch) for batch in batches)
            speedup, ideal = seconds["BERT padded"] / seconds["EncoderStack pretrain"], padded / real
            rows.append(
                [
                    common.model_name(spec),
                    f"{batch_size}x{max_length}",
                    f"{real / padded:.0%}",
                    common.format_rate(real / seconds["BERT padded"]),
                    common.format_rate(real / seconds["EncoderStack pretrain"]),
                    f"{speedup:.2f}",
                    f"{ideal:.2f}",
                    f"{speedup / ideal:.0%}",
                ]
            )
    print(
        f"{iterations} interleaved rounds of {args.batches} steps per cell, medians; real tokens/s on the same "
        "sequences of the stdlib corpus"
    )
    common.print_table(
        rows,
        [
            "model",
            "batch",
            "real",
            "BERT padded tok/s",
            "EncoderStack pretrain tok/s",
            "speed-up",
            "ideal",
            "speed-up/ideal",
        ],
    )
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()
