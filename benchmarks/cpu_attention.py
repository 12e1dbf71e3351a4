"""Attention on the CPU: EncoderStack with each kernel the plan may pick (`common.CPU_ATTENTION`: oneDNN Graph's fused
kernel, with the packed sequences of one padded length in one call or one call each, `gemm_attention`, torch's SDPA),
same process, interleaved: an inference forward in bf16 weights and in float32 with `cpu_kernels="onednn"`, and a
training step (forward, backward, AdamW) of masked LM and sequence classification in float32 weights under bf16
autocast (`Trainer(bf16=True)`), padding-free and padded.

    python benchmarks/cpu_attention.py --threads 2            # minilm, 32x128 and 8x512 (~6 minutes)
    python benchmarks/cpu_attention.py --threads 2 --layer    # one layer's attention alone, each kernel (~1 minute)
    python benchmarks/cpu_attention.py --quick                # minilm, 32x128, 3 rounds
"""

from types import SimpleNamespace

import common
import torch
from common import encoderstack, transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward

plan = encoderstack.execution_encoderstack

KERNELS = tuple(common.CPU_ATTENTION)
LAYER_KERNELS = ("SDPA", "GEMMs", "fused")  # one layer's call: grouping packed sequences does not apply
TASKS = {  # task -> the reference's class, ours, the kernels the plan may pick there
    "inference bf16": (transformers.BertModel, encoderstack.EncoderStackModel, KERNELS),
    "inference fp32 oneDNN": (
        transformers.BertModel,
        encoderstack.EncoderStackModel,
        ("SDPA", "fused 1-by-1", "fused"),
    ),
    "mlm step": (transformers.BertForMaskedLM, encoderstack.EncoderStackForMaskedLM, ("SDPA", "GEMMs")),
    "classification step": (
        transformers.BertForSequenceClassification,
        encoderstack.EncoderStackForSequenceClassification,
        ("SDPA", "GEMMs"),
    ),
}


def run(model, batch, kernel, padding_free, training, optimizer):
    """One forward (inference) or training step with attention in `kernel`."""
    with common.cpu_attention(kernel):
        if not training:
            with torch.inference_mode():
                return model(**batch, padding_free=padding_free)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch, padding_free=padding_free).loss
        loss.backward()
        optimizer.step()


def layer_rows(spec, sizes, iterations) -> list:
    """One layer's attention alone: each kernel this CPU and torch can run on the same queries, keys and values (the
    model's heads and head size, in a layer's layout), in inference, no mask; also single sequences of 64 to 256
    tokens, as the per-sequence path calls it."""
    config, rows = common.bert_config(spec), []
    heads, dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    layer = SimpleNamespace(is_causal=False, training=False)
    shapes = [*sizes, *((1, length) for length in (64, 80, 96, 112, 128, 256))]
    for dtype in (torch.bfloat16, torch.float32):
        kernels = {"SDPA": sdpa_attention_forward, "GEMMs": plan.gemm_attention, "fused": plan.fused_attention}
        runs = {
            "SDPA",
            *(["GEMMs"] if dtype == torch.bfloat16 and plan.BF16_GEMMS else []),
            *(["fused"] if plan.ONEDNN_GRAPH else []),
        }
        for batch_size, length in shapes:
            query, key, value = (
                torch.randn(batch_size, length, heads, dim).to(dtype).transpose(1, 2) for _ in range(3)
            )
            variants = {
                name: (lambda f=kernel: f(layer, query, key, value, None, scaling=dim**-0.5))
                for name, kernel in kernels.items()
                if name in runs
            }
            with torch.inference_mode():
                seconds, _ = common.interleave(variants, iterations, "cpu", peak_size=64)
            rows.append(
                [
                    common.model_name(spec),
                    str(dtype).removeprefix("torch."),
                    f"{batch_size}x{length}",
                    *(f"{seconds[k] * 1e3:.3f} ms" if k in seconds else "-" for k in LAYER_KERNELS),
                    *(f"{seconds['SDPA'] / seconds[k]:.2f}" if k in seconds else "-" for k in LAYER_KERNELS[1:]),
                ]
            )
    return rows


def main():
    parser = common.common_arguments(__doc__.splitlines()[0], sizes="32x128,8x512", models="minilm")
    parser.add_argument("--layer", action="store_true", help="one layer's attention alone, each kernel")
    args = parser.parse_args()
    if args.quick:
        args.models, args.sizes = "minilm", args.sizes.split(",")[0]
    if args.device != "cpu" or args.dtype != "float32" or args.autocast:
        raise SystemExit("this benchmark sets the dtypes itself (bf16 weights, bf16 autocast): no --device/--dtype")
    iterations = args.iterations or (3 if args.quick else 5)
    common.setup(args)
    common.header("attention on the CPU (inference: bf16 or float32 weights; steps: bf16 autocast)", args.device)
    print(f"native bf16 GEMMs on this CPU: {plan.BF16_GEMMS}; oneDNN Graph in this torch: {plan.ONEDNN_GRAPH}")
    if args.layer:
        sizes = common.parse_sizes(args.sizes)
        rows = [row for spec in common.parse_models(args.models) for row in layer_rows(spec, sizes, iterations)]
        print(f"{iterations} interleaved rounds per cell, medians; 'x SDPA': SDPA's time / the kernel's")
        speedups = [f"{kernel} x SDPA" for kernel in LAYER_KERNELS[1:]]
        common.print_table(rows, ["model", "dtype", "shape", *LAYER_KERNELS, *speedups])
        print(f"reproduce: {common.command_line()}")
        return
    tokenizer, rows = common.tokenizer(), []
    for spec in common.parse_models(args.models):
        for task, (bert_class, ours_class, kernels) in TASKS.items():
            training = not task.startswith("inference")
            with common.scratch_folder() as scratch:
                config = {"num_labels": 2} if "classification" in task else {}
                bert, model = common.load_pair(spec, bert_class, ours_class, scratch, **config)
            model = common.with_backend(model, "sdpa")
            if training:
                model.train()
            elif "bf16" in task:
                model.to(torch.bfloat16)
            else:
                model.set_cpu_kernels("onednn")
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
                            for kernel in kernels
                        }
                        seconds, _ = common.interleave(variants, iterations, "cpu", peak_size=64)
                        rows.append(
                            [
                                common.model_name(spec),
                                task,
                                f"{batch_size}x{width}",
                                workload,
                                "padding-free" if padding_free else "padded",
                                *(f"{seconds[k] * 1e3:.0f} ms" if k in seconds else "-" for k in KERNELS),
                                *(f"{seconds['SDPA'] / seconds[k]:.2f}" if k in seconds else "-" for k in KERNELS[1:]),
                            ]
                        )
    print(
        f"{iterations} interleaved rounds per cell, medians; 'x SDPA': SDPA's time / the kernel's; '-': not run there"
    )
    speedups = [f"{kernel} x SDPA" for kernel in KERNELS[1:]]
    common.print_table(rows, ["model", "task", "batch", "lengths", "path", *KERNELS, *speedups])
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()
