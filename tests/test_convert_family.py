"""The BERT family converts with parity: the conversion matrix (family x head x backend x padding side) against each
family's own transformers class, built tiny and random (no download): RoBERTa, XLM-R, CamemBERT, the pre-LN RoBERTas,
ELECTRA (narrower embeddings, its discriminator and generator), DistilBERT, MPNet (a relative-position bias in
every layer's scores), ALBERT (shared layers, its sentence-order pre-training head), DeBERTa-v3 and DeBERTa v1
(disentangled attention, no absolute positions)."""

import json
import re
from functools import partial

import pytest
import torch
import transformers
from conftest import real
from safetensors.torch import load_file, save_file

import encoderstack
from encoderstack.configuration_encoderstack import HEAD_LAYOUTS
from encoderstack.conversion.keymap import FAMILIES as REGISTRY
from encoderstack.conversion.keymap import TASKS


def suffixes(family: str) -> tuple:
    """The suffixes of the transformers classes of every head the family declares (ELECTRA's discriminator:
    ForPreTraining)."""
    declared = REGISTRY[family]
    return tuple(
        declared.architecture(TASKS[task]).removeprefix(declared.architecture_prefix) for task in declared.tasks
    )


TESTED_HERE = (
    "roberta",
    "xlm-roberta",
    "camembert",
    "roberta-prelayernorm",
    "xlm-roberta-xl",
    "electra",
    "distilbert",
    "mpnet",
    "albert",
    "deberta-v2",
    "deberta",
)
FAMILIES = {name: REGISTRY[name].architecture_prefix for name in TESTED_HERE}  # model_type -> its classes' prefix
OFFSET_FAMILIES = ("roberta", "xlm-roberta", "camembert", "roberta-prelayernorm", "xlm-roberta-xl", "mpnet")
SUFFIXES = (
    "Model",
    "ForMaskedLM",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
)
MATRIX = [(family, suffix) for family in FAMILIES for suffix in suffixes(family)]
OUTPUTS = (
    "last_hidden_state",
    "pooler_output",
    "logits",
    "prediction_logits",
    "sop_logits",
    "start_logits",
    "end_logits",
)
PAD = 1  # RoBERTa's pad_token_id: positions count from 2


# DeBERTa-v3's layout, its buckets small enough that the test's 10-12 tokens reach the log buckets and their clamp
DEBERTA_V3 = {
    "relative_attention": True,
    "position_buckets": 8,
    "max_relative_positions": 8,
    "pos_att_type": "p2c|c2p",
    "share_att_key": True,
    "norm_rel_ebd": "layer_norm",
    "position_biased_input": False,
    "type_vocab_size": 0,
    "embedding_size": 32,
}
# DeBERTa v1's layout (deberta-base's: no absolute positions), its distances clamped at 6
DEBERTA_V1 = {
    "relative_attention": True,
    "max_relative_positions": 6,
    "pos_att_type": "c2p|p2c",
    "position_biased_input": False,
    "type_vocab_size": 0,
    "embedding_size": 32,
}
FAMILY_FIELDS = {"deberta-v2": DEBERTA_V3, "deberta": DEBERTA_V1}  # where a family's tiny config differs


def family_folder(folder, family, suffix, seed=0, **fields):
    """A randomly initialized model of the family's own class, saved as a checkpoint folder."""
    shared = {
        "vocab_size": 99,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 37,
        "max_position_embeddings": 20,
        "type_vocab_size": 1,
        "embedding_size": 16,  # ELECTRA's and ALBERT's: a projection to the hidden size
        "hidden_dim": 37,  # DistilBERT's intermediate size
        "layer_norm_eps": 1e-5,
        "pad_token_id": PAD,
        "num_labels": 2 if suffix in ("ForQuestionAnswering", "ForPreTraining") else 3,  # ALBERT's sentence order: 2
    }
    config = transformers.AutoConfig.for_model(family, **{**shared, **FAMILY_FIELDS.get(family, {}), **fields})
    return save_random(getattr(transformers, FAMILIES[family] + suffix), config, folder, seed)


def save_random(model_class, config, folder, seed=0):
    """A model of `model_class`, its weights moved away from the init so that no weight is trivially 0 or 1, saved as
    a checkpoint folder."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(family, suffix) -> (reference, converted), each converted once for the whole matrix."""
    cache = {}

    def get(family, suffix):
        if (family, suffix) not in cache:
            root = tmp_path_factory.mktemp(f"{family}-{suffix}")
            source = family_folder(root / "source", family, suffix)
            cache[family, suffix] = converted_pair(
                source, root / "out", getattr(transformers, FAMILIES[family] + suffix)
            )
        return cache[family, suffix]

    return get


def converted_pair(source, output, reference_class):
    """The source loaded by its own class, and converted (without verification) and loaded by ours, in eval mode."""
    folder = encoderstack.convert(source, output, verify=False)
    class_name = json.loads((folder / "config.json").read_text())["architectures"][0]
    return reference_class.from_pretrained(source).eval(), getattr(encoderstack, class_name).from_pretrained(
        folder
    ).eval()


def right_padded_batch(suffix, family=None):
    """Ids that are never the pad id (RoBERTa's reference counts positions by the ids), padding at the pad id, and
    every label the head takes (-100 at padding; one per row for sequence-level heads). `ForPreTraining` is ELECTRA's
    discriminator, or, for a `family` whose pre-training head is masked LM and sentence order, ALBERT's."""
    generator = torch.Generator().manual_seed(5)
    lengths = torch.tensor([10, 6, 3, 8])
    mask = (torch.arange(10) < lengths[:, None]).long()
    ids = torch.randint(PAD + 1, 99, (4, 10), generator=generator).masked_fill(mask == 0, PAD)
    per_token = torch.randint(0, 3, (4, 10), generator=generator).masked_fill(mask == 0, -100)
    per_row = torch.randint(0, 2, (4,), generator=generator)
    labels = {
        "Model": {},
        "ForMaskedLM": {"labels": per_token},
        "ForSequenceClassification": {"labels": per_row},
        "ForTokenClassification": {"labels": per_token},
        "ForQuestionAnswering": {
            "start_positions": torch.tensor([1, 0, 2, 5]),
            "end_positions": torch.tensor([3, 5, 2, 7]),
        },
        "ForMultipleChoice": {"labels": per_row[:2]},
        "ForNextSentencePrediction": {"labels": per_row},  # a BERT-layout family's
        "ForPreTraining": {"labels": torch.randint(0, 2, (4, 10), generator=generator)},  # replaced or not
    }[suffix]
    if suffix == "ForPreTraining" and family is not None and REGISTRY[family].has(TASKS["pretraining"]):
        labels = {"labels": per_token, "sentence_order_label": per_row}
    return {"input_ids": ids, "attention_mask": mask}, labels


def to_left(inputs, labels):
    """The same rows with their padding moved to the front; per-token labels move with their tokens, span positions
    shift by the padding put before them."""
    shifts = (inputs["attention_mask"].shape[-1] - inputs["attention_mask"].sum(-1)).tolist()
    roll = lambda t: torch.stack([row.roll(shift) for row, shift in zip(t, shifts)])  # noqa: E731
    left = {key: roll(value) for key, value in inputs.items()}
    moved = {}
    for key, value in labels.items():
        if value.dim() == 2:
            moved[key] = roll(value)
        elif key.endswith("_positions"):
            moved[key] = value + torch.tensor(shifts)
        else:
            moved[key] = value
    return left, moved


def as_choices(suffix, inputs):
    return {k: v.view(2, 2, -1) for k, v in inputs.items()} if suffix == "ForMultipleChoice" else inputs


def reference_choices(family, suffix, inputs):
    """`as_choices`, except that DistilBertForMultipleChoice flattens every input but `position_ids`: it takes them
    flat, one row per choice (given per choice, its embeddings fail to broadcast)."""
    choices = as_choices(suffix, inputs)
    if family == "distilbert" and "position_ids" in inputs:
        choices["position_ids"] = inputs["position_ids"]
    return choices


def main_outputs(outputs, mask):
    return {name: real(getattr(outputs, name), mask) for name in OUTPUTS if getattr(outputs, name, None) is not None}


def bert_positions_of_left_padding(inputs):
    """The positions BERT-style families give the tokens of the left-padded rows (counted along the row)."""
    shifts = inputs["attention_mask"].shape[-1] - inputs["attention_mask"].sum(-1, keepdim=True)
    return torch.arange(inputs["attention_mask"].shape[-1]) + shifts


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize(("family", "suffix"), MATRIX)
def test_every_family_head_backend_and_padding_side_converts_with_parity(converted, family, suffix, backend, side):
    """The reference runs right-padded (under left padding it would pool a padding token), where BERT-style positions
    are given the values they have in the left-padded rows."""

    def reference_inputs(inputs):
        if side == "left" and family not in OFFSET_FAMILIES:
            inputs = {**inputs, "position_ids": bert_positions_of_left_padding(inputs)}
        return reference_choices(family, suffix, inputs)

    batch = partial(right_padded_batch, family=family)
    assert_parity(*converted(family, suffix), suffix, backend, side, reference_inputs, batch=batch)


def assert_parity(reference, ours, suffix, backend, side, reference_inputs=None, batch=None, ours_only=()):
    """The reference on the right-padded batch (`reference_inputs` shapes its inputs; `batch` builds it, default
    `right_padded_batch`); ours on `side`, once recording hidden states and attentions (the padded path) and once
    without (padding-free), with labels: every output (ours has `ours_only` besides), every hidden state and attention
    map on real tokens, and the loss, within 1e-5."""
    reference.set_attn_implementation(backend)
    ours.set_attn_implementation(backend)
    inputs, labels = (batch or right_padded_batch)(suffix)
    mask = inputs["attention_mask"].bool()
    mine, my_labels = (inputs, labels) if side == "right" else to_left(inputs, labels)
    my_mask = mine["attention_mask"].bool()
    eager = backend == "eager"
    with torch.no_grad():
        record = {"output_hidden_states": True, "output_attentions": eager}
        expected = reference(**(reference_inputs or partial(as_choices, suffix))(inputs), **labels, **record)
        recorded = ours(**as_choices(suffix, mine), **my_labels, **record)
        free = ours(**as_choices(suffix, mine), **my_labels)
    want = main_outputs(expected, mask)
    for actual in (recorded, free):
        got = main_outputs(actual, my_mask)
        assert got.keys() == want.keys() | set(ours_only)
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=name)
    for a, e in zip(recorded.hidden_states, expected.hidden_states, strict=True):
        torch.testing.assert_close(real(a, my_mask), real(e, mask), atol=1e-5, rtol=0)
    if eager:
        for a, e in zip(recorded.attentions, expected.attentions, strict=True):
            for row in range(mask.shape[0]):  # real queries and real keys, in the same order on either side
                mine_row = a[row][:, my_mask[row]][:, :, my_mask[row]]
                torch.testing.assert_close(mine_row, e[row][:, mask[row]][:, :, mask[row]], atol=1e-5, rtol=0)
    if labels and suffix != "ForQuestionAnswering":  # BERT-style QA takes span logits at padding into its loss
        torch.testing.assert_close(free.loss, expected.loss, atol=1e-5, rtol=0, msg="loss")
        torch.testing.assert_close(recorded.loss, expected.loss, atol=1e-5, rtol=0, msg="loss")


# DeBERTa-v2's own variants: position projections of their own (share_att_key off), each term alone, absolute
# positions and token types at the input, distances without buckets (clamped at 6), the masked-LM head of legacy=false
DEBERTA_V2 = {
    **DEBERTA_V3,
    "share_att_key": False,
    "position_biased_input": True,
    "type_vocab_size": 2,
    "position_buckets": -1,
    "max_relative_positions": 6,
    "norm_rel_ebd": "none",
}
DEBERTA_VARIANTS = {
    "c2p-and-p2c": DEBERTA_V2,
    "c2p-only": {**DEBERTA_V2, "pos_att_type": "c2p"},
    "p2c-only": {**DEBERTA_V2, "pos_att_type": ["p2c"]},
    "v3-shared-keys-c2p-only": {**DEBERTA_V3, "pos_att_type": "c2p"},
    "v3-lm-predictions": {**DEBERTA_V3, "legacy": False},
}


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("variant", DEBERTA_VARIANTS)
def test_each_deberta_variant_converts_with_parity_on_both_padding_sides(tmp_path, variant, side):
    source = family_folder(tmp_path / "source", "deberta-v2", "ForMaskedLM", **DEBERTA_VARIANTS[variant])
    reference, ours = converted_pair(source, tmp_path / "out", transformers.DebertaV2ForMaskedLM)
    config = ours.config
    assert config.share_att_key == (variant.startswith("v3")) and config.relative_attention == "disentangled"
    assert (config.position_embedding_type is None) == variant.startswith("v3")

    def reference_inputs(inputs):
        return {**inputs, "position_ids": bert_positions_of_left_padding(inputs)} if side == "left" else inputs

    assert_parity(reference, ours, "ForMaskedLM", "sdpa", side, reference_inputs)


@pytest.mark.parametrize("family", FAMILIES)
def test_question_answering_loss_without_padding_equals_the_familys(converted, family):
    reference, ours = converted(family, "ForQuestionAnswering")
    inputs, labels = right_padded_batch("ForQuestionAnswering")
    full = {"input_ids": inputs["input_ids"].masked_fill(inputs["input_ids"] == PAD, 5)}
    with torch.no_grad():
        torch.testing.assert_close(ours(**full, **labels).loss, reference(**full, **labels).loss, atol=1e-5, rtol=0)


@pytest.mark.parametrize("suffix", ["Model", "ForTokenClassification", "ForMaskedLM"])
@pytest.mark.parametrize("family", ["roberta", "xlm-roberta-xl", "mpnet", "albert", "deberta-v2", "deberta"])
def test_flattened_rows_give_each_sequence_what_the_familys_class_gives_it_alone(converted, family, suffix):
    reference, ours = converted(family, suffix)
    ids = torch.randint(PAD + 1, 99, (1, 12), generator=torch.Generator().manual_seed(7))
    bounds = (0, 5, 7, 12)
    with torch.no_grad():
        flattened = ours(input_ids=ids, cu_seq_lens_q=torch.tensor(bounds), max_length_q=5)
        name = "last_hidden_state" if suffix == "Model" else "logits"
        alone = [getattr(reference(input_ids=ids[:, a:b]), name)[0] for a, b in zip(bounds, bounds[1:])]
    torch.testing.assert_close(getattr(flattened, name)[0], torch.cat(alone), atol=1e-5, rtol=0)


def test_every_declared_family_has_a_parity_test_and_declares_its_layout_export_and_reference_truly():
    from test_convert_modern import FAMILIES as MODERN
    from test_convert_rope_families import FAMILIES as ROPE

    # bert and megatron-bert: test_convert_bert.py; neobert: against its transcription (test_convert_modern.py)
    assert sorted({"bert", "megatron-bert", "neobert", *FAMILIES, *MODERN, *ROPE}) == sorted(REGISTRY)
    for name, family in REGISTRY.items():
        assert family.head_layout in HEAD_LAYOUTS, name
        assert family.transformers_reference == hasattr(transformers, family.architecture(TASKS["fill-mask"])), name
        if family.export_config:
            assert getattr(transformers, family.export_config).model_type == name


def test_the_conversion_accounts_for_every_roberta_tensor_and_records_the_family_and_parity(tmp_path):
    source = family_folder(tmp_path / "roberta", "roberta", "ForMaskedLM")
    folder = encoderstack.convert(source, tmp_path / "out")
    report = json.loads((folder / "conversion.json").read_text())
    assert set(report["mapped"]) | set(report["skipped"]) == set(load_file(source / "model.safetensors"))
    assert report["source_family"] == "roberta" and report["source_architecture"] == "RobertaForMaskedLM"
    rows = report["parity"]["results"]
    assert set(rows) == {"eager", "sdpa"} and all(r["max_abs_diff"] <= 1e-5 for v in rows.values() for r in v)
    config = json.loads((folder / "config.json").read_text())
    assert (config["position_offset"], config["head_layout"], config["layer_norm_eps"]) == (2, "roberta", 1e-5)
    card = (folder / "README.md").read_text()
    assert "RobertaForMaskedLM" in card and "- roberta" in card


def test_from_pretrained_converts_a_roberta_folder_on_the_fly(tmp_path):
    source = family_folder(tmp_path / "roberta", "xlm-roberta", "ForSequenceClassification")
    ours = encoderstack.EncoderStackForSequenceClassification.from_pretrained(source).eval()
    reference = transformers.XLMRobertaForSequenceClassification.from_pretrained(source).eval()
    inputs, _ = right_padded_batch("ForSequenceClassification")
    with torch.no_grad():
        torch.testing.assert_close(ours(**inputs).logits, reference(**inputs).logits, atol=1e-5, rtol=0)
    assert {path.name for path in tmp_path.iterdir()} == {"roberta"}


def test_a_deberta_v3_folder_converts_with_recorded_parity_and_loads_on_the_fly(tmp_path):
    source = family_folder(tmp_path / "deberta", "deberta-v2", "ForSequenceClassification")
    folder = encoderstack.convert(source, tmp_path / "out")
    rows = json.loads((folder / "conversion.json").read_text())["parity"]["results"]
    assert set(rows) == {"eager", "sdpa"} and all(r["max_abs_diff"] <= 1e-5 for v in rows.values() for r in v)
    assert "DeBERTa's disentangled attention (c2p+p2c, 8 log buckets" in (folder / "README.md").read_text()
    ours = encoderstack.EncoderStackForSequenceClassification.from_pretrained(source).eval()
    reference = transformers.DebertaV2ForSequenceClassification.from_pretrained(source).eval()
    inputs, _ = right_padded_batch("ForSequenceClassification")
    with torch.no_grad():
        torch.testing.assert_close(ours(**inputs).logits, reference(**inputs).logits, atol=1e-5, rtol=0)
    assert {path.name for path in tmp_path.iterdir()} == {"deberta", "out"}


def test_a_deberta_v3_release_without_architectures_converts_its_encoder_and_skips_its_discriminator(tmp_path):
    """microsoft/deberta-v3-base's layout: no `architectures` and no `legacy` in its config, the masked-LM head as
    `lm_predictions` (what its class reads with legacy=false) and the replaced-token-detection head
    `mask_predictions`, both beside the encoder; the encoder converts with parity, the heads are skipped with their
    reasons, and `task="fill-mask"` converts the masked LM with parity against the class that reads that head."""
    source = family_folder(tmp_path / "deberta", "deberta-v2", "ForMaskedLM", legacy=False)
    tensors = load_file(source / "model.safetensors")
    hidden = tensors["deberta.embeddings.LayerNorm.weight"].shape[0]
    shapes = {"dense.weight": (hidden, hidden), "dense.bias": (hidden,), "LayerNorm.weight": (hidden,)}
    shapes |= {"LayerNorm.bias": (hidden,), "classifier.weight": (1, hidden), "classifier.bias": (1,)}
    tensors |= {f"mask_predictions.{name}": torch.randn(shape) for name, shape in shapes.items()}
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config = {key: value for key, value in config.items() if key != "legacy"}
    (source / "config.json").write_text(json.dumps({**config, "architectures": None}))
    for task in ("feature-extraction", "fill-mask"):
        folder = encoderstack.convert(source, tmp_path / task, task=None if task == "feature-extraction" else task)
        report = json.loads((folder / "conversion.json").read_text())
        assert report["task"] == task
        assert all(r["max_abs_diff"] <= 1e-5 for v in report["parity"]["results"].values() for r in v)
        assert "replaced-token-detection head" in report["skipped"]["mask_predictions.classifier.weight"]
    assert (
        "head of task 'fill-mask'"
        in json.loads((tmp_path / "feature-extraction" / "conversion.json").read_text())["skipped"][
            "lm_predictions.lm_head.dense.weight"
        ]
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("conv_kernel_size", 3, "conv_kernel_size 3 is not supported .*the convolution after the first layer"),
        ("embedding_size", 16, "embedding_size 16 is not supported .*embed_proj, normalized after projection"),
        ("pooler_hidden_act", "tanh", "pooler_hidden_act 'tanh' is not supported"),
    ],
)
def test_a_deberta_part_encoderstack_does_not_express_is_refused_by_name(tmp_path, field, value, message):
    source = family_folder(tmp_path / "deberta", "deberta-v2", "Model")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(encoderstack.ConversionError, match=f"config.json: DeBERTa's {message}"):
        encoderstack.convert(source, tmp_path / "out")


def test_a_roberta_checkpoint_refuses_a_head_its_family_does_not_have(tmp_path):
    source = family_folder(tmp_path / "roberta", "roberta", "ForMaskedLM")
    with pytest.raises(encoderstack.ConversionError, match="a roberta checkpoint has no 'pretraining' head"):
        encoderstack.convert(source, tmp_path / "out", task="pretraining")
    assert not (tmp_path / "out").exists()


def test_a_roberta_config_without_a_pad_token_id_is_refused_by_name(tmp_path):
    """RoBERTa counts positions from the pad id: its own class cannot run without one either."""
    source = family_folder(tmp_path / "roberta", "roberta", "ForMaskedLM")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "pad_token_id": None}))
    message = f"{source / 'config.json'}: pad_token_id is None; RoBERTa counts positions from pad_token_id + 1"
    with pytest.raises(encoderstack.ConversionError, match=re.escape(message)):
        encoderstack.convert(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        ("funnel", "pools the sequence between blocks"),
        ("longformer", "global tokens"),
        ("gpt2", "is not a BERT-family checkpoint"),
    ],
)
def test_families_it_cannot_express_are_refused_with_the_family_and_the_reason(tmp_path, model_type, reason):
    source = family_folder(tmp_path / "roberta", "roberta", "Model")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "model_type": model_type, "architectures": None}))
    with pytest.raises(encoderstack.ConversionError, match=f"model_type '{model_type}'.*{reason}"):
        encoderstack.convert(source, tmp_path / "out")


def with_a_bert_tokenizer(folder):
    """A small WordPiece tokenizer as BERT's, saved in the folder: it gives a pair's second sentence token type 1."""
    words = ["the", "quick", "brown", "fox", "dog", "how", "old", "is", "about", "years", "where", "it", "no"]
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]))
    tokenizer = transformers.BertTokenizer(str(folder / "vocab.txt"))
    tokenizer.save_pretrained(folder)
    return tokenizer


def assert_token_types_are_ignored_as_the_reference_ignores_them(source, reference_class, output):
    """A folder of a family without token types that ships a BERT tokenizer (GTE-en-v1.5 does): `convert` verifies on
    sentence pairs without feeding token types, and the converted model, given the tokenizer's pair encoding with
    its token types, gives what the family's class gives."""
    tokenizer = with_a_bert_tokenizer(source)
    folder = encoderstack.convert(source, output)
    assert json.loads((folder / "conversion.json").read_text())["parity"]["inputs"].startswith("tokenizer")
    pairs = tokenizer(
        ["how old is the dog", "the fox"], ["about years", "where is it"], padding=True, return_tensors="pt"
    )
    assert pairs["token_type_ids"].max() == 1
    mask = pairs["attention_mask"].bool()
    with torch.no_grad():
        expected = reference_class.from_pretrained(source).eval()(**pairs).logits
        ours = encoderstack.EncoderStackForMaskedLM.from_pretrained(folder).eval()(**pairs).logits
    torch.testing.assert_close(real(ours, mask), real(expected, mask), atol=1e-5, rtol=0)


def test_a_distilbert_folder_with_a_bert_tokenizer_ignores_token_types_as_distilbert_does(tmp_path):
    source = family_folder(tmp_path / "distilbert", "distilbert", "ForMaskedLM")
    assert_token_types_are_ignored_as_the_reference_ignores_them(
        source, transformers.DistilBertForMaskedLM, tmp_path / "out"
    )


def test_a_distilbert_with_fixed_sinusoidal_positions_converts_its_stored_table_with_parity(tmp_path):
    source = family_folder(tmp_path / "distilbert", "distilbert", "ForMaskedLM")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "sinusoidal_pos_embds": True}))
    reference = transformers.DistilBertForMaskedLM.from_pretrained(source).eval()  # its table, as transformers fills it
    reference.save_pretrained(source)
    folder = encoderstack.convert(source, tmp_path / "out")
    rows = json.loads((folder / "conversion.json").read_text())["parity"]["results"]
    assert all(row["max_abs_diff"] <= 1e-5 for backend in rows.values() for row in backend)
    ours = encoderstack.EncoderStackForMaskedLM.from_pretrained(folder)
    torch.testing.assert_close(
        ours.model.embeddings.position_embeddings.weight, reference.distilbert.embeddings.position_embeddings.weight
    )


@pytest.mark.parametrize(
    ("family", "suffix"), [(family, suffix) for family in ("roberta", "albert") for suffix in suffixes(family)]
)
def test_export_bert_takes_a_converted_family_back_to_its_own_class_with_identical_tensors(tmp_path, family, suffix):
    source = family_folder(tmp_path / family, family, suffix)
    folder = encoderstack.convert(source, tmp_path / "es", verify=False)
    back = encoderstack.export_bert(folder, tmp_path / "back")
    reference_class = getattr(transformers, FAMILIES[family] + suffix)
    assert json.loads((back / "config.json").read_text())["architectures"] == [reference_class.__name__]
    original = reference_class.from_pretrained(source).state_dict()
    exported = reference_class.from_pretrained(back).state_dict()
    assert original.keys() == exported.keys()
    for key in original:
        assert torch.equal(original[key], exported[key]), key


def test_export_bert_refuses_a_layout_no_exported_family_has(tmp_path):
    folder = encoderstack.convert(
        family_folder(tmp_path / "electra", "electra", "Model"), tmp_path / "es", verify=False
    )
    with pytest.raises(encoderstack.ConversionError, match="head_layout 'electra' is exported to neither"):
        encoderstack.export_bert(folder, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def byte_level_bpe(folder):
    """A small byte-level BPE tokenizer as RoBERTa's (specials <s> <pad> </s> <unk> <mask>: pad id 1; <s> text </s>),
    saved."""
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.processors import RobertaProcessing

    bpe = ByteLevelBPETokenizer()
    texts = ["The quick brown fox jumps over the lazy dog.", "Normalization decides how gradients flow."] * 20
    bpe.train_from_iterator(texts, vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe._tokenizer.post_processor = RobertaProcessing(("</s>", 2), ("<s>", 0))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token="<s>",
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        mask_token="<mask>",
        cls_token="<s>",
        sep_token="</s>",
    )
    tokenizer.save_pretrained(folder)
    return tokenizer


def test_a_bpe_tokenizer_travels_with_the_folder_and_fill_mask_works_on_it(tmp_path):
    config = transformers.RobertaConfig(
        vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=200, type_vocab_size=1, pad_token_id=PAD,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.RobertaForMaskedLM(config).save_pretrained(tmp_path / "roberta")
    byte_level_bpe(tmp_path / "roberta")
    folder = encoderstack.convert(tmp_path / "roberta", tmp_path / "out")
    report = json.loads((folder / "conversion.json").read_text())
    assert report["parity"]["inputs"].startswith("tokenizer")  # parity measured on real text
    assert (folder / "tokenizer.json").read_text() == (tmp_path / "roberta" / "tokenizer.json").read_text()
    fill = transformers.pipeline("fill-mask", model=str(folder))
    reference = transformers.pipeline("fill-mask", model=str(tmp_path / "roberta"))
    text = "The quick brown <mask> jumps."
    assert [p["token"] for p in fill(text)] == [p["token"] for p in reference(text)]


def test_a_converted_roberta_exports_to_onnx_where_left_padding_gives_the_right_padded_logits(tmp_path):
    from encoderstack.exporters import RECORD, load_exported

    source = family_folder(tmp_path / "roberta", "roberta", "ForSequenceClassification")
    folder = encoderstack.convert(source, tmp_path / "es", verify=False)
    exported = encoderstack.export_onnx(folder, tmp_path / "onnx")
    rows = json.loads((exported / RECORD).read_text())["parity"]["results"]["onnxruntime"]
    assert all(row["max_abs_diff"] <= 1e-5 for row in rows)
    model = load_exported(exported)
    right, _ = right_padded_batch("ForSequenceClassification")
    left, _ = to_left(right, {})
    logits = [model(**b, token_type_ids=torch.zeros_like(b["input_ids"]))["logits"] for b in (right, left)]
    logits = [torch.as_tensor(logit) for logit in logits]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)
    with torch.no_grad():
        expected = transformers.RobertaForSequenceClassification.from_pretrained(source).eval()(**right).logits
    torch.testing.assert_close(logits[0], expected, atol=1e-5, rtol=0)
