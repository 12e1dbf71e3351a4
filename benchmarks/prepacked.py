"""One projection alone, as EncoderStack's inference calls it: oneDNN's linear from the plain weight (oneDNN repacks it
on every call) against the same weight prepacked once (`config.cpu_kernels="onednn-prepacked"`), for each of a
model's projection shapes, float32 and bf16 (where the CPU has native bf16), interleaved. The outputs are checked
equal, bit for bit.

    python benchmarks/prepacked.py --threads 2     # minilm's shapes, 4096 and 512 rows (~1 minute)
"""

import statistics

import common
import torch
from common import encoderstack

plan = encoderstack.execution_encoderstack


def main():
    parser = common.common_arguments(__doc__.splitlines()[0], sizes="32x128,4x128", models="minilm")
    args = parser.parse_args()
    iterations = args.iterations or 25
    common.setup(args)
    common.header("One projection, plain and prepacked weights", args.device)
    if not plan.ONEDNN_LINEAR:
        raise SystemExit("this torch has no oneDNN linear")
    rows = []
    for spec in common.parse_models(args.models):
        config = common.bert_config(spec)
        hidden, inner = config.hidden_size, config.intermediate_size
        shapes = {"query/key/value/output": (hidden, hidden), "up (+GELU)": (hidden, inner), "down": (inner, hidden)}
        for dtype in plan.ONEDNN_DTYPES:
            for name, (fan_in, fan_out) in shapes.items():
                weight = torch.randn(fan_out, fan_in, dtype=dtype) * fan_in**-0.5
                bias = torch.randn(fan_out, dtype=dtype)
                activation = "gelu" if name.startswith("up") else "none"
                for batch_size, length in common.parse_sizes(args.sizes):
                    x = torch.randn(batch_size * length, fan_in, dtype=dtype)
                    weights = {"plain": weight, "prepacked": plan.prepacked(weight)}
                    calls = {
                        k: (lambda w=w: plan.onednn_linear(x, w, bias, activation, [], "none"))
                        for k, w in weights.items()
                    }
                    if not torch.equal(*(call() for call in calls.values())):
                        raise SystemExit(f"prepacked gave other numbers: {name}, {dtype}")
                    seconds = {k: [] for k in calls}
                    for _ in range(iterations):
                        for k, call in calls.items():
                            seconds[k].append(common.timed(call, "cpu"))
                    plain, packed = (statistics.median(seconds[k]) for k in calls)
                    flops = 2 * batch_size * length * fan_in * fan_out
                    rows.append(
                        [
                            common.model_name(spec),
                            str(dtype).removeprefix("torch."),
                            f"{name} {fan_in}->{fan_out}",
                            batch_size * length,
                            f"{plain * 1e3:.3f}",
                            f"{packed * 1e3:.3f}",
                            f"{flops / plain / 1e9:.0f}",
                            f"{flops / packed / 1e9:.0f}",
                            f"{plain / packed:.2f}",
                        ]
                    )
    print(f"{iterations} interleaved rounds per cell, medians")
    columns = ["model", "dtype", "projection", "rows", "plain ms", "prepacked ms", "plain GFLOP/s", "prepacked GFLOP/s"]
    common.print_table(rows, [*columns, "speed-up"])
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()
