"""Attention on packed tokens: EncoderStack's per-sequence SDPA loop against one SDPA call on a re-padded
(batch, heads, length, head_dim) view with a padding mask, and against one call on the packed row with a dense
(tokens x tokens) block-diagonal mask, forward (inference) and forward + backward (training). The loop does no work
on padding but makes one call per sequence; the others make one call on all of it.

    python benchmarks/attention.py                     # minilm's and bert-base's head shapes, 32x128 and 8x512
"""

import random
from types import SimpleNamespace

import common
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from encoderstack.execution_encoderstack import PackedSequences, per_sequence_attention

HEAD_SHAPES = {"minilm": (12, 32), "bert-base": (12, 64)}  # heads, head_dim


def head_shape(spec):
    """(heads, head_dim) of a --models entry."""
    if isinstance(spec, str):
        return HEAD_SHAPES[spec]
    return spec["num_attention_heads"], spec["hidden_size"] // spec["num_attention_heads"]


def uniform_lengths(seed, batch_size, max_length):
    """Real-token counts uniform in [max/8, max], seeded by the cell."""
    rng = random.Random(f"{seed}-{batch_size}-{max_length}")
    return common.lengths_for("uniform", batch_size, max_length, rng, None)


def per_sequence(packing, query, key, value):
    """What the model runs on CPU: `per_sequence_attention` over transformers' SDPA function, given the packing's
    kwargs; (1, heads, tokens, head_dim) in, (1, tokens, heads, head_dim) out."""
    module = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"), is_causal=False, training=False)
    return per_sequence_attention(module, query, key, value, None, **packing.attention_kwargs())[0]


def re_padded(packing, real, query, key, value):
    """Scatter to (batch, heads, length, head_dim), one masked SDPA call, gather the real tokens back."""
    query, key, value = (packing.unpack(x.transpose(1, 2)).transpose(1, 2) for x in (query, key, value))
    context, _ = sdpa_attention_forward(None, query, key, value, real[:, None, None], is_causal=False)
    return packing.pack(context)


def block_diagonal(blocks, query, key, value):
    """One SDPA call on the packed row with a dense (1, 1, tokens, tokens) block-diagonal mask."""
    return sdpa_attention_forward(None, query, key, value, blocks, is_causal=False)[0]


def main():
    parser = common.common_arguments(__doc__.splitlines()[0], sizes="32x128,8x512", models="minilm,bert-base")
    args = parser.parse_args()
    if args.quick:
        args.models, args.sizes = "minilm", args.sizes.split(",")[0]
    iterations = args.iterations or (5 if args.quick else 15)
    common.setup(args)
    common.header("attention on packed tokens", args.device)
    rows = []
    for name in common.parse_models(args.models):
        heads, head_dim = head_shape(name)
        for batch_size, max_length in common.parse_sizes(args.sizes):
            lengths = uniform_lengths(args.seed, batch_size, max_length)
            real = (torch.arange(max_length)[None] < torch.tensor(lengths)[:, None]).to(args.device)
            packing = PackedSequences.from_attention_mask(real, lengths)
            ids = torch.arange(len(lengths), device=args.device).repeat_interleave(
                torch.tensor(lengths, device=args.device)
            )
            blocks = (ids[:, None] == ids[None, :])[None, None]
            for mode in ("inference", "training"):
                training = mode == "training"
                query, key, value = (
                    torch.randn(1, heads, sum(lengths), head_dim, device=args.device, requires_grad=training)
                    for _ in range(3)
                )
                expected = per_sequence(packing, query, key, value)
                torch.testing.assert_close(expected, re_padded(packing, real, query, key, value))
                torch.testing.assert_close(expected, block_diagonal(blocks, query, key, value))

                def step(attend):
                    with torch.set_grad_enabled(training):
                        context = attend()
                        if training:
                            context.sum().backward()

                seconds, _ = common.interleave(
                    {
                        "per-sequence": lambda: step(lambda: per_sequence(packing, query, key, value)),
                        "re-padded": lambda: step(lambda: re_padded(packing, real, query, key, value)),
                        "block-diagonal": lambda: step(lambda: block_diagonal(blocks, query, key, value)),
                    },
                    iterations,
                    args.device,
                    peak_size=64,
                )
                rows.append(
                    [
                        common.model_name(name),
                        f"{heads}x{head_dim}",
                        f"{batch_size}x{max_length}",
                        mode,
                        f"{seconds['per-sequence'] * 1e3:.1f} ms",
                        f"{seconds['re-padded'] * 1e3:.1f} ms",
                        f"{seconds['block-diagonal'] * 1e3:.1f} ms",
                        f"{seconds['re-padded'] / seconds['per-sequence']:.2f}",
                        f"{seconds['block-diagonal'] / seconds['per-sequence']:.2f}",
                    ]
                )
    print(f"one layer's attention, lengths uniform in [max/8, max]; {iterations} interleaved rounds, medians")
    common.print_table(
        rows,
        [
            "model",
            "heads x dim",
            "batch",
            "mode",
            "per-sequence",
            "re-padded",
            "block-diagonal",
            "re-padded / per-sequence",
            "block-diagonal / per-sequence",
        ],
    )
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()
