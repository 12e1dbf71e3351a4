"""transformers' Trainer drives every head: training, evaluation, prediction, checkpoints, compile."""

import pytest
import torch
from conftest import batch, build, head_inputs, head_labels
from transformers import Trainer, TrainingArguments

import encoderstack

HEAD_CASES = [
    (encoderstack.EncoderStackForMaskedLM, {}, ["labels"]),
    (encoderstack.EncoderStackForPreTraining, {}, ["labels", "next_sentence_label"]),
    (encoderstack.EncoderStackForSequenceClassification, {}, ["labels"]),
    (encoderstack.EncoderStackForSequenceClassification, {"num_labels": 1, "problem_type": "regression"}, ["labels"]),
    (encoderstack.EncoderStackForSequenceClassification, {"problem_type": "multi_label_classification"}, ["labels"]),
    (encoderstack.EncoderStackForTokenClassification, {}, ["labels"]),
    (encoderstack.EncoderStackForQuestionAnswering, {}, ["start_positions", "end_positions"]),
    (encoderstack.EncoderStackForMultipleChoice, {}, ["labels"]),
]


def rows(model_class, config):
    inputs = batch(batch_size=8, lengths=(9, 3, 8, 2, 6, 9, 4, 7), seed=3)
    labels = head_labels(model_class, inputs)
    if config.get("problem_type") == "regression":
        labels = {"labels": torch.linspace(-1, 1, 8)}
    if config.get("problem_type") == "multi_label_classification":
        labels = {"labels": (torch.arange(24).view(8, 3) % 2).float()}
    data = {**head_inputs(model_class, inputs), **labels}
    # a column the model does not take: Trainer's remove_unused_columns must drop it
    return [{**{key: value[i] for key, value in data.items()}, "note": f"row {i}"} for i in range(8)]


def arguments(tmp_path, **overrides):
    values = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "num_train_epochs": 2,
        "learning_rate": 0.05,
        "optim": "sgd",
        "lr_scheduler_type": "constant",
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": True,
        "save_strategy": "no",
        "seed": 0,
        "train_sampling_strategy": "sequential",
    }
    values.update(overrides)
    return TrainingArguments(**values)


def ids(case):
    return case.__name__ if isinstance(case, type) else (case.get("problem_type", "") if isinstance(case, dict) else "")  # noqa: E501,E731


@pytest.mark.parametrize("model_class, config, label_names", HEAD_CASES, ids=ids)
def test_trainer_trains_evaluates_and_predicts_every_head(model_class, config, label_names, tmp_path):
    model = build(model_class, **config)
    data = rows(model_class, config)
    trainer = Trainer(model=model, args=arguments(tmp_path), train_dataset=data, eval_dataset=data)
    assert trainer.label_names == label_names
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert after < before
    prediction = trainer.predict(data)
    assert prediction.label_ids is not None and prediction.metrics["test_loss"] == pytest.approx(after)


def weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_resuming_from_a_checkpoint_reproduces_the_uninterrupted_run(tmp_path):
    model_class, config = encoderstack.EncoderStackForTokenClassification, {}
    data = rows(model_class, config)
    whole = build(model_class)
    Trainer(model=whole, args=arguments(tmp_path / "whole", num_train_epochs=4), train_dataset=data).train()

    first = build(model_class)
    args = arguments(tmp_path / "split", num_train_epochs=4, max_steps=4, save_strategy="steps", save_steps=4)
    Trainer(model=first, args=args, train_dataset=data).train()  # stops after half the run, checkpoint at step 4
    resumed = build(model_class, seed=99)  # other weights: everything must come from the checkpoint
    args = arguments(tmp_path / "split", num_train_epochs=4)
    Trainer(model=resumed, args=args, train_dataset=data).train(
        resume_from_checkpoint=str(tmp_path / "split" / "checkpoint-4")
    )
    expected = weights(whole)
    for name, value in weights(resumed).items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0, msg=name)


def test_activation_checkpointing_through_trainer_gives_the_same_weights(tmp_path):
    model_class = encoderstack.EncoderStackForMaskedLM
    data = rows(model_class, {})
    plain, checkpointed = build(model_class), build(model_class)
    Trainer(model=plain, args=arguments(tmp_path / "a"), train_dataset=data).train()
    Trainer(model=checkpointed, args=arguments(tmp_path / "b", gradient_checkpointing=True), train_dataset=data).train()
    expected = weights(plain)
    for name, value in weights(checkpointed).items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0, msg=name)


def test_trainer_with_torch_compile_trains_like_eager(tmp_path):
    model_class = encoderstack.EncoderStackForSequenceClassification
    data = rows(model_class, {})
    eager, compiled = build(model_class), build(model_class)
    Trainer(model=eager, args=arguments(tmp_path / "a", num_train_epochs=1), train_dataset=data).train()
    Trainer(
        model=compiled, args=arguments(tmp_path / "b", num_train_epochs=1, torch_compile=True), train_dataset=data
    ).train()
    expected = weights(eager)
    for name, value in weights(compiled).items():
        torch.testing.assert_close(value, expected[name], atol=1e-5, rtol=0, msg=name)
