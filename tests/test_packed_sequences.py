"""Packed sequences the ecosystem's way: flattened rows (position ids that restart, as `DataCollatorWithFlattening`
gives them, or `cu_seq_lens_q/k`) give each sequence's own numbers, on every placement, position type, backend and
head; the varlen kernels are dispatched once per layer with the right arguments; training on the collator matches
the padded batch."""

import pytest
import torch
from conftest import HEADS, REPRESENTATIVE_PLACEMENTS, build
from transformers import DataCollatorWithFlattening
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import encoderstack
from encoderstack import EncoderStackModel

LENGTHS = (5, 9, 1, 7, 3)
POSITION_TYPES = ("absolute", "sinusoidal", "rope")
SEQUENCE_LEVEL = (encoderstack.EncoderStackForSequenceClassification, encoderstack.EncoderStackForPreTraining)
FLATTENABLE = tuple(head for head in HEADS if head is not encoderstack.EncoderStackForMultipleChoice)


def sequences(lengths=LENGTHS, seed=3):
    """Random ids and token types (second half type 1) for each sequence."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        ids = torch.randint(1, 99, (length,), generator=generator)
        types = (torch.arange(length) >= length // 2).long()
        out.append({"input_ids": ids, "token_type_ids": types})
    return out


def flattened(seqs, route="position_ids"):
    """One row of every sequence, end to end, described by restarting position ids, by cu_seq_lens, or both."""
    row = {key: torch.cat([s[key] for s in seqs])[None] for key in ("input_ids", "token_type_ids")}
    lengths = torch.tensor([len(s["input_ids"]) for s in seqs])
    cu_seq_lens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()
    if route in ("position_ids", "both"):
        row["position_ids"] = torch.cat([torch.arange(n) for n in lengths.tolist()])[None]
    if route in ("cu_seq_lens", "both"):
        row.update(
            cu_seq_lens_q=cu_seq_lens,
            cu_seq_lens_k=cu_seq_lens,
            max_length_q=int(lengths.max()),
            max_length_k=int(lengths.max()),
        )
    return row


def padded(seqs):
    """The same sequences as a right-padded batch."""
    width = max(len(s["input_ids"]) for s in seqs)
    batch = {
        "input_ids": torch.zeros(len(seqs), width, dtype=torch.long),
        "token_type_ids": torch.zeros(len(seqs), width, dtype=torch.long),
        "attention_mask": torch.zeros(len(seqs), width, dtype=torch.long),
    }
    for row, s in enumerate(seqs):
        n = len(s["input_ids"])
        batch["input_ids"][row, :n], batch["token_type_ids"][row, :n] = s["input_ids"], s["token_type_ids"]
        batch["attention_mask"][row, :n] = 1
    return batch


PER_TOKEN = ("last_hidden_state", "logits", "prediction_logits", "start_logits", "end_logits")
PER_SEQUENCE = ("pooler_output", "seq_relationship_logits")


def per_sequence_outputs(model, model_class, seqs, **kwargs):
    """Each sequence run alone: per-token outputs end to end, per-sequence outputs one row each."""
    alone = [model(**{key: value[None] for key, value in s.items()}, **kwargs) for s in seqs]
    names = [name for name in PER_TOKEN + PER_SEQUENCE if getattr(alone[0], name, None) is not None]
    if model_class is encoderstack.EncoderStackForSequenceClassification:
        names.append("logits")
    return {
        name: torch.cat(
            [getattr(out, name) for out in alone],
            dim=0
            if name in PER_SEQUENCE
            or (name == "logits" and model_class is encoderstack.EncoderStackForSequenceClassification)
            else 1,
        )
        for name in dict.fromkeys(names)
    }


def assert_matches_each_sequence_alone(model, model_class, row, seqs, **kwargs):
    with torch.no_grad():
        expected = per_sequence_outputs(model, model_class, seqs)
        actual = model(**row, **kwargs)
    assert expected
    for name, value in expected.items():
        torch.testing.assert_close(getattr(actual, name), value, atol=1e-5, rtol=0, msg=name)


BACKENDS = ("eager", "sdpa", "flex_attention")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
@pytest.mark.parametrize("placement", REPRESENTATIVE_PLACEMENTS)
def test_a_flattened_row_gives_each_sequence_its_own_hidden_states_and_pooled_output(
    placement, position_embedding_type, backend
):
    model = build(
        EncoderStackModel,
        norm_placement=placement,
        position_embedding_type=position_embedding_type,
        attn_implementation=backend,
    )
    seqs = sequences()
    assert_matches_each_sequence_alone(model, EncoderStackModel, flattened(seqs), seqs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_class", FLATTENABLE, ids=lambda c: c.__name__)
def test_every_head_gives_each_flattened_sequence_its_own_outputs(model_class, backend):
    """The heads do not depend on the placement: one (ResiDual, rotary: two streams, positions in attention)."""
    model = build(model_class, norm_placement="resi_dual", position_embedding_type="rope", attn_implementation=backend)
    seqs = sequences()
    assert_matches_each_sequence_alone(model, model_class, flattened(seqs), seqs)


@pytest.mark.parametrize("route", ["cu_seq_lens", "both"])
@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_cu_seq_lens_kwargs_give_the_same_outputs_as_restarting_position_ids(route, position_embedding_type):
    """Without position ids, each token takes its position within its own sequence from cu_seq_lens."""
    model = build(encoderstack.EncoderStackForPreTraining, position_embedding_type=position_embedding_type)
    seqs = sequences()
    with torch.no_grad():
        expected = model(**flattened(seqs))
        actual = model(**flattened(seqs, route))
    for name in ("prediction_logits", "seq_relationship_logits"):
        torch.testing.assert_close(getattr(actual, name), getattr(expected, name), atol=0, rtol=0)


@pytest.mark.parametrize("padding_free", [True, False])
def test_the_padded_batch_and_the_flattened_row_agree_on_real_tokens(padding_free):
    """padding_free=False runs the flattened row with a block-diagonal mask instead of one sequence at a time."""
    model = build(encoderstack.EncoderStackForMaskedLM)
    seqs = sequences()
    batch = padded(seqs)
    with torch.no_grad():
        rows = model(**batch).logits[batch["attention_mask"].bool()]
        row = model(**flattened(seqs), padding_free=padding_free).logits[0]
    torch.testing.assert_close(row, rows, atol=1e-5, rtol=0)


def test_flattened_rows_across_a_batch_of_several_rows_are_split_at_every_row_start():
    model = build(encoderstack.EncoderStackForSequenceClassification)
    seqs = sequences((4, 4, 2, 6))
    rows = {
        key: torch.stack([torch.cat([seqs[0][key], seqs[1][key]]), torch.cat([seqs[2][key], seqs[3][key]])])
        for key in ("input_ids", "token_type_ids")
    }
    rows["position_ids"] = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 5]])
    assert_matches_each_sequence_alone(model, encoderstack.EncoderStackForSequenceClassification, rows, seqs)


def test_hidden_states_and_attention_maps_of_a_flattened_row_never_cross_a_sequence():
    model = build(EncoderStackModel, attn_implementation="eager")
    seqs = sequences()
    with torch.no_grad():
        recorded = model(**flattened(seqs), output_hidden_states=True, output_attentions=True)
        alone = [model(**{k: v[None] for k, v in s.items()}, output_hidden_states=True) for s in seqs]
    for layer, hidden in enumerate(recorded.hidden_states):
        torch.testing.assert_close(
            hidden, torch.cat([out.hidden_states[layer] for out in alone], dim=1), atol=1e-5, rtol=0
        )
    same_sequence = torch.block_diag(*[torch.ones(n, n) for n in LENGTHS]).bool()
    for weights in recorded.attentions:
        assert torch.equal(weights[..., ~same_sequence], torch.zeros_like(weights[..., ~same_sequence]))


def test_sequence_level_heads_give_one_row_per_flattened_sequence_and_take_one_label_each():
    model = build(encoderstack.EncoderStackForSequenceClassification)
    seqs = sequences()
    labels = torch.tensor([0, 1, 2, 1, 0])
    with torch.no_grad():
        out = model(**flattened(seqs), labels=labels)
        alone = torch.cat([model(**{k: v[None] for k, v in s.items()}).logits for s in seqs])
    assert out.logits.shape == (len(LENGTHS), 3)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(alone, labels), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"`labels` has shape \(3,\), but the sequences need shape \(5,\)"):
        model(**flattened(seqs), labels=labels[:3])


def test_question_answering_on_flattened_rows_counts_positions_from_each_sequences_start():
    """The same loss as the padded batch of the same sequences, where the positions index each row."""
    model = build(encoderstack.EncoderStackForQuestionAnswering)
    seqs = sequences()
    spans = {"start_positions": torch.tensor([1, 4, 0, 2, 9]), "end_positions": torch.tensor([3, 8, 0, 6, 2])}
    with torch.no_grad():
        expected = model(**padded(seqs), **spans).loss
        actual = model(**flattened(seqs), **spans).loss
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)


def test_multiple_choice_refuses_flattened_rows():
    model = build(encoderstack.EncoderStackForMultipleChoice)
    row = flattened(sequences((3, 3)))
    choices = {key: value.view(1, 2, 3) if key != "position_ids" else value.view(1, 2, 3) for key, value in row.items()}
    choices["position_ids"] = torch.tensor([[[0, 1, 0], [1, 2, 0]]])
    with pytest.raises(ValueError, match="flattened sequences"):
        model(**choices)


def test_a_flattened_row_with_padding_in_the_attention_mask_is_refused():
    model = build(EncoderStackModel)
    row = flattened(sequences((3, 4)))
    mask = torch.ones_like(row["input_ids"])
    mask[0, -1] = 0
    with pytest.raises(ValueError, match="pass a padded batch or flattened rows, not both"):
        model(**row, attention_mask=mask)


def test_left_padding_with_position_ids_counted_from_the_first_real_token_is_a_padded_batch():
    model = build(EncoderStackModel)
    batch = padded(sequences((3, 6)))
    left = {key: value.flip(-1) for key, value in batch.items()}
    left["position_ids"] = (left["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(**left).last_hidden_state
        alone = model(**{key: value[1:] for key, value in left.items()}).last_hidden_state
    torch.testing.assert_close(out[1], alone[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cu_seq_lens_q": torch.tensor([0, 5, 9], dtype=torch.int32)}, r"rising from 0 to the number of tokens \(8\)"),
        ({"cu_seq_lens_q": torch.tensor([0, 6, 3, 8], dtype=torch.int32)}, "rising from 0"),
        (
            {
                "cu_seq_lens_q": torch.tensor([0, 3, 8], dtype=torch.int32),
                "cu_seq_lens_k": torch.tensor([0, 4, 8], dtype=torch.int32),
            },
            "must equal `cu_seq_lens_q`",
        ),
        (
            {"cu_seq_lens_q": torch.tensor([0, 3, 8], dtype=torch.int32), "max_length_q": 4},
            "`max_length_q` is 4, but `cu_seq_lens_q` holds a sequence of 5 tokens",
        ),
    ],
    ids=["wrong total", "decreasing", "k differs", "max too small"],
)
def test_cu_seq_lens_that_do_not_describe_the_row_are_refused(kwargs, message):
    model = build(EncoderStackModel)
    with pytest.raises(ValueError, match=message):
        model(torch.ones(1, 8, dtype=torch.long), **kwargs)


def test_torch_compile_runs_flattened_rows_with_each_sequences_own_outputs():
    model = build(encoderstack.EncoderStackForMaskedLM)
    seqs = sequences()
    compiled = torch.compile(model, backend="eager")
    assert_matches_each_sequence_alone(compiled, encoderstack.EncoderStackForMaskedLM, flattened(seqs), seqs)


def attend_each(query, key, value, cu_seq_q, scale):
    """Packed (tokens, heads, head_dim) q/k/v: each sequence attends to itself alone, in float32."""
    bounds = cu_seq_q.tolist()
    pieces = [
        torch.nn.functional.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1).float() for x in (query, key, value)), scale=scale
        ).transpose(0, 1)
        for a, b in zip(bounds, bounds[1:])
    ]
    return torch.cat(pieces)


def reference_varlen(calls):
    """A CPU stand-in for a varlen kernel: records its arguments and attends within each sequence."""

    def varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=None):
        calls.append(
            {
                "cu_seq_q": cu_seq_q.clone(),
                "cu_seq_k": cu_seq_k.clone(),
                "max_q": max_q,
                "max_k": max_k,
                "shape": tuple(query.shape),
            }
        )
        return attend_each(query, key, value, cu_seq_q, scale).to(query.dtype)

    return varlen


@pytest.mark.parametrize("route", ["padded", "flattened"])
def test_flash_attention_gets_the_packing_through_transformers_kwargs(route, monkeypatch):
    """transformers' flash path reads cu_seq_lens_q/k and max_length_q/k; a stand-in proves what it is given."""
    calls = []
    varlen = reference_varlen(calls)

    def flash_stand_in(
        module,
        query,
        key,
        value,
        attention_mask,
        cu_seq_lens_q=None,
        cu_seq_lens_k=None,
        max_length_q=None,
        max_length_k=None,
        scaling=None,
        dropout=0.0,
        **kwargs,
    ):
        assert attention_mask is None and cu_seq_lens_q is not None and not module.is_causal
        q, k, v = (x.transpose(1, 2).squeeze(0) for x in (query, key, value))
        return varlen(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, scale=scaling)[None], None

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", flash_stand_in)
    model = build(encoderstack.EncoderStackForTokenClassification)
    model.config._attn_implementation = "flash_attention_2"
    seqs = sequences()
    inputs = padded(seqs) if route == "padded" else flattened(seqs)
    with torch.no_grad():
        logits = model(**inputs, padding_free=route == "padded").logits  # flash runs flattened rows packed, always
    assert len(calls) == model.config.num_hidden_layers
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        expected = torch.cat([model(**{k: v[None] for k, v in s.items()}).logits[0] for s in seqs])
    real = inputs["attention_mask"].bool() if route == "padded" else torch.ones(logits.shape[:2], dtype=torch.bool)
    torch.testing.assert_close(logits[real], expected, atol=1e-5, rtol=0)


def features(lengths=LENGTHS, seed=5):
    """Tokenized examples as a dataset holds them, with masked-LM labels (-100 at the first token, as the
    flattening collator sets it, and at a few others)."""
    out = []
    for s in sequences(lengths, seed):
        ids = s["input_ids"].tolist()
        labels = [-100] + [token if i % 2 else -100 for i, token in enumerate(ids[1:])]
        out.append({"input_ids": ids, "labels": labels})
    return out


def padded_features(examples):
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.tensor([e["input_ids"] + [0] * (width - len(e["input_ids"])) for e in examples])
    labels = torch.tensor([e["labels"] + [-100] * (width - len(e["labels"])) for e in examples])
    return {
        "input_ids": ids,
        "attention_mask": (torch.arange(width) < torch.tensor([len(e["input_ids"]) for e in examples])[:, None]).long(),
        "labels": labels,
    }


def loss_and_grads(model, batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("flash_kwargs", [False, True])
@pytest.mark.parametrize("placement", ["post", "pre", "resi_dual"])
def test_the_flattening_collator_trains_with_the_padded_batchs_loss_and_gradients(placement, flash_kwargs):
    model = build(encoderstack.EncoderStackForMaskedLM, norm_placement=placement).train()
    examples = features()
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    loss, grads = loss_and_grads(model, collator(examples))
    expected_loss, expected_grads = loss_and_grads(model, padded_features(examples))
    torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=0)
    for name, grad in expected_grads.items():
        scale = grad.abs().max().clamp(min=1e-12)
        assert (grads[name] - grad).abs().max() / scale < 1e-4, name


def test_trainer_with_the_flattening_collator_accumulates_exactly(tmp_path):
    """Two accumulated steps of two examples update the weights as one step of four (num_items_in_batch)."""
    from transformers import Trainer, TrainingArguments

    examples = features((5, 9, 2, 7), seed=6)
    weights = []
    for batch_size, accumulation in ((4, 1), (2, 2)):
        model = build(encoderstack.EncoderStackForMaskedLM).train()
        args = TrainingArguments(
            output_dir=str(tmp_path / f"run{batch_size}"),
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            max_steps=1,
            learning_rate=1e-2,
            lr_scheduler_type="constant",
            optim="sgd",
            report_to=[],
            use_cpu=True,
            train_sampling_strategy="sequential",
            save_strategy="no",
            logging_strategy="no",
        )
        Trainer(
            model=model,
            args=args,
            train_dataset=examples,
            data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True),
        ).train()
        weights.append({name: p.detach().clone() for name, p in model.named_parameters()})
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_cu_seq_lens_over_several_rows_give_each_token_its_position_in_its_own_sequence():
    model = build(EncoderStackModel)
    seqs = sequences((3, 5, 4, 4))
    rows = {key: torch.cat([s[key] for s in seqs]).view(2, 8) for key in ("input_ids", "token_type_ids")}
    cu_seq_lens = torch.tensor([0, 3, 8, 12, 16], dtype=torch.int32)
    with torch.no_grad():
        expected = per_sequence_outputs(model, EncoderStackModel, seqs)
        actual = model(**rows, cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens)
    torch.testing.assert_close(
        actual.last_hidden_state.view(1, 16, -1), expected["last_hidden_state"], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(actual.pooler_output, expected["pooler_output"], atol=1e-5, rtol=0)
