"""Parity of a converted folder with the reference transformers model, on the real tokens of sample inputs."""

import gc

import torch
import transformers

from .. import modeling_encoderstack
from ..parity import real_tokens
from .keymap import FAMILIES, ConversionError

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Normalization placement decides how gradients flow through a deep stack.",
    "Hi!",
    "BERT was pre-trained on books and Wikipedia, then fine-tuned for many tasks.",
]
PAIRS = [
    ("How old is the universe?", "About 13.8 billion years."),
    ("Where is the Eiffel tower?", "It stands in Paris, on the Champ de Mars, near the Seine."),
    ("Is it raining?", "No."),
    ("What does a tokenizer do?", "It splits text into the pieces a model was trained on."),
]
OUTPUTS = (
    "last_hidden_state",
    "pooler_output",
    "logits",
    "prediction_logits",
    "seq_relationship_logits",
    "sop_logits",
    "start_logits",
    "end_logits",
)


def fitting(config) -> dict:
    """Tokenizer settings that keep every sequence within the model's positions: a small vocabulary splits a
    sentence into more tokens than a small model has positions (fewer still after RoBERTa's offset)."""
    return {"truncation": True, "max_length": config.max_position_embeddings - (config.position_offset or 0)}


def sample_batches(folder, config, multiple_choice: bool, source=None) -> list[dict]:
    """The tokenizer's encoding of single sentences and of pairs, padded; random ids without a tokenizer."""
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    if tokenizer is not None:
        fit = fitting(config)
        if config.type_vocab_size < 2:  # no use for them: GTE-en-v1.5 (no token types) ships a BERT tokenizer
            fit["return_token_type_ids"] = False
        batches = [
            dict(tokenizer(SENTENCES, padding=True, return_tensors="pt", **fit)),
            dict(tokenizer([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt", **fit)),
        ]
        largest = max(batch["input_ids"].max().item() for batch in batches)
        if largest >= config.vocab_size:  # the reference would fail with an IndexError; ours with a ValueError
            raise ConversionError(
                f"{source or folder}: the tokenizer gives token id {largest}, but vocab_size is "
                f"{config.vocab_size}: its vocabulary does not belong to these weights"
            )
    else:
        batches = [random_batch(config)]
    if multiple_choice:  # consecutive rows become the choices of one question
        batches = [{key: value.view(-1, 2, value.shape[-1]) for key, value in batch.items()} for batch in batches]
    return batches


def random_batch(config) -> dict:
    """Right-padded random ids, padding at `pad_token_id` and no real token equal to it (RoBERTa's reference counts
    positions by the ids), with a second segment where the model has token types."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12, 5, 9, 1])
    pad = config.pad_token_id or 0
    ids = torch.randint(0, config.vocab_size - 1, (4, 12), generator=generator)
    ids = ids + (ids >= pad).long()  # every id but the pad id
    mask = (torch.arange(12) < lengths[:, None]).long()
    batch = {"input_ids": ids.masked_fill(mask == 0, pad), "attention_mask": mask}
    if config.type_vocab_size > 1:
        batch["token_type_ids"] = ((torch.arange(12) >= lengths[:, None] // 2) & mask.bool()).long()
    return batch


def run(model, batches, backend) -> list[dict]:
    results = []
    with torch.no_grad():
        for batch in batches:
            out = model(**batch, output_hidden_states=True, output_attentions=backend == "eager")
            mask = batch["attention_mask"].reshape(-1, batch["attention_mask"].shape[-1]).bool()
            results.append({"out": out, "mask": mask})
    return results


def on_real_tokens(result: dict) -> dict[str, list[torch.Tensor]]:
    """Every output of one run, restricted to real tokens: name -> tensors (one per layer for the per-layer ones)."""
    out, mask = result["out"], result["mask"]
    outputs = {
        name: [real_tokens(getattr(out, name), mask)] for name in OUTPUTS if getattr(out, name, None) is not None
    }
    outputs["hidden_states"] = [real_tokens(h, mask) for h in out.hidden_states or ()]
    outputs["attentions"] = [a.transpose(1, 2)[mask] for a in out.attentions or ()]  # real queries, every key
    return {name: tensors for name, tensors in outputs.items() if tensors}


def check_finite(outputs: dict[str, list[torch.Tensor]], whose: str) -> None:
    """Refuse NaN/inf outputs: a largest difference cannot show them (NaN compares as neither larger nor smaller)."""
    bad = [name for name, tensors in outputs.items() if not all(torch.isfinite(t).all() for t in tensors)]
    if bad:
        raise ConversionError(f"{whose} output {', '.join(bad)} has NaN/inf on real tokens")


def compare(reference: list[dict], converted: list[dict], skip: set) -> list[dict]:
    worst = {}
    for ref, ours in zip(reference, converted):
        ref, ours = on_real_tokens(ref), on_real_tokens(ours)
        for name in (name for name in ref if name in ours and name not in skip):
            for a, b in zip(ref[name], ours[name]):
                difference = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
                worst[name] = max(worst.get(name, 0.0), difference)
    return [{"output": name, "max_abs_diff": value} for name, value in worst.items()]


def skipped_outputs(conversion) -> set:
    """Outputs of newly initialized weights, which no reference has."""
    skip = set()
    if any(key.endswith("pooler.dense.weight") for key in conversion.initialized):
        skip |= {"pooler_output"}
    if (
        any(not key.startswith("model.") for key in conversion.initialized)
        and conversion.task.name != "feature-extraction"
    ):
        skip |= set(OUTPUTS) - {"last_hidden_state"}
    return skip


def run_converted(folder, conversion, batches, backend, **load) -> list[dict]:
    ours = (
        getattr(modeling_encoderstack, conversion.task.encoderstack_class)
        .from_pretrained(folder, attn_implementation=backend, **load)
        .eval()
    )
    converted = run(ours, batches, backend)
    for result in converted:
        check_finite(on_real_tokens(result), f"EncoderStack ({backend})")
    return converted


def verify_against_google_bert(tensors, conversion, folder) -> dict:
    """A TensorFlow conversion against Google's BERT math computed from the checkpoint's own variables; ours runs in
    float32 (exact for float16 weights), as the reference computes in float64."""
    from types import SimpleNamespace

    from .google_bert import GoogleBert

    reference = GoogleBert(tensors, conversion.config, conversion.task.name)
    batches = sample_batches(folder, conversion.config, False, folder)
    expected = [
        {"out": SimpleNamespace(attentions=None, **reference.outputs(batch)), "mask": batch["attention_mask"].bool()}
        for batch in batches
    ]
    results = {
        backend: compare(
            expected,
            run_converted(folder, conversion, batches, backend, dtype=torch.float32),
            skipped_outputs(conversion),
        )
        for backend in ("eager", "sdpa")
    }
    return {
        "reference": "Google BERT's math (float64 numpy over the TensorFlow variables)",
        "inputs": "tokenizer: sentences and sentence pairs, padded" if len(batches) > 1 else "random ids, padded",
        "tolerance": 1e-5,
        "results": results,
    }


def verify_folder(reference_folder, conversion, folder) -> dict:
    """Load the reference and the converted model in turn (never both at once) on eager and SDPA; compare. Both run in
    float32 whatever the stored dtype: the weights convert exactly, and bf16 rounding (up to 3e-2 apart) would hide a
    wrong one."""
    family = FAMILIES[conversion.family]
    name = family.architecture(conversion.task)
    if not family.transformers_reference:
        raise ConversionError(
            f"{reference_folder}: {name} has no transformers class to verify parity against; convert with "
            "verify=False (--no-verify)"
        )
    reference_class = getattr(transformers, name)
    batches = sample_batches(folder, conversion.config, conversion.task.name == "multiple-choice", reference_folder)
    skip = skipped_outputs(conversion)
    results = {}
    for backend in ("eager", "sdpa"):
        # Megatron-BERT has no SDPA in transformers: our SDPA path is then checked against its eager one.
        reference_backend = backend if reference_class._supports_sdpa else "eager"
        reference = reference_class.from_pretrained(
            reference_folder,
            attn_implementation=reference_backend,
            dtype=torch.float32,
            **family.reference_kwargs(conversion),
        ).eval()
        expected = run(reference, batches, backend)
        del reference
        gc.collect()
        for result in expected:
            check_finite(on_real_tokens(result), f"the reference {reference_class.__name__} ({backend})")
        results[backend] = compare(
            expected, run_converted(folder, conversion, batches, backend, dtype=torch.float32), skip
        )
    return {
        "reference": reference_class.__name__,
        "inputs": "tokenizer: sentences and sentence pairs, padded" if len(batches) > 1 else "random ids, padded",
        "tolerance": 1e-5,
        "results": results,
    }
