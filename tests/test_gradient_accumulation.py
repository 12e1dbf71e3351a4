"""Under Trainer's gradient accumulation every head makes the same update as one step on the combined batch.

Plain SGD, because Adam's normalization would hide a wrongly scaled loss; dropout off; the same samples in the
same order. The micro-batches deliberately differ in how many label positions they hold, which is what breaks a
plain per-batch mean."""

import pytest
import torch
from conftest import build, head_inputs, head_labels
from transformers import Trainer, TrainingArguments

import encoderstack

LENGTHS = (9, 3, 8, 2, 6, 9, 4, 7)


def rows(model_class, **config):
    from conftest import batch

    inputs = batch(batch_size=8, lengths=LENGTHS, seed=3)
    labels = head_labels(model_class, inputs, num_labels=config.get("num_labels", 3))
    if config.get("problem_type") == "regression":
        labels = {"labels": torch.linspace(-1, 1, 8)}
    if config.get("problem_type") == "multi_label_classification":
        labels = {"labels": (torch.arange(24).view(8, 3) % 2).float()}
    if model_class is encoderstack.EncoderStackForQuestionAnswering:
        # Spans inside each sequence, as real data has them: a target at padding is ignored (it never enters the
        # loss), and a per-batch mean over unequal counts of ignored targets is not what this test is about.
        last = torch.tensor(LENGTHS) - 1
        labels = {key: value.minimum(last) for key, value in labels.items()}
    if model_class is encoderstack.EncoderStackForPreTraining:
        # This head averages per micro-batch (see its docstring), exact when micro-batches hold as many
        # masked tokens as each other: keep 2 per sequence.
        labels["labels"] = labels["labels"].masked_fill(torch.arange(9) >= 2, -100)
    data = {**head_inputs(model_class, inputs), **labels}
    return [{key: value[i] for key, value in data.items()} for i in range(8)]


def train_one_step(model_class, tmp_path, per_device, accumulation, **config):
    model = build(model_class, **config).train()
    args = TrainingArguments(
        output_dir=str(tmp_path / f"run{accumulation}"),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    Trainer(model=model, args=args, train_dataset=rows(model_class, **config)).train()
    return {name: param.detach().clone() for name, param in model.named_parameters()}


CASES = [
    (encoderstack.EncoderStackForMaskedLM, {}),
    (encoderstack.EncoderStackForPreTraining, {}),
    (encoderstack.EncoderStackForSequenceClassification, {}),
    (encoderstack.EncoderStackForSequenceClassification, {"num_labels": 1, "problem_type": "regression"}),
    (encoderstack.EncoderStackForSequenceClassification, {"problem_type": "multi_label_classification"}),
    (encoderstack.EncoderStackForTokenClassification, {}),
    (encoderstack.EncoderStackForQuestionAnswering, {}),
    (encoderstack.EncoderStackForMultipleChoice, {}),
]


@pytest.mark.parametrize(
    "model_class, config", CASES, ids=lambda c: c.__name__ if isinstance(c, type) else c.get("problem_type", "")
)
def test_two_accumulated_micro_batches_update_like_one_batch(model_class, config, tmp_path):
    start = {name: p.detach().clone() for name, p in build(model_class, **config).named_parameters()}
    whole = train_one_step(model_class, tmp_path, per_device=8, accumulation=1, **config)
    accumulated = train_one_step(model_class, tmp_path, per_device=4, accumulation=2, **config)
    moved = max((whole[name] - start[name]).abs().max().item() for name in start)
    assert moved > 1e-3  # the step did something worth comparing
    for name in whole:
        torch.testing.assert_close(accumulated[name], whole[name], atol=1e-6, rtol=0, msg=name)
