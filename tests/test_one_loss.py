"""One loss on every path: for every head and problem type, with and without `num_items_in_batch`, the loss does not
depend on how the batch ran (padding-free, padded, recording hidden states or attentions, compiled), labels at padded
positions count for nothing, and on a batch without padding every loss equals BERT's on the same weights."""

from dataclasses import dataclass

import pytest
import torch
import transformers

import encoderstack

VOCAB, SEQ, LENGTHS = 99, 8, (8, 4, 6, 3)


@dataclass(frozen=True)
class Case:
    suffix: str  # the BertFor* / EncoderStackFor* name
    config: tuple = ()  # extra (key, value) pairs of the config
    uses_num_items: bool = True  # whether the head divides by Trainer's `num_items_in_batch`


CASES = {
    "masked-lm": Case("ForMaskedLM"),
    "pretraining": Case("ForPreTraining", uses_num_items=False),  # two losses, two item counts: per-batch means
    "regression": Case("ForSequenceClassification", (("num_labels", 1), ("problem_type", "regression"))),
    "single-label": Case(
        "ForSequenceClassification", (("num_labels", 3), ("problem_type", "single_label_classification"))
    ),
    "multi-label": Case(
        "ForSequenceClassification", (("num_labels", 3), ("problem_type", "multi_label_classification"))
    ),
    "token-classification": Case("ForTokenClassification", (("num_labels", 3),)),
    "question-answering": Case("ForQuestionAnswering", (("num_labels", 2),), uses_num_items=False),
    "multiple-choice": Case("ForMultipleChoice"),
}


def models(case: Case, folder):
    """A tiny BERT of the case's architecture (every weight away from its init) and EncoderStack converted from it."""
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **dict(case.config),
    )
    torch.manual_seed(0)
    bert = getattr(transformers, "Bert" + case.suffix)(config).eval()
    with torch.no_grad():
        for param in bert.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    bert.save_pretrained(folder)
    ours = getattr(encoderstack, "EncoderStack" + case.suffix).from_pretrained(folder, attn_implementation="eager")
    return bert, ours.eval()


def inputs(case: Case, padded: bool) -> dict:
    """Right-padded rows (or full rows), token types, and labels everywhere: at padded positions too, as a user
    writing `labels = input_ids` would."""
    generator = torch.Generator().manual_seed(3)
    batch_size = len(LENGTHS)
    lengths = torch.tensor(LENGTHS if padded else [SEQ] * batch_size)
    mask = (torch.arange(SEQ) < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (batch_size, SEQ), generator=generator) * mask
    types = ((torch.arange(SEQ) >= lengths[:, None] // 2) & mask.bool()).long()
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    name = case.suffix
    if name in ("ForMaskedLM", "ForPreTraining"):
        batch["labels"] = torch.randint(0, VOCAB, (batch_size, SEQ), generator=generator)
        if name == "ForPreTraining":
            batch["next_sentence_label"] = torch.randint(0, 2, (batch_size,), generator=generator)
    elif name == "ForTokenClassification":
        batch["labels"] = torch.randint(0, 3, (batch_size, SEQ), generator=generator)
    elif name == "ForQuestionAnswering":  # the last row's span lies in its padding
        batch["start_positions"] = torch.tensor([1, 0, 2, 5])
        batch["end_positions"] = torch.tensor([6, 3, 4, 7])
    elif name == "ForMultipleChoice":  # consecutive rows are the two choices of one question
        batch = {key: value.view(2, 2, SEQ) for key, value in batch.items()}
        batch["labels"] = torch.tensor([1, 0])
    else:
        problem = dict(case.config)["problem_type"]
        if problem == "regression":
            batch["labels"] = torch.randn(batch_size, generator=generator)
        elif problem == "single_label_classification":
            batch["labels"] = torch.randint(0, 3, (batch_size,), generator=generator)
        else:
            batch["labels"] = torch.randint(0, 2, (batch_size, 3), generator=generator).float()
    return batch


def at_padding_ignored(batch: dict) -> dict:
    """The same batch with every label at a padded position replaced by "ignore"."""
    padding = batch["attention_mask"] == 0
    batch = dict(batch)
    if "labels" in batch and batch["labels"].shape == padding.shape:
        batch["labels"] = batch["labels"].masked_fill(padding, -100)
    if "start_positions" in batch:
        for key in ("start_positions", "end_positions"):
            at_padding = padding.gather(1, batch[key][:, None]).squeeze(1)
            batch[key] = batch[key].masked_fill(at_padding, SEQ)  # outside the sequence: ignored, as in BERT
    return batch


SAME = {"atol": 1e-6, "rtol": 1e-6}  # a few float32 ulps: the paths sum the same terms in another order
NUM_ITEMS = {None: None, "num_items_in_batch": torch.tensor(5)}
PATHS = {
    "padding-free": {"padding_free": True},
    "padded": {"padding_free": False},
    "hidden-states": {"output_hidden_states": True},
    "attentions": {"output_attentions": True},
}


def loss(model, batch, num_items, **flags):
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    with torch.no_grad():
        return model(**batch, **extra, **flags).loss


@pytest.mark.parametrize("num_items", NUM_ITEMS)
@pytest.mark.parametrize("case", CASES)
def test_the_loss_is_the_same_on_every_path_and_ignores_labels_at_padding(case, num_items, tmp_path):
    _, model = models(CASES[case], tmp_path)
    batch, items = inputs(CASES[case], padded=True), NUM_ITEMS[num_items]
    expected = loss(model, at_padding_ignored(batch), items, padding_free=False)
    for path, flags in PATHS.items():
        torch.testing.assert_close(loss(model, batch, items, **flags), expected, **SAME, msg=f"{case}, {path} path")


@pytest.mark.parametrize("case", CASES)
def test_the_compiled_loss_is_the_padding_free_loss(case, tmp_path):
    """One compile per head (each costs seconds): with `num_items_in_batch` wherever the head uses it."""
    spec = CASES[case]
    _, model = models(spec, tmp_path)
    batch, items = inputs(spec, padded=True), NUM_ITEMS["num_items_in_batch" if spec.uses_num_items else None]
    expected = loss(model, batch, items, padding_free=True)
    torch._dynamo.reset()
    torch.testing.assert_close(loss(torch.compile(model, backend="eager"), batch, items), expected, **SAME)


@pytest.mark.parametrize("num_items", NUM_ITEMS)
@pytest.mark.parametrize("case", CASES)
def test_without_padding_every_loss_equals_berts(case, num_items, tmp_path):
    spec = CASES[case]
    bert, model = models(spec, tmp_path)
    batch, items = inputs(spec, padded=False), NUM_ITEMS[num_items]
    with torch.no_grad():
        expected = bert(**batch).loss  # BERT's per-batch mean, which knows nothing of `num_items_in_batch`
    if items is not None and spec.uses_num_items:  # ours: the sum over this batch's items, divided by their count
        expected = expected * batch["labels"].numel() / items
    for path, flags in {"default": {}, **PATHS}.items():
        torch.testing.assert_close(
            loss(model, batch, items, **flags), expected, atol=1e-5, rtol=0, msg=f"{case} on the {path} path"
        )
