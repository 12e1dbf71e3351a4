"""Sliding-window attention: peak memory and time of a stack of sliding layers against the same model forced to a
dense band mask (SDPA), and a ModernBERT-patterned model against transformers' ModernBertModel (SDPA), same weights,
ratios in one run.

    python benchmarks/sliding_window.py --threads 1              # (a) 512 ... 16384 tokens, radius 64; (b) at 8192
    python benchmarks/sliding_window.py --quick                  # small lengths, one round
    python benchmarks/sliding_window.py --blocks --threads 1     # the block size of banded attention, measured
    python benchmarks/sliding_window.py --parts c --threads 1    # (c) 16384 and 32768 tokens, with limits

Peak memory is the process's resident high-water mark over one forward, each cell in a fresh process (the allocator
keeps what an earlier cell freed), above what it held before the forward; time is interleaved in this process.
"""

import contextlib
import json
import os
import resource
import subprocess
import sys
import time

import common
import torch
from common import encoderstack, transformers

from encoderstack import execution_encoderstack

STACK = {"hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 1024}
MODERN = {"hidden_size": 256, "num_hidden_layers": 9, "num_attention_heads": 4, "intermediate_size": 384}
CLASSES = ("ModernBertModel", "EncoderStackModel")
OUT_OF_MEMORY = ("can't allocate memory", "MemoryError", "std::bad_alloc")  # torch's CPU allocator, Python, C++


@contextlib.contextmanager
def dense_band():
    """The same model with its sliding layers forced to a dense (tokens x tokens) band mask: what the plan gives
    a compiled forward, and what SDPA/eager sliding layers cost before banded attention."""
    original = execution_encoderstack.sliding_attention
    execution_encoderstack.sliding_attention = lambda facts, plan: (plan.attention, "a dense band mask (forced)")
    try:
        yield
    finally:
        execution_encoderstack.sliding_attention = original


def sliding_stack(spec, radius, max_length):
    fields = {**STACK, **spec} if isinstance(spec, dict) else dict(STACK)
    fields["max_position_embeddings"] = max_length
    layers = fields["num_hidden_layers"]
    config = encoderstack.EncoderStackConfig(
        **fields, position_embedding_type="rope", layer_types=["sliding_attention"] * layers, sliding_window=radius
    )
    torch.manual_seed(0)
    return common.with_backend(encoderstack.EncoderStackModel(config, add_pooling_layer=False).eval(), "sdpa")


def resident_kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))


def saved_model(folder, name):
    """A saved model loaded with the class `name` (EncoderStack's or transformers'), SDPA, eval mode."""
    owner = encoderstack if name.startswith("EncoderStack") else transformers
    return common.with_backend(getattr(owner, name).from_pretrained(folder).eval(), "sdpa")


def measured_forward(model, length, variant=""):
    """One forward on `length` random tokens: its last hidden state, seconds, and the peak resident memory (MiB) it
    added to what the process held before it."""
    ids = torch.randint(1, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets the high-water mark to the current resident size
    before = resident_kib("VmRSS")
    start = time.perf_counter()
    with torch.inference_mode(), dense_band() if variant == "dense" else contextlib.nullcontext():
        hidden = model(input_ids=ids).last_hidden_state
    seconds = time.perf_counter() - start
    return hidden, seconds, (resident_kib("VmHWM") - before) / 1024


def measure_memory(request):
    """In a fresh process: the peak resident memory (MiB) one forward adds to what the process held before it.
    `spec` is the sliding stack's, or {"folder": ..., "class": ...}: a saved model loaded with that class."""
    spec, radius, length, variant, threads = json.loads(request)
    torch.set_num_threads(threads)
    model = saved_model(spec["folder"], spec["class"]) if "folder" in spec else sliding_stack(spec, radius, length)
    print(json.dumps(measured_forward(model, length, variant)[2]))


def measure_long(request):
    """In a fresh process under an address-space limit: one forward of a saved model, its seconds and peak memory;
    its last hidden state is saved beside the model for the parent to compare."""
    folder, name, length, threads = json.loads(request)
    torch.set_num_threads(threads)
    hidden, seconds, peak = measured_forward(saved_model(folder, name), length)
    torch.save(hidden, os.path.join(folder, f"{name}-{length}.pt"))
    print(json.dumps({"seconds": seconds, "peak": peak}))


def in_child(flag, request, **options) -> subprocess.CompletedProcess:
    """This script run again in a fresh process, on `--measure-memory` or `--measure-long` with `request`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, __file__, flag, json.dumps(request)]
    return subprocess.run(command, capture_output=True, text=True, env=env, **options)


def printed(result: subprocess.CompletedProcess):
    return json.loads(result.stdout.strip().splitlines()[-1])


def peak_mib(spec, radius, length, variant, threads):
    return printed(in_child("--measure-memory", [spec, radius, length, variant, threads], check=True))


def timed_pair(model, length, iterations, device):
    ids = torch.randint(1, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))

    def run(variant):
        def forward():
            with torch.inference_mode(), dense_band() if variant == "dense" else contextlib.nullcontext():
                model(input_ids=ids)

        return forward

    seconds, _ = common.interleave({"banded": run("banded"), "dense": run("dense")}, iterations, device, 64)
    return seconds


def memory_table(args, spec, lengths, iterations):
    rows = []
    for length in lengths:
        model = sliding_stack(spec, args.radius, length)
        memory = {v: peak_mib(spec, args.radius, length, v, torch.get_num_threads()) for v in ("banded", "dense")}
        seconds = timed_pair(model, length, iterations, args.device)
        rows.append(
            [
                common.model_name(spec) if isinstance(spec, dict) else "sliding-stack",
                length,
                args.radius,
                f"{memory['banded']:.0f}",
                f"{memory['dense']:.0f}",
                f"{memory['dense'] / max(memory['banded'], 1e-9):.1f}",
                f"{seconds['banded'] * 1000:.0f}",
                f"{seconds['dense'] * 1000:.0f}",
                f"{seconds['dense'] / seconds['banded']:.2f}",
            ]
        )
    layers = (spec if isinstance(spec, dict) else STACK).get("num_hidden_layers", STACK["num_hidden_layers"])
    print(f"(a) {layers} sliding layers, batch 1; banded (ours) against the same weights with a dense band mask (SDPA)")
    print(f"{iterations} interleaved rounds per cell, medians; peak memory: one forward, in a fresh process each")
    common.print_table(
        rows,
        [
            "model",
            "tokens",
            "radius",
            "peak MiB banded",
            "peak MiB dense",
            "memory ratio",
            "ms banded",
            "ms dense",
            "speed-up",
        ],
    )


def modernbert_config(length, radius):
    """ModernBERT's pattern: global attention every 3rd layer, the others sliding (local_attention = 2 radius)."""
    return transformers.ModernBertConfig(
        **MODERN, max_position_embeddings=length, global_attn_every_n_layers=3, local_attention=2 * radius
    )


def modernbert_pair(length, radius, folder):
    """transformers' ModernBertModel (global attention every 3rd layer, local_attention = 2 radius) and EncoderStack's
    conversion of it, same weights; None where this EncoderStack cannot convert ModernBERT (yet)."""
    torch.manual_seed(0)
    reference = transformers.ModernBertModel(modernbert_config(length, radius))
    reference.save_pretrained(folder)
    try:
        ours = encoderstack.EncoderStackModel.from_pretrained(folder)
    except Exception as error:  # noqa: BLE001  (conversion is another change: say why and go on)
        return reference, None, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return tuple(common.with_backend(model.eval(), "sdpa") for model in (reference, ours)) + (None,)


def modernbert_table(args, length, iterations):
    with common.scratch_folder() as folder:
        reference, ours, why = modernbert_pair(length, args.radius, folder)
        memory = (
            {
                name: peak_mib({"folder": folder, "class": name}, args.radius, length, "", torch.get_num_threads())
                for name in ("ModernBertModel", "EncoderStackModel")
            }
            if ours is not None
            else None
        )
    if ours is None:
        print(f"(b) ModernBERT-patterned at {length} tokens: not run, no ModernBERT conversion here ({why})")
        return
    layers = MODERN["num_hidden_layers"]
    sliding = sum(t == "sliding_attention" for t in ours.config.layer_types)
    # FLOPs of one layer per token: projections 8 H^2 + MLP 6 H I (GLU), attention 4 H x keys seen
    hidden, inner = MODERN["hidden_size"], MODERN["intermediate_size"]
    dense_layer = 8 * hidden**2 + 6 * hidden * inner + 4 * hidden * length
    window_layer = 8 * hidden**2 + 6 * hidden * inner + 4 * hidden * min(2 * args.radius + 1, length)
    ideal = layers * dense_layer / ((layers - sliding) * dense_layer + sliding * window_layer)
    ids = torch.randint(1, 30000, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = reference(input_ids=ids).last_hidden_state
        actual = ours(input_ids=ids).last_hidden_state
        seconds, _ = common.interleave(
            {"reference": lambda: reference(input_ids=ids), "ours": lambda: ours(input_ids=ids)},
            iterations,
            args.device,
            64,
        )
    speedup = seconds["reference"] / seconds["ours"]
    print(f"(b) ModernBERT-patterned, {layers} layers ({sliding} sliding, radius {args.radius}), batch 1")
    print(f"max |ours - ModernBertModel| = {(actual - expected).abs().max().item():.2e}")
    common.print_table(
        [
            [
                "modernbert-patterned",
                length,
                f"{seconds['reference'] * 1000:.0f}",
                f"{seconds['ours'] * 1000:.0f}",
                f"{speedup:.2f}",
                f"{ideal:.2f}",
                f"{speedup / ideal:.0%}",
                f"{memory['ModernBertModel']:.0f}",
                f"{memory['EncoderStackModel']:.0f}",
            ]
        ],
        [
            "model",
            "tokens",
            "ms ModernBertModel (SDPA)",
            "ms ours",
            "speed-up",
            "FLOP-ideal",
            "of ideal",
            "peak MiB ModernBertModel",
            "peak MiB ours",
        ],
    )


def long_run(folder, name, length, limit_gib, limit_s):
    """One forward in a child process limited to `limit_gib` of address space and `limit_s` seconds: its result,
    or why it did not finish (out of memory or out of time)."""
    limit = limit_gib * 2**30
    request = [folder, name, length, torch.get_num_threads()]
    try:
        cap = lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # noqa: E731
        result = in_child("--measure-long", request, preexec_fn=cap, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return f"out of time (over {limit_s} s)"
    if result.returncode == 0:
        return printed(result)
    if result.returncode == -9 or any(word in result.stderr for word in OUT_OF_MEMORY):
        return f"out of memory (over {limit_gib} GiB)"
    raise RuntimeError(f"{name} at {length} tokens failed:\n{result.stderr[-2000:]}")


def long_table(args, lengths):
    """(c) ModernBertModel and its conversion at long lengths, one forward each in a limited child process."""
    rows = []
    with common.scratch_folder() as folder:
        torch.manual_seed(0)
        transformers.ModernBertModel(modernbert_config(max(lengths), args.radius)).save_pretrained(folder)
        for length in lengths:
            runs = [long_run(folder, name, length, args.limit_gib, args.limit_s) for name in CLASSES]
            cells = [[f"{r['seconds']:.1f}", f"{r['peak']:.0f}"] if isinstance(r, dict) else [r, "-"] for r in runs]
            compared = ["-", "-"]
            if all(isinstance(run, dict) for run in runs):
                reference, ours = (torch.load(f"{folder}/{name}-{length}.pt") for name in CLASSES)
                speedup = runs[0]["seconds"] / runs[1]["seconds"]
                compared = [f"{speedup:.2f}", f"{(ours - reference).abs().max().item():.2e}"]
            rows.append(["modernbert-patterned", length, *cells[0], *cells[1], *compared])
    layers = MODERN["num_hidden_layers"]
    print(f"(c) ModernBERT-patterned, {layers} layers (global every 3rd, radius {args.radius}), batch 1, one forward")
    print(f"each in a fresh process limited to {args.limit_gib} GiB of address space and {args.limit_s} s")
    common.print_table(
        rows,
        [
            "model",
            "tokens",
            "s ModernBertModel (SDPA)",
            "peak MiB ModernBertModel",
            "s ours",
            "peak MiB ours",
            "speed-up",
            "max |ours - reference|",
        ],
    )


def block_table(args, iterations):
    """banded_attention alone at 4096 tokens, 4 heads of 64, for several radii and block sizes."""
    rows = []
    module = type("Module", (), {"training": False})()
    q, k, v = torch.randn(3, 1, 4, 4096, 64).unbind(0)
    for radius in (16, 64, 128):
        variants = {}
        for block in (16, 32, 64, 128, 256, 512):

            def call(block=block):  # one sliding layer's attention, with the band's layout it reads
                execution_encoderstack.band_block = lambda radius: block
                layout = execution_encoderstack.band_layout(radius, q.shape[2], None, q.device)
                execution_encoderstack.banded_attention(module, q, k, v, layout, 0.125, sliding_window=radius + 1)

            variants[block] = call
        original = execution_encoderstack.band_block
        with torch.inference_mode():
            seconds, _ = common.interleave(variants, iterations, args.device, 64)
        execution_encoderstack.band_block = original
        best = min(seconds, key=seconds.get)
        rows.append(["banded", radius, *(f"{seconds[b] * 1000:.1f}" for b in variants), best, original(radius)])
    common.print_table(
        rows, ["model", "radius", *(f"ms block {b}" for b in (16, 32, 64, 128, 256, 512)), "fastest", "chosen"]
    )


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--measure-memory":
        return measure_memory(sys.argv[2])
    if len(sys.argv) == 3 and sys.argv[1] == "--measure-long":
        return measure_long(sys.argv[2])
    parser = common.common_arguments(
        __doc__.splitlines()[0], sizes="1x512,1x1024,1x2048,1x4096,1x8192,1x16384", models="stack"
    )
    parser.add_argument("--radius", type=int, default=64, help="the sliding window's radius (default 64)")
    parser.add_argument("--modern-length", type=int, default=8192, help="tokens of (b) (default 8192)")
    parser.add_argument("--blocks", action="store_true", help="measure banded attention's block size only")
    parser.add_argument(
        "--parts", default="a,b", help="a: the sliding stack's table, b: ModernBERT, c: ModernBERT long (default a,b)"
    )
    parser.add_argument("--long-lengths", default="16384,32768", help="tokens of (c) (default 16384,32768)")
    parser.add_argument("--limit-gib", type=int, default=16, help="(c): address space per forward (default 16)")
    parser.add_argument("--limit-s", type=int, default=1800, help="(c): seconds per forward (default 1800)")
    args = parser.parse_args()
    iterations = args.iterations or (1 if args.quick else 3)
    common.setup(args)
    common.header("sliding window", args.device)
    if args.blocks:
        block_table(args, iterations)
    else:
        spec = "stack" if args.models == "stack" else json.loads(args.models)
        sizes = common.parse_sizes(args.sizes)
        lengths = [length for _, length in sizes][: 2 if args.quick else None]
        if "a" in args.parts.split(","):
            memory_table(args, spec, [min(n, 256) for n in lengths] if args.quick else lengths, iterations)
        if "b" in args.parts.split(","):
            modernbert_table(args, 512 if args.quick else args.modern_length, iterations)
        if "c" in args.parts.split(","):
            long_table(args, [int(n) for n in args.long_lengths.split(",")])
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()
