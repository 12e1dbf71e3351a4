"""Flattened rows without a varlen kernel: EncoderStack's per-sequence SDPA loop against flex attention with a
document mask (a block-sparse `BlockMask` built from sequence ids, which skips the blocks between sequences), eager
and compiled, and the cost of building that mask (once per forward, shared by the layers). Flex attention has no
backward on CPU, so on CPU only inference is timed.

    python benchmarks/flex.py                          # minilm's and bert-base's head shapes, 32x128 and 8x512
"""

import common
import torch
from attention import head_shape, per_sequence, uniform_lengths
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from encoderstack.execution_encoderstack import PackedSequences


def document_mask(packing, device):
    """The block-sparse mask of flattened rows: a token sees the tokens of its own sequence."""
    ids = packing.sequence_ids().flatten()

    def same_sequence(batch, head, q, k):
        return ids[q] == ids[k]

    tokens = ids.numel()
    return create_block_mask(same_sequence, None, None, tokens, tokens, device=device)


def main():
    parser = common.common_arguments(__doc__.splitlines()[0], sizes="32x128,8x512", models="minilm,bert-base")
    args = parser.parse_args()
    if args.quick:
        args.models, args.sizes = "minilm", args.sizes.split(",")[0]
    iterations = args.iterations or (5 if args.quick else 9)
    common.setup(args)
    common.header("flex attention's document mask on flattened rows", args.device)
    compiled = torch.compile(flex_attention)
    modes = ("inference", "training") if args.device != "cpu" else ("inference",)
    rows, failures = [], []
    for name in common.parse_models(args.models):
        heads, head_dim = head_shape(name)
        for batch_size, max_length in common.parse_sizes(args.sizes):
            lengths = uniform_lengths(args.seed, batch_size, max_length)
            packing = PackedSequences(lengths, (1, sum(lengths)), args.device)
            blocks = document_mask(packing, args.device)
            for mode in modes:
                training = mode == "training"
                query, key, value = (
                    torch.randn(1, heads, sum(lengths), head_dim, device=args.device, requires_grad=training)
                    for _ in range(3)
                )

                def flex(function):  # (1, tokens, heads, head_dim), as the per-sequence loop gives it
                    return function(query, key, value, block_mask=blocks).transpose(1, 2)

                expected = per_sequence(packing, query, key, value)
                variants = {
                    "per-sequence": lambda: step(lambda: per_sequence(packing, query, key, value)),
                    "flex compiled": lambda: step(lambda: flex(compiled)),
                    "flex eager": lambda: step(lambda: flex(flex_attention)),
                    "mask build": lambda: document_mask(packing, args.device),
                }
                try:
                    torch.testing.assert_close(flex(compiled), expected)
                except Exception as error:  # inductor's CPU flex template fails to build some shapes: say so
                    failures.append(f"{common.model_name(name)} {batch_size}x{max_length}: {error}".splitlines()[0])
                    del variants["flex compiled"]
                torch.testing.assert_close(flex(flex_attention), expected)

                def step(attend):
                    with torch.set_grad_enabled(training):
                        context = attend()
                        if training:
                            context.sum().backward()

                seconds, _ = common.interleave(variants, iterations, args.device, peak_size=64)
                base, others = seconds["per-sequence"], ("flex compiled", "flex eager", "mask build")
                rows.append(
                    [
                        common.model_name(name),
                        f"{heads}x{head_dim}",
                        f"{batch_size}x{max_length}",
                        mode,
                        f"{base * 1e3:.1f} ms",
                        *(f"{seconds[column] * 1e3:.1f} ms" if column in seconds else "failed" for column in others),
                        *(f"{seconds[column] / base:.2f}" if column in seconds else "-" for column in others),
                    ]
                )
    print(f"one layer's attention, lengths uniform in [max/8, max], one flattened row; {iterations} interleaved rounds")
    print("(the mask is built once per forward and shared by every layer; flex has no CPU backward: no CPU training)")
    common.print_table(
        rows,
        [
            "model",
            "heads x dim",
            "batch",
            "mode",
            "per-sequence",
            "flex compiled",
            "flex eager",
            "mask build",
            "flex compiled / per-sequence",
            "flex eager / per-sequence",
            "mask build / per-sequence",
        ],
    )
    for failure in failures:
        print(f"flex compiled failed: {failure}")
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()
