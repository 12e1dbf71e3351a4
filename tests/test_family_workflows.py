"""Everything else works on a converted BERT-family folder: continued pre-training and packed fine-tuning (flattened
rows numbered from RoBERTa's offset), fine-tuning end to end, sentence-transformers, the diagnostics, the push card
check, ONNX int8 and ALBERT's ONNX export. Tiny random models of the families' own classes and tiny data, as in
test_convert_family.py."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_convert_family import (
    FAMILIES,
    FAMILY_FIELDS,
    OFFSET_FAMILIES,
    PAD,
    byte_level_bpe,
    family_folder,
    right_padded_batch,
)
from test_finetune import packed_and_padded_runs

import encoderstack
from encoderstack.conversion.keymap import FAMILIES as REGISTRY
from encoderstack.diagnostics import gradient_norms_per_layer
from encoderstack.diagnostics.corpus import stdlib_corpus
from encoderstack.finetune import finetune
from encoderstack.hub import check_folder
from encoderstack.pretrain import pretrain
from encoderstack.training import flattening_collator

SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Normalization decides how gradients flow.", "The dog."]


@pytest.fixture(scope="module")
def masked_lm(tmp_path_factory):
    """family -> a converted masked LM of it (positions from pad + 1 = 2, 64 of them) and its source, each once."""
    cache = {}

    def get(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(family)
            source = tokenized_folder(root / "source", family, "ForMaskedLM")
            cache[family] = source, encoderstack.convert(source, root / "converted")
        return cache[family]

    return get


@pytest.fixture(scope="module")
def roberta(masked_lm):
    return masked_lm("roberta")


def write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_flattened_rows_from_the_training_collator_give_a_roberta_the_padded_reference_loss(roberta):
    source, folder = roberta
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    examples = [{"input_ids": ids} for ids in tokenizer(SENTENCES)["input_ids"]]
    for example in examples:
        example["labels"] = [token if i % 3 == 1 else -100 for i, token in enumerate(example["input_ids"])]
    flattened = flattening_collator()(examples)
    padded = transformers.DataCollatorForTokenClassification(tokenizer, label_pad_token_id=-100)(examples)
    reference = transformers.RobertaForMaskedLM.from_pretrained(source).eval()
    with torch.no_grad():
        ours = encoderstack.EncoderStackForMaskedLM.from_pretrained(folder).eval()(**flattened).loss
        expected = reference(**padded).loss
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_a_flattened_row_longer_than_the_positions_is_fine_when_each_sequence_fits(roberta):
    _, folder = roberta
    model = encoderstack.EncoderStackForMaskedLM.from_pretrained(folder).eval()
    examples = [{"input_ids": [0, *range(5, 35), 2]} for _ in range(3)]  # 3 x 32 tokens: a row of 96 > 64 positions
    with torch.no_grad():
        row = model(**flattening_collator()(examples)).logits
        alone = model(input_ids=torch.tensor([examples[0]["input_ids"]])).logits
    torch.testing.assert_close(row[:, 64:], alone, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"Sequence length 65 exceeds the 64 learned positions"):
        model(**flattening_collator()([{"input_ids": list(range(5, 70))}]))


RELATIVE_TERM_CARDS = {  # what the card says of each family's relative term
    "mpnet": "learned relative-position bias in every layer's scores (32 buckets",
    "deberta-v2": "DeBERTa's disentangled attention (c2p+p2c, 8 log buckets",
}


def short_pretrain(model, tmp_path) -> dict:
    """Four steps of continued masked-LM pre-training on a little real text, into tmp_path / "out"."""
    corpus = stdlib_corpus(tmp_path / "corpus.txt", max_bytes=6_000)
    settings = {"max_length": 32, "batch_size": 8, "max_steps": 4, "eval_steps": 2, "lr": 3e-3, "seed": 0}
    return pretrain(model=model, train=corpus, output=tmp_path / "out", **settings)


@pytest.mark.parametrize("family", ["roberta", "mpnet", "deberta-v2"])
def test_continued_pretraining_of_a_converted_family_model_lowers_its_eval_loss_and_its_card_names_the_family(
    masked_lm, family, tmp_path
):
    _, folder = masked_lm(family)
    record = short_pretrain(folder, tmp_path)
    assert record["eval_loss_after"] < record["eval_loss_before"]
    config = encoderstack.EncoderStackConfig.from_pretrained(tmp_path / "out")
    assert config.head_layout == REGISTRY[family].head_layout
    assert config.position_offset == (PAD + 1 if family in OFFSET_FAMILIES else None)
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"- {family}\n" in card
    for other, term in RELATIVE_TERM_CARDS.items():
        assert (term in card) == (family == other)


def test_a_converted_mpnet_switched_to_pre_ln_trains_with_its_relative_bias(masked_lm, tmp_path):
    """The placement stays a config choice: the converted weights under pre-LN (a fresh final norm) continue
    pre-training, and the relative-position bias learns with the rest."""
    _, folder = masked_lm("mpnet")
    config = encoderstack.EncoderStackConfig.from_pretrained(folder)
    config.norm_placement = "pre"
    encoderstack.EncoderStackForMaskedLM.from_pretrained(folder, config=config).save_pretrained(tmp_path / "pre")
    transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(tmp_path / "pre")
    before = load_file(tmp_path / "pre" / "model.safetensors")["model.relative_attention.bias.weight"]
    record = short_pretrain(tmp_path / "pre", tmp_path)
    assert record["eval_loss_after"] < record["eval_loss_before"]
    trained = encoderstack.EncoderStackConfig.from_pretrained(tmp_path / "out")
    assert (trained.norm_placement, trained.relative_attention) == ("pre", "bias")
    after = load_file(tmp_path / "out" / "model.safetensors")["model.relative_attention.bias.weight"]
    assert not torch.equal(after, before)


def test_packed_token_classification_on_a_converted_roberta_ends_where_the_padded_run_does(roberta, tmp_path):
    _, folder = roberta
    rows = [
        {"tokens": ["The", "quick", "fox", "jumps"][: 2 + i % 3], "tags": ["O", "B-X", "I-X", "O"][: 2 + i % 3]}
        for i in range(6)
    ]
    runs = packed_and_padded_runs(folder, write(tmp_path / "tags.jsonl", rows), tmp_path, lr=0.1)
    assert runs[True]["after"]["loss"] == pytest.approx(runs[False]["after"]["loss"], abs=1e-5)
    assert runs[True]["after"]["loss"] < runs[True]["before"]["loss"]


def wordpiece(folder):
    """A small WordPiece tokenizer as ELECTRA's and DistilBERT's, saved; DistilBERT's returns no token types."""
    from tokenizers import BertWordPieceTokenizer

    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(
        SENTENCES * 10, vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    )
    tokenizer = transformers.BertTokenizerFast(
        tokenizer_object=wordpiece._tokenizer, model_input_names=["input_ids", "attention_mask"]
    )
    tokenizer.save_pretrained(folder)
    return tokenizer


def sentencepiece_unigram(folder):
    """A small SentencePiece-style Unigram tokenizer as DeBERTa-v3's (specials [PAD] [UNK] [CLS] [SEP] [MASK]: pad id
    0; [CLS] text [SEP]), trained by `tokenizers` (transformers 5 builds DebertaV2Tokenizer from the pieces and their
    scores; the `sentencepiece` package, which would write an spm.model, is not needed), saved."""
    from tokenizers import SentencePieceUnigramTokenizer

    unigram = SentencePieceUnigramTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    unigram.train_from_iterator(SENTENCES * 10, vocab_size=120, special_tokens=specials, unk_token="[UNK]")
    pieces = [tuple(piece) for piece in json.loads(unigram._tokenizer.to_str())["model"]["vocab"]]
    tokenizer = transformers.DebertaV2Tokenizer(vocab=pieces)
    tokenizer.save_pretrained(folder)
    return tokenizer


TOKENIZERS = {"deberta-v2": sentencepiece_unigram}  # the others: byte-level BPE for RoBERTa's kin, else WordPiece


def tokenized_folder(folder, family, suffix="Model"):
    """A tiny model of the family's own class with a tokenizer as the family's beside it: byte-level BPE for
    RoBERTa's kin (pad id 1), a SentencePiece Unigram for DeBERTa, WordPiece for ELECTRA and DistilBERT (pad id 0)."""
    tokenizer = TOKENIZERS.get(family, byte_level_bpe if family in OFFSET_FAMILIES else wordpiece)(folder)
    shared = {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37,
        "hidden_dim": 37, "embedding_size": 16, "max_position_embeddings": 66, "type_vocab_size": 1,
    }  # fmt: skip
    config = transformers.AutoConfig.for_model(
        family, **{**shared, **FAMILY_FIELDS.get(family, {})}, vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id, num_labels=2,
    )  # fmt: skip
    torch.manual_seed(0)
    getattr(transformers, FAMILIES[family] + suffix)(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", ["roberta", "electra", "distilbert", "albert", "deberta-v2"])
def test_fine_tuning_a_converted_family_model_trains_saves_reloads_and_its_card_names_the_family(family, tmp_path):
    source = tokenized_folder(tmp_path / "source", family)
    folder = encoderstack.convert(source, tmp_path / "converted")
    rows = [{"text": text, "label": "dog" if "dog" in text else "other"} for text in SENTENCES * 4]
    data = write(tmp_path / "data.jsonl", rows)
    record = finetune(folder, tmp_path / "out", train=data, eval=data, epochs=3, batch_size=4, lr=1e-2)
    assert record["after"]["loss"] < record["before"]["loss"]
    model = encoderstack.EncoderStackForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    assert model.config.head_layout == REGISTRY[family].head_layout
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")  # the family's tokenizer travelled
    assert (
        tokenizer("The dog.")["input_ids"]
        == transformers.AutoTokenizer.from_pretrained(source)("The dog.")["input_ids"]
    )
    with torch.no_grad():
        logits = model(**tokenizer(SENTENCES, padding=True, return_tensors="pt")).logits
    assert logits.shape == (3, 2)
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"- {family}\n" in card


def test_a_sentence_transformers_mpnet_folder_converts_to_the_same_normalized_mean_pooled_embeddings(tmp_path):
    """all-mpnet-base-v2's layout, built locally from a tiny random MPNet: Transformer, mean Pooling, Normalize. The
    converted folder keeps the modules and gives the same unit embeddings, on padded batches of unequal sentences."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(str(tokenized_folder(tmp_path / "source", "mpnet")))
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    original = SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu")
    original.save(str(tmp_path / "st"))
    folder = encoderstack.convert(tmp_path / "st", tmp_path / "converted")
    ours = SentenceTransformer(str(folder), device="cpu")
    assert [type(module).__name__ for module in ours] == ["Transformer", "Pooling", "Normalize"]
    assert type(ours[0].auto_model).__name__ == "EncoderStackModel"
    expected = original.encode(SENTENCES, convert_to_tensor=True)
    got = ours.encode(SENTENCES, convert_to_tensor=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(SENTENCES)))


def assert_same_sentence_embeddings(source, tmp_path, sentences=SENTENCES):
    """sentence-transformers on the converted folder gives the source folder's embeddings, within 1e-5."""
    import sentence_transformers

    folder = encoderstack.convert(source, tmp_path / "converted")
    original = sentence_transformers.SentenceTransformer(str(source), device="cpu")
    ours = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    assert type(ours[0].auto_model).__name__ == "EncoderStackModel"
    expected = original.encode(sentences, convert_to_tensor=True)
    torch.testing.assert_close(ours.encode(sentences, convert_to_tensor=True), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_sentence_transformers_gives_a_converted_family_model_the_originals_embeddings(family, tmp_path):
    assert_same_sentence_embeddings(tokenized_folder(tmp_path / "source", family), tmp_path)


@pytest.mark.parametrize("family", ["roberta", "electra", "distilbert"])
def test_the_diagnostics_measure_a_converted_family_model_and_its_folder_passes_the_push_check(family, tmp_path):
    folder = encoderstack.convert(family_folder(tmp_path / "source", family, "ForMaskedLM"), tmp_path / "converted")
    check_folder(folder)  # what `push` checks before any request, the card included
    model = encoderstack.EncoderStackForMaskedLM.from_pretrained(folder)
    ids = torch.tensor([[0, 5, 6, 7, 8, 2], [0, 9, 10, 2, PAD, PAD]])
    mask = (ids != PAD).long()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    norms = gradient_norms_per_layer(model, batch)
    assert len(norms) == 2 and all(norm > 0 and norm == norm for norm in norms)


@pytest.mark.parametrize("family", ["mpnet", "deberta-v2"])
def test_a_converted_family_exports_to_onnx_at_float32_parity_with_its_relative_term(masked_lm, family, tmp_path):
    from encoderstack.exporters import RECORD, load_exported

    _, folder = masked_lm(family)
    exported = encoderstack.export_onnx(folder, tmp_path / "onnx")
    rows = json.loads((exported / RECORD).read_text())["parity"]["results"]["onnxruntime"]
    assert all(row["max_abs_diff"] <= 1e-4 for row in rows)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    inputs = dict(tokenizer([*SENTENCES, "Short."], padding=True, return_tensors="pt"))  # not the verified batch
    logits = torch.as_tensor(load_exported(exported)(**inputs)["logits"])
    with torch.no_grad():
        expected = encoderstack.EncoderStackForMaskedLM.from_pretrained(folder).eval()(**inputs).logits
    real = inputs["attention_mask"].bool()
    assert (logits[real] - expected[real]).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["roberta", "roberta-prelayernorm", "xlm-roberta-xl"])
def test_onnx_int8_export_of_a_converted_post_or_pre_ln_roberta_keeps_its_argmax(family, roberta, tmp_path):
    from encoderstack.exporters import load_exported

    source = roberta[0] if family == "roberta" else tokenized_folder(tmp_path / "source", family, "ForMaskedLM")
    folder = roberta[1] if family == "roberta" else encoderstack.convert(source, tmp_path / "converted")
    exported = encoderstack.export_onnx(folder, tmp_path / "onnx", quantize="int8")
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    inputs = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))  # no token types: nor does the graph
    logits = torch.as_tensor(load_exported(exported)(**inputs)["logits"])
    with torch.no_grad():
        expected = encoderstack.EncoderStackForMaskedLM.from_pretrained(folder).eval()(**inputs).logits
    real = inputs["attention_mask"].bool()
    assert (logits[real].argmax(-1) == expected[real].argmax(-1)).float().mean() >= 0.9


def test_a_converted_albert_pre_training_model_exports_to_onnx_with_the_references_logits(tmp_path):
    """Its masked-LM and sentence-order logits, through the shared layers, as `AlbertForPreTraining` gives them."""
    from encoderstack.exporters import RECORD, load_exported

    source = family_folder(tmp_path / "albert", "albert", "ForPreTraining")
    folder = encoderstack.convert(source, tmp_path / "es", verify=False)
    exported = encoderstack.export_onnx(folder, tmp_path / "onnx")
    rows = json.loads((exported / RECORD).read_text())["parity"]["results"]["onnxruntime"]
    assert {row["output"] for row in rows} == {"prediction_logits", "sop_logits"}
    assert all(row["max_abs_diff"] <= 1e-5 for row in rows)
    inputs, _ = right_padded_batch("ForPreTraining", "albert")
    outputs = load_exported(exported)(**inputs, token_type_ids=torch.zeros_like(inputs["input_ids"]))
    with torch.no_grad():
        expected = transformers.AlbertForPreTraining.from_pretrained(source).eval()(**inputs)
    mask = inputs["attention_mask"].bool()
    logits = torch.as_tensor(outputs["prediction_logits"])[mask]
    torch.testing.assert_close(logits, expected.prediction_logits[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.as_tensor(outputs["sop_logits"]), expected.sop_logits, atol=1e-5, rtol=0)


def test_continued_masked_lm_pretraining_of_a_converted_albert_keeps_one_stored_layer(tmp_path):
    """`pretrain` (masked LM) from ALBERT's pre-training checkpoint: Trainer's checkpoints and the output folder keep
    the one shared layer, and the eval loss falls."""
    source = tokenized_folder(tmp_path / "source", "albert", "ForPreTraining")
    folder = encoderstack.convert(source, tmp_path / "converted")
    settings = {"max_length": 32, "batch_size": 8, "max_steps": 4, "eval_steps": 2, "lr": 3e-3, "seed": 0}
    corpus = stdlib_corpus(tmp_path / "corpus.txt", max_bytes=6_000)
    record = pretrain(model=folder, train=corpus, output=tmp_path / "out", **settings)
    assert record["eval_loss_after"] < record["eval_loss_before"]
    model = encoderstack.EncoderStackForMaskedLM.from_pretrained(tmp_path / "out")
    assert (model.config.num_hidden_layers, len(model.model.layers), model.config.head_layout) == (2, 1, "albert")
