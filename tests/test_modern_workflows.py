"""What users do with a converted modern encoder besides calling it: sentence-transformers gives the original's
embeddings, and the ONNX export of a converted ModernBERT keeps its sliding windows (parity on rows longer than the
window). Tiny random models of the families' own classes with a WordPiece tokenizer beside them, no download."""

import pytest
import torch
import transformers
from test_family_workflows import SENTENCES, assert_same_sentence_embeddings, wordpiece

import encoderstack
from encoderstack.exporters import load_exported

LONG_SENTENCES = [" ".join(SENTENCES * 4), SENTENCES[1]]  # about 60 tokens and 8: both sides of a radius of 4
ROPE = {"rope_type": "default", "rope_theta": 40.0}
CONFIGS = {  # model_type -> the family's own fields (a radius-4 window where the family slides)
    "modernbert": {"local_attention": 8, "global_attn_every_n_layers": 2},
    "eurobert": {"num_key_value_heads": 2, "classifier_pooling": "mean"},
    "ultrabert": {"num_key_value_heads": 2, "sliding_window": 4, "prediction_head_size": 24},
    "gte": {"rope_parameters": ROPE},
    "nomic_bert": {"rope_parameters": ROPE},
    "jina_embeddings_v3": {"rope_parameters": ROPE},
}


def modern_folder(folder, family):
    """A tiny base model of the family's own class, weights off their init, with a WordPiece tokenizer beside it."""
    tokenizer = wordpiece(folder)
    specials = {name: getattr(tokenizer, name) for name in ("pad_token_id", "cls_token_id", "sep_token_id")}
    config = transformers.AutoConfig.for_model(
        family, vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=128, bos_token_id=specials["cls_token_id"],
        eos_token_id=specials["sep_token_id"], **specials, **CONFIGS[family],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", CONFIGS)
def test_sentence_transformers_gives_a_converted_modern_encoder_the_originals_embeddings(family, tmp_path):
    assert_same_sentence_embeddings(modern_folder(tmp_path / "source", family), tmp_path, LONG_SENTENCES)


def test_the_onnx_export_of_a_converted_modernbert_keeps_its_sliding_windows(tmp_path):
    source = modern_folder(tmp_path / "source", "modernbert")
    folder = encoderstack.convert(source, tmp_path / "converted")
    exported = encoderstack.export_onnx(folder, tmp_path / "onnx")
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    inputs = dict(tokenizer(LONG_SENTENCES, padding=True, return_tensors="pt"))
    assert inputs["input_ids"].shape[1] > 2 * 4 + 1  # longer than the window: the band changes the numbers
    hidden = torch.as_tensor(load_exported(exported)(**inputs)["last_hidden_state"])
    with torch.no_grad():
        reference = transformers.AutoModel.from_pretrained(source).eval()(**inputs).last_hidden_state
        full = encoderstack.EncoderStackModel.from_pretrained(folder, layer_types=["full_attention"] * 3).eval()
        without_window = full(**inputs).last_hidden_state
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(hidden[real], reference[real], atol=1e-5, rtol=0)
    assert (without_window[real] - reference[real]).abs().max() > 1e-3  # the window mattered
