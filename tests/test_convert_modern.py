"""The pre-norm modern encoders convert with parity: ModernBERT, EuroBERT and UltraBERT against their own transformers
classes (built tiny and random, no download), every head each has, eager and SDPA, left and right padding,
padding-free and padded; NeoBERT (remote code only) against an independent transcription of its published forward
(neobert_reference.py)."""

import json
from dataclasses import replace

import pytest
import torch
import transformers
from conftest import real
from safetensors.torch import load_file
from test_convert_family import REGISTRY, assert_parity, right_padded_batch, save_random, suffixes, to_left

import encoderstack

PAD = 1
WIDE = 16  # a sliding radius wider than every test sequence (10 tokens)
FAMILIES = {  # model_type -> (class prefix, suffixes its family has)
    name: (REGISTRY[name].architecture_prefix, suffixes(name)) for name in ("modernbert", "eurobert", "ultrabert")
}
# Variants: each family as its checkpoints are, and with the switches its config has turned the other way.
VARIANTS = {
    "modernbert": {
        "default": {},
        "biases-mean": {
            "attention_bias": True,
            "mlp_bias": True,
            "norm_bias": True,
            "classifier_bias": True,
            "classifier_pooling": "mean",
        },
    },
    "eurobert": {"late": {}, "bos": {"classifier_pooling": "bos"}, "mean-biases": {"classifier_pooling": "mean"}},
    "ultrabert": {"default": {}, "mean": {"classifier_pooling": "mean"}},
}
MATRIX = [
    (family, variant, suffix)
    for family, (_, suffixes) in FAMILIES.items()
    for variant in VARIANTS[family]
    for suffix in suffixes
    if variant in ("default", "late") or "Sequence" in suffix or "Choice" in suffix or "biases" in variant
]


def family_config(family: str, suffix: str, variant: str, radius: int = WIDE):
    common = {
        "vocab_size": 99,
        "hidden_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "intermediate_size": 37,
        "max_position_embeddings": 64,
        "pad_token_id": PAD,
        "num_labels": 2 if suffix == "ForQuestionAnswering" else 3,
    }
    # bases far apart, and small enough that every rotary pair turns within a few tokens
    bases = {"full_attention": {"rope_type": "default", "rope_theta": 40.0}, "sliding_attention": {"rope_theta": 7.0}}
    fields = {
        "modernbert": {"local_attention": 2 * radius, "global_attn_every_n_layers": 2, "rope_parameters": bases},
        "eurobert": {"num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 25.0}},
        "ultrabert": {
            "num_key_value_heads": 2,
            "sliding_window": radius,
            "rope_parameters": bases,
            "prediction_head_size": 24,
        },
    }[family]
    if family == "eurobert" and "biases" in variant:
        fields |= {"attention_bias": True, "mlp_bias": True}
    return transformers.AutoConfig.for_model(family, **common, **fields, **VARIANTS[family].get(variant, {}))


def family_folder(folder, family, suffix, variant="default", radius=WIDE, seed=0):
    model_class = getattr(transformers, FAMILIES[family][0] + suffix)
    return save_random(model_class, family_config(family, suffix, variant, radius), folder, seed)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache = {}

    def get(family, variant, suffix, radius=WIDE):
        key = (family, variant, suffix, radius)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"{family}-{variant}-{suffix}-{radius}")
            source = family_folder(root / "source", family, suffix, variant, radius)
            folder = encoderstack.convert(source, root / "out", verify=False)
            reference = getattr(transformers, FAMILIES[family][0] + suffix).from_pretrained(source).eval()
            class_name = json.loads((folder / "config.json").read_text())["architectures"][0]
            cache[key] = reference, getattr(encoderstack, class_name).from_pretrained(folder).eval()
        return cache[key]

    return get


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize(("family", "variant", "suffix"), MATRIX)
def test_every_modern_family_head_backend_and_padding_side_converts_with_parity(
    converted, family, variant, suffix, backend, side
):
    """The reference runs right-padded (ModernBERT's `cls` pooling takes position 0); ours on either side (rotary
    positions only count relative distances), padded and padding-free."""
    assert_parity(*converted(family, variant, suffix), suffix, backend, side)


NARROW = 3  # a sliding radius well inside the 10-token test sequences
WINDOWED = [(family, suffix) for family in ("modernbert", "ultrabert") for suffix in FAMILIES[family][1]]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize(("family", "suffix"), WINDOWED)
def test_sliding_layers_narrower_than_the_sequence_convert_with_parity(converted, family, suffix, backend, side):
    """ModernBERT's `local_attention` (the window's width, 2 * radius) and UltraBERT's `sliding_window` (the radius)
    reach the same |i - j| <= radius on every path."""
    assert_parity(*converted(family, "default", suffix, NARROW), suffix, backend, side)


@pytest.mark.parametrize("family", FAMILIES)
def test_flattened_rows_give_each_sequence_what_the_familys_class_gives_it_alone(converted, family):
    reference, ours = converted(family, "default" if family != "eurobert" else "late", "ForTokenClassification")
    ids = torch.randint(PAD + 1, 99, (1, 12), generator=torch.Generator().manual_seed(7))
    bounds = (0, 5, 7, 12)
    with torch.no_grad():
        flattened = ours(input_ids=ids, cu_seq_lens_q=torch.tensor(bounds), max_length_q=5).logits[0]
        alone = [reference(input_ids=ids[:, a:b]).logits[0] for a, b in zip(bounds, bounds[1:])]
    torch.testing.assert_close(flattened, torch.cat(alone), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_conversion_accounts_for_every_tensor_and_verifies_parity_itself(tmp_path, family):
    source = family_folder(tmp_path / family, family, "ForMaskedLM", "default" if family != "eurobert" else "late")
    folder = encoderstack.convert(source, tmp_path / "out")
    report = json.loads((folder / "conversion.json").read_text())
    assert set(report["mapped"]) | set(report["skipped"]) == set(load_file(source / "model.safetensors"))
    assert not set(report["mapped"]) & set(report["skipped"])
    assert report["source_family"] == family
    rows = report["parity"]["results"]
    assert set(rows) == {"eager", "sdpa"} and all(r["max_abs_diff"] <= 1e-5 for v in rows.values() for r in v)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bfloat16_checkpoint_is_verified_in_float32_and_stays_bfloat16(tmp_path, family):
    """Modern releases are stored in bf16: the weights convert exactly, so both models run in float32 for the
    verification (in bf16 their outputs differ by up to 3e-2); the output keeps the stored dtype."""
    variant = "default" if family != "eurobert" else "late"
    reference_class = getattr(transformers, FAMILIES[family][0] + "ForMaskedLM")
    source = family_folder(tmp_path / family, family, "ForMaskedLM", variant)
    reference_class.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(source)
    folder = encoderstack.convert(source, tmp_path / "out")
    rows = json.loads((folder / "conversion.json").read_text())["parity"]["results"]
    assert all(row["max_abs_diff"] <= 1e-5 for backend in rows.values() for row in backend)
    assert {tensor.dtype for tensor in load_file(folder / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"


def test_modernberts_fused_qkv_feeds_the_query_key_and_value(tmp_path):
    source = family_folder(tmp_path / "modernbert", "modernbert", "Model")
    folder = encoderstack.convert(source, tmp_path / "out", verify=False)
    report = json.loads((folder / "conversion.json").read_text())
    assert report["mapped"]["layers.1.attn.Wqkv.weight"] == [
        f"layers.1.attention.{name}.weight" for name in ("key", "query", "value")
    ]
    fused, ours = load_file(source / "model.safetensors"), load_file(folder / "model.safetensors")
    query, key, value = fused["layers.1.attn.Wqkv.weight"].chunk(3)
    assert torch.equal(ours["layers.1.attention.query.weight"], query)
    assert torch.equal(ours["layers.1.attention.key.weight"], key)
    assert torch.equal(ours["layers.1.attention.value.weight"], value)
    assert "layers.0.attention_residual.norm_in.weight" not in ours  # ModernBERT's first layer has no attn_norm


def test_the_cli_converts_a_modernbert_folder_and_from_pretrained_converts_one_on_the_fly(tmp_path):
    from encoderstack.cli import main

    source = family_folder(tmp_path / "modernbert", "modernbert", "ForSequenceClassification")
    assert main(["convert", str(source), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["head_layout"] == "modernbert"
    ours = encoderstack.EncoderStackForSequenceClassification.from_pretrained(source).eval()
    reference = transformers.ModernBertForSequenceClassification.from_pretrained(source).eval()
    inputs, _ = right_padded_batch("ForSequenceClassification")
    with torch.no_grad():
        torch.testing.assert_close(ours(**inputs).logits, reference(**inputs).logits, atol=1e-5, rtol=0)


def test_a_tokenizer_travels_with_a_converted_modernbert_folder(tmp_path):
    from test_convert_family import byte_level_bpe

    source = family_folder(tmp_path / "modernbert", "modernbert", "ForMaskedLM")
    config = json.loads((source / "config.json").read_text())
    byte_level_bpe(source)
    (source / "config.json").write_text(json.dumps({**config, "vocab_size": 99}))
    folder = encoderstack.convert(source, tmp_path / "out", verify=False)
    assert (folder / "tokenizer.json").read_text() == (source / "tokenizer.json").read_text()
    assert transformers.AutoTokenizer.from_pretrained(folder)("The fox")["input_ids"]


# Broken on purpose: each edit of the key map or the config fields must make the conversion fail.
def swap_targets(pairs, first: str, second: str) -> tuple:
    """The key map with the targets of the two pairs whose source templates contain `first` and `second` swapped."""
    a, b = (next(i for i, pair in enumerate(pairs) if name in pair[0]) for name in (first, second))
    swapped = list(pairs)
    swapped[a], swapped[b] = (pairs[a][0], pairs[b][1]), (pairs[b][0], pairs[a][1])
    return tuple(swapped)


def query_and_key_swapped(entry):
    pairs = list(entry.extra_encoder_keys)
    index = next(i for i, pair in enumerate(pairs) if "Wqkv" in pair[0])
    query, key, value = pairs[index][1]
    pairs[index] = (pairs[index][0], (replace(query, target=key.target), replace(key, target=query.target), value))
    return replace(entry, extra_encoder_keys=tuple(pairs))


def one_sliding_base(entry):
    def fields(config):
        result = entry.fields(config)
        return {**result, "rope_parameters": {**result["rope_parameters"], "sliding_attention": {"rope_theta": 40.0}}}

    return replace(entry, fields=fields)


BREAKAGES = {  # what is broken -> (family, its variant, the broken key map entry, what fails)
    "the Wqkv split (query and key swapped)": ("modernbert", "default", query_and_key_swapped, "parity above"),
    "the sliding layers' rotary base": ("modernbert", "default", one_sliding_base, "parity above"),
    "the gate/up order": (
        "eurobert",
        "late",
        lambda entry: replace(entry, extra_encoder_keys=swap_targets(entry.extra_encoder_keys, "gate_", "up_")),
        "parity above",
    ),
    "the two-layer masked-LM head's order": (
        "ultrabert",
        "default",
        lambda entry: replace(
            entry, head_keys={"fill-mask": swap_targets(entry.head_keys["fill-mask"], "linear1", "linear2")}
        ),
        r"'head.linear1.weight' has shape \[24, 32\], but 'lm_head.dense_out.weight' needs \[32, 24\]",  # refused early
    ),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_the_conversion_fails_when_the_key_map_or_a_rotary_base_is_broken_on_purpose(tmp_path, monkeypatch, breakage):
    from encoderstack.conversion import keymap

    family, variant, break_entry, message = BREAKAGES[breakage]
    monkeypatch.setitem(keymap.FAMILIES, family, break_entry(keymap.FAMILIES[family]))
    source = family_folder(tmp_path / "source", family, "ForMaskedLM", variant)
    with pytest.raises(encoderstack.ConversionError, match=message):
        encoderstack.convert(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


NEOBERT = {"NeoBERT": "Model", "NeoBERTLMHead": "ForMaskedLM", "NeoBERTHFForSequenceClassification": "Sequence"}


@pytest.fixture(scope="module")
def neobert(tmp_path_factory):
    from neobert_reference import neobert_folder

    cache = {}

    def get(architecture):
        if architecture not in cache:
            root = tmp_path_factory.mktemp(architecture)
            source, reference = neobert_folder(root / "source", architecture)
            folder = encoderstack.convert(source, root / "out", verify=False)
            class_name = json.loads((folder / "config.json").read_text())["architectures"][0]
            cache[architecture] = reference, getattr(encoderstack, class_name).from_pretrained(folder).eval(), source
        return cache[architecture]

    return get


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("architecture", NEOBERT)
def test_neobert_converts_with_parity_against_a_transcription_of_its_forward(neobert, architecture, backend, side):
    reference, ours, _ = neobert(architecture)
    ours.set_attn_implementation(backend)
    inputs, _ = right_padded_batch("Model")
    mine = inputs if side == "right" else to_left(inputs, {})[0]
    with torch.no_grad():
        expected = reference(**inputs)
        outputs = [ours(**mine, output_hidden_states=True), ours(**mine)]  # padded, then padding-free
    for output in outputs:
        if architecture == "NeoBERTHFForSequenceClassification":
            torch.testing.assert_close(output.logits, expected, atol=1e-5, rtol=0)
        else:
            got = output.logits if architecture == "NeoBERTLMHead" else output.last_hidden_state
            want = real(expected, inputs["attention_mask"])
            torch.testing.assert_close(real(got, mine["attention_mask"]), want, atol=1e-5, rtol=0)


def test_neobert_accounts_for_every_tensor_and_refuses_a_verification_it_has_no_class_for(neobert, tmp_path):
    _, _, source = neobert("NeoBERTLMHead")
    report = json.loads((source.parent / "out" / "conversion.json").read_text())
    assert set(report["mapped"]) | set(report["skipped"]) == set(load_file(source / "model.safetensors"))
    assert len(report["mapped"]["model.transformer_encoder.0.qkv.weight"]) == 3
    with pytest.raises(encoderstack.ConversionError, match="NeoBERTLMHead has no transformers class.*--no-verify"):
        encoderstack.convert(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_neobert_parity_fails_without_the_rotary_pair_reordering(monkeypatch, tmp_path):
    """Broken on purpose: the per-head split kept, the pairs (2i, 2i+1) not reordered to rotate-half's halves."""
    from neobert_reference import neobert_folder

    from encoderstack.conversion import keymap

    entry = keymap.FAMILIES["neobert"]
    pairs = list(entry.extra_encoder_keys)
    index = next(i for i, pair in enumerate(pairs) if "qkv" in pair[0])
    pairs[index] = (
        pairs[index][0],
        tuple(replace(piece, rows=keymap.head_part(part, of=3)) for part, piece in enumerate(pairs[index][1])),
    )
    monkeypatch.setitem(keymap.FAMILIES, "neobert", replace(entry, extra_encoder_keys=tuple(pairs)))
    source, reference = neobert_folder(tmp_path / "source", "NeoBERT")
    ours = encoderstack.EncoderStackModel.from_pretrained(encoderstack.convert(source, tmp_path / "out", verify=False))
    inputs, _ = right_padded_batch("Model")
    with torch.no_grad():
        difference = (ours(**inputs).last_hidden_state - reference(**inputs)).abs()
    assert difference[inputs["attention_mask"].bool()].max() > 1e-2


def test_the_key_maps_row_selections_split_fused_projections_as_their_families_lay_them_out():
    from encoderstack.conversion.keymap import head_part, parts

    config = encoderstack.EncoderStackConfig(hidden_size=8, num_attention_heads=2)
    assert parts(1, of=3)(config, 12) == [4, 5, 6, 7]
    assert parts(1, 0, of=2)(config, 4) == [2, 3, 0, 1]  # [up; gate] -> [gate; up]
    # 2 heads of 4 features, each head [q; k; v]: the key rows of head 1 start at (1 * 3 + 1) * 4
    assert head_part(1, of=3)(config, 24) == [4, 5, 6, 7, 16, 17, 18, 19]
    assert head_part(0, of=3, rotary_pairs=True)(config, 24) == [0, 2, 1, 3, 12, 14, 13, 15]


def test_a_gated_projection_with_one_of_its_two_sources_missing_is_refused_by_name(tmp_path):
    from safetensors.torch import save_file

    source = family_folder(tmp_path / "eurobert", "eurobert", "Model", "late")
    tensors = load_file(source / "model.safetensors")
    del tensors["layers.1.mlp.up_proj.weight"]
    save_file(tensors, source / "model.safetensors")
    message = r"'layers.1.mlp.up.weight' takes 2 source tensors, but the source has only 'layers.1.mlp.gate_proj"
    with pytest.raises(encoderstack.ConversionError, match=message):
        encoderstack.convert(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()
