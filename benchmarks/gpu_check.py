"""The prepared check for a lent GPU (one H100/H200, a short slot): one run, within 8 minutes (a hard internal time
guard), whose raw output is what to commit under docs/benchmarks/:

1. the execution plan on this device for every input kind x dtype x backend x mode, each cell run once;
2. bf16 parity of the packed paths against the padded batch, for every head, and masked-LM gradients with attention
   dropout off (with it on, two paths draw different masks);
3. attention dropout compared like with like: the flash kernel's backward replays its forward's mask (attention is
   linear in V, so <dO, O> = <dV, V> holds exactly only with the same mask), and the mean of 32 dropout draws of the
   packed model's output is as close to its dropout-free output as the padded batch's;
4. device-to-host syncs of a masked-LM training step: counted for the whole step (the goal: one, the lengths), and
   none allowed in the layers' forward and backward once the plan is made (`torch.cuda.set_sync_debug_mode("error")`);
5. the inference and training benchmarks: ratios against BERT-SDPA at the small sizes and at compute-bound ones
   (bert-base 64x512 and 128x512), the training step also as `Trainer(bf16=True)` runs it (float32 weights under
   bf16 autocast, dropout 0.1), then flex attention; flash_attention_2 columns where it is installed. "minilm" is
   the embedded checkpoint, or its shape in random weights where its weights are not installed.

    PYTHONPATH=src python benchmarks/gpu_check.py      # on the GPU machine: cuda, bf16
    PYTHONPATH=src python benchmarks/gpu_check.py --smoke   # CPU, tiny sizes: that it runs (sections 1-3)
"""

import argparse
import contextlib
import itertools
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import common
import torch
from common import encoderstack, transformers

from encoderstack import execution_encoderstack as execution
from encoderstack.modeling_encoderstack import AUTO_MAP

HEADS = [  # every class the Auto classes map, the bare model first
    getattr(encoderstack, path.rpartition(".")[2]) for auto, path in AUTO_MAP.items() if auto != "AutoConfig"
]
DTYPES = ("float32", "bfloat16", "float16", "float32 + bf16 autocast")
SIZES = ["--models", "minilm,bert-base", "--sizes", "32x128,8x512"]
LARGE = ["--models", "bert-base", "--sizes", "64x512,128x512"]
TRAINER_BF16 = ["--dtype", "float32", "--autocast", "bfloat16"]  # what Trainer(bf16=True) runs
BENCHMARKS = [  # (script, its arguments on the GPU), cheapest first; flex last: it compiles every shape
    ("inference.py", ["--dtype", "bfloat16", *SIZES, "--iterations", "5"]),
    ("training.py", [*TRAINER_BF16, *SIZES, "--iterations", "3"]),
    ("training.py", [*TRAINER_BF16, *LARGE, "--iterations", "3"]),
    ("inference.py", ["--dtype", "bfloat16", *LARGE, "--iterations", "3"]),
    ("training.py", ["--dtype", "bfloat16", *SIZES, "--iterations", "3"]),
    ("flex.py", ["--models", "minilm", "--sizes", "32x128,8x512", "--iterations", "5"]),
]
PARITY = 2e-2  # bf16 keeps 8 bits: outputs and gradients agree to 2% of their norm


class TimeGuard(BaseException):
    """Not an Exception: the sections' reports of errors must not swallow it."""


def first_line(error):
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:100]}"


def on_alarm(signum, frame):
    raise TimeGuard


def config(smoke, **overrides):
    """Head size 64 (flash runs it), two layers: what the plan decides on, at a size that costs no time."""
    hidden, heads = (32, 4) if smoke else (256, 4)
    fields = {"vocab_size": 99, "hidden_size": hidden, "num_hidden_layers": 2, "num_attention_heads": heads}
    fields.update(intermediate_size=hidden * 2, max_position_embeddings=64, hidden_dropout_prob=0.0, num_labels=3)
    return encoderstack.EncoderStackConfig(**{**fields, **overrides})


def batches(device, lengths=(5, 9, 1, 7, 3)):
    """The same sequences three ways: each row whole, a padded batch, one flattened row."""
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, 99, (n,), generator=generator) for n in lengths]
    width = max(lengths)
    padded = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, sequence in enumerate(ids):
        padded[row, : len(sequence)] = sequence
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    inputs = {
        "whole": {"input_ids": padded[:, :1]},
        "padded": {"input_ids": padded, "attention_mask": mask},
        "flattened": {"input_ids": torch.cat(ids)[None], "position_ids": positions},
    }
    return {kind: {name: x.to(device) for name, x in values.items()} for kind, values in inputs.items()}


def precision(dtype_name, device):
    """The weights' dtype and the autocast context of one column of the plan table."""
    if dtype_name == "float32 + bf16 autocast":
        return torch.float32, torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return getattr(torch, dtype_name), contextlib.nullcontext()


def plan_table(args):
    backends = ["sdpa", "eager", *common.flash_attention_backends(args.device)]
    rows = []
    for dtype_name in DTYPES:
        weights, autocast = precision(dtype_name, args.device)
        torch.manual_seed(0)
        model = encoderstack.EncoderStackForMaskedLM(config(args.smoke, attention_probs_dropout_prob=0.1))
        model = model.to(args.device, weights)
        for backend in backends if dtype_name != "float32" else ["sdpa", "eager"]:  # flash takes 16 bits only
            common.with_backend(model, backend)
            for mode in ("eval", "train"):
                model.train(mode == "train")
                for kind, inputs in batches(args.device).items():
                    with autocast:
                        plan, ran = run_once(model, inputs, mode == "train")
                    rows.append([dtype_name, backend, mode, kind, plan.kind, plan.attention, ran, plan.reason])
    common.print_table(rows, ["dtype", "backend", "mode", "input", "plan", "attention", "ran", "reason"])
    return all(row[6] == "ok" for row in rows)


def run_once(model, inputs, training):
    """The plan, and one forward (and backward in training) on it: 'ok', or the error's first line."""
    plan = SimpleNamespace(kind="-", attention="-", reason="-")
    try:
        plan = model.model.execution_plan(**inputs)
        with torch.set_grad_enabled(training):
            logits = model(**inputs).logits
            if training:
                logits.float().pow(2).mean().backward()
        return plan, "ok" if torch.isfinite(logits).all() else "not finite"
    except Exception as error:  # the table reports every cell, whatever one of them raises
        return plan, first_line(error)


def head_inputs(model_class, inputs):
    if model_class is encoderstack.EncoderStackForMultipleChoice:
        return {name: x[:, None].expand(-1, 2, -1) for name, x in inputs.items()}
    return inputs


def relative_difference(actual, expected):
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12))


def parity(args):
    """bf16 weights: each head's main output with padding_free (the packed plan) against the padded batch, on real
    tokens; then masked-LM gradients of the packed padded batch and of the flattened row against the padded batch's."""
    padded = batches(args.device)["padded"]
    real = padded["attention_mask"].bool()
    rows = []
    for model_class in HEADS:
        torch.manual_seed(0)
        model = model_class(config(args.smoke)).to(args.device, torch.bfloat16).eval()
        inputs = head_inputs(model_class, padded)
        with torch.no_grad():
            packed, reference = (model(**inputs, padding_free=free).to_tuple()[0] for free in (True, False))
        if packed.shape[:2] == real.shape:
            packed, reference = packed[real], reference[real]
        plan = model.base_model.execution_plan(**{name: x.flatten(0, -2) for name, x in inputs.items()}).kind
        rows.append([model_class.__name__, "padded batch", plan, relative_difference(packed, reference)])
    off = config(args.smoke, attention_probs_dropout_prob=0.0)  # with dropout, each path would draw its own masks
    model = encoderstack.EncoderStackForMaskedLM(off).to(args.device, torch.bfloat16).train()
    flattened = batches(args.device)["flattened"]
    labels = padded["input_ids"].masked_fill(~real, -100)
    grads = {}
    for name, inputs, labelled in (("flattened row", flattened, labels[real][None]), ("padded batch", padded, labels)):
        for free in (True, False):
            model.zero_grad()
            model(**inputs, labels=labelled, padding_free=free).loss.backward()
            grads[name, free] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    for name in ("flattened row", "padded batch"):
        plan = model.model.execution_plan(**(flattened if name == "flattened row" else padded)).kind
        difference = relative_difference(grads[name, True], grads["padded batch", False])
        rows.append(["EncoderStackForMaskedLM gradients, dropout 0", name, plan, difference])
    for row in rows:
        row.append("ok" if row[3] <= PARITY else "FAILED")
        row[3] = f"{row[3]:.2e}"
    print(f"bf16 weights; |packed - padded| / |padded| over real tokens; within {PARITY} passes")
    common.print_table(rows, ["head", "input", "plan", "relative difference", "parity"])
    return all(row[-1] == "ok" for row in rows)


def dropout(args):
    """Attention dropout, like with like. (a) One call of the flash path's attention function: the backward's dV must
    satisfy <dO, O> = <dV, V>, which only the forward's own mask gives. (b) A model in training mode (bf16, dropout
    0.1 on attention only): the mean output over 32 draws against the dropout-free output, packed and padded."""
    rows = []
    module = SimpleNamespace(training=True, is_causal=False, config=SimpleNamespace(_attn_implementation="sdpa"))
    generator = torch.Generator(device=args.device).manual_seed(0)
    lengths = [5, 9, 1, 7, 3] if args.smoke else [64, 512, 200, 37, 300]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=args.device)
    shape = (1, 4, sum(lengths), 64)
    q, k, v = (torch.randn(shape, device=args.device, generator=generator, dtype=torch.bfloat16) for _ in range(3))
    v.requires_grad_()
    # --smoke on CPU, where no flash kernel runs: SDPA one sequence at a time (its backward replays its own mask)
    attention = execution.flash_attention if args.device == "cuda" else execution.per_sequence_attention
    out, _ = attention(module, q, k, v, None, scaling=0.125, dropout=0.1, cu_seq_lens_q=cu, max_length_q=max(lengths))
    grad = torch.randn(out.shape, device=args.device, generator=generator, dtype=torch.bfloat16)
    (dv,) = torch.autograd.grad(out, v, grad)
    lhs, rhs = (float((a.float() * b.detach().float()).sum()) for a, b in ((grad, out), (dv, v)))
    replay = abs(lhs - rhs) / max(abs(lhs), 1e-12)
    rows.append(["flash kernel: |<dO,O> - <dV,V>| / |<dO,O>|", f"{replay:.2e}", "ok" if replay <= 1e-2 else "FAILED"])
    torch.manual_seed(0)
    model = encoderstack.EncoderStackModel(config(args.smoke, attention_probs_dropout_prob=0.1))
    model = model.to(args.device, torch.bfloat16)
    padded = batches(args.device)["padded"]
    real = padded["attention_mask"].bool()
    with torch.no_grad():
        clean = model.eval()(**padded).last_hidden_state[real].float()
        model.train()
        for free in (True, False):
            draws = [model(**padded, padding_free=free).last_hidden_state[real].float() for _ in range(32)]
            deviation = relative_difference(torch.stack(draws).mean(0), clean)
            plan = model.execution_plan(**padded, padding_free=free)
            rows.append([f"mean of 32 draws vs no dropout, {plan.kind} ({plan.attention})", f"{deviation:.2e}"])
    packed, reference = (float(row[1]) for row in rows[1:])
    close = packed <= 1.5 * reference + 1e-3
    rows[1].append("ok" if close else "FAILED")
    rows[2].append("reference")
    common.print_table(rows, ["check", "value", "result"])
    return replay <= 1e-2 and close


def syncs(args):
    """A masked-LM training step under bf16 autocast (as Trainer(bf16=True) runs it), with and without attention
    dropout (the flash-kernel and the varlen_attn routes)."""
    passed = True
    for dropout in (0.0, 0.1):
        torch.manual_seed(0)
        model = encoderstack.EncoderStackForMaskedLM(config(args.smoke, attention_probs_dropout_prob=dropout))
        model = model.to(args.device).train()
        inputs = batches(args.device)["padded"]
        labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
        autocast = torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16)
        with autocast, sync_mode(args.device, "warn") as caught:
            model(**inputs, labels=labels).loss.backward()
        caught = [w for w in caught if "synchroniz" in str(w.message)]
        where = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in caught})
        with autocast:
            plan = model.model.execution_plan(**inputs)
        try:
            with autocast, sync_mode(args.device, "error"):
                model.model(**inputs, plan=plan).last_hidden_state.float().pow(2).mean().backward()
            layers = "0 (ok)"
        except RuntimeError as error:
            layers, passed = f"FAILED: {first_line(error)}", False
        counted = f"{len(caught)} ({', '.join(where)})" if args.device != "cpu" else "cpu: no device syncs"
        print(f"attention dropout {dropout}, plan {plan.kind} through {plan.attention}")
        print(f"  whole step (plan, input checks, sparse MLM, loss): {counted}")
        print(f"  layers' forward + backward given the plan: {layers if args.device != 'cpu' else 'cpu: ran'}")
    return passed


@contextlib.contextmanager
def sync_mode(device, mode):
    """torch.cuda.set_sync_debug_mode for the block, collecting its warnings; nothing to check on CPU."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device == "cpu":
            yield caught
            return
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def benchmarks(args, deadline):
    """Each benchmark script in its own process, cut at the deadline (what it printed is kept)."""
    if args.smoke:
        print("not run with --smoke (each runs in tests/test_benchmarks_smoke.py); on the GPU:")
    for script, arguments in BENCHMARKS:
        command = [sys.executable, str(Path(__file__).with_name(script)), "--device", args.device, *arguments]
        print("$ " + " ".join(command[1:]), flush=True)
        left = deadline - time.monotonic() - 10
        if args.smoke or left <= 0:
            print("  (skipped: --smoke)" if args.smoke else "  (skipped: the time guard)")
            continue
        try:
            subprocess.run(command, timeout=left, check=False)
        except subprocess.TimeoutExpired:
            print(f"  (cut by the time guard after {left:.0f} s)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, no benchmarks: that it runs")
    parser.add_argument(
        "--budget", type=float, default=450, help="seconds after the imports (default 450: 8 minutes in all)"
    )
    args = parser.parse_args()
    args.device = "cpu" if args.smoke else "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --smoke, or on the GPU machine")
    common.setup(argparse.Namespace(threads=None, clock="wall", dtype="bfloat16"))
    start = time.monotonic()
    deadline = start + args.budget
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.budget) + 1)  # the hard guard: whatever hangs, the run ends within the budget
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"gpu check on {where}: torch {torch.__version__}, transformers {transformers.__version__}")
    results = {}
    try:
        # the checks' batches are tiny: pack them anyway (the benchmarks, in their own processes, plan as users do)
        execution.GPU_PACKING_MIN_TOKENS = 0
        sections = (("plan table", plan_table), ("bf16 parity", parity), ("dropout", dropout), ("host syncs", syncs))
        for title, section in sections:
            print(f"\n## {title} ({time.monotonic() - start:.0f} s)", flush=True)
            results[title] = section(args)
        print(f"\n## benchmarks ({time.monotonic() - start:.0f} s)", flush=True)
        benchmarks(args, deadline)
    except TimeGuard:
        print(f"\nstopped by the time guard after {time.monotonic() - start:.0f} s")
        results["time guard"] = False
    finally:
        signal.alarm(0)
    failed = [title for title, passed in results.items() if not passed]
    print(
        f"\ndone in {time.monotonic() - start:.0f} s; " + (f"FAILED: {', '.join(failed)}" if failed else "all passed")
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
