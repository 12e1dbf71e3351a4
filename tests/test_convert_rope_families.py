"""The post-LN rotary encoders convert with parity: GTE, NomicBERT and jina-embeddings-v3, every head each has in
transformers 5.24, against the family's own class built tiny and random (no download): float32, eval mode, eager and
SDPA, left and right padding, padded and padding-free. Their checkpoints keep the original Hub names (transformers'
`save_pretrained` writes them back): fused QKV projections and GTE's packed [up; gate]."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_convert_family import (
    PAD,
    REGISTRY,
    assert_parity,
    assert_token_types_are_ignored_as_the_reference_ignores_them,
    bert_positions_of_left_padding,
    converted_pair,
    right_padded_batch,
    save_random,
    suffixes,
)

import encoderstack

BASES = {"gte": 5000.0, "nomic_bert": 3000.0, "jina_embeddings_v3": 7000.0}  # a rotary base other than its default
FAMILIES = {  # model_type -> (class prefix, its heads, a rotary base other than its default)
    name: (REGISTRY[name].architecture_prefix, suffixes(name), base) for name, base in BASES.items()
}
MATRIX = [(family, suffix) for family, (_, suffixes, _) in FAMILIES.items() for suffix in suffixes]


def rope_folder(folder, family, suffix, seed=0, rope_parameters=None, max_position_embeddings=64, type_vocab_size=2):
    prefix, _, theta = FAMILIES[family]
    config = transformers.AutoConfig.for_model(
        family,
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=max_position_embeddings,
        type_vocab_size=type_vocab_size,
        layer_norm_eps=1e-5,
        pad_token_id=PAD,
        num_labels=2 if suffix == "ForQuestionAnswering" else 3,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": theta},
    )
    return save_random(getattr(transformers, prefix + suffix), config, folder, seed)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache = {}

    def get(family, suffix):
        if (family, suffix) not in cache:
            root = tmp_path_factory.mktemp(f"{family}-{suffix}")
            source = rope_folder(root / "source", family, suffix)
            reference_class = getattr(transformers, FAMILIES[family][0] + suffix)
            cache[family, suffix] = (*converted_pair(source, root / "out", reference_class), root / "out")
        return cache[family, suffix]

    return get


def typed_batch(suffix):
    """The shared batch, with token types: the second half of each sequence is of type 1."""
    inputs, labels = right_padded_batch(suffix)
    lengths = inputs["attention_mask"].sum(-1, keepdim=True)
    types = (torch.arange(inputs["input_ids"].shape[-1]) >= lengths // 2) & inputs["attention_mask"].bool()
    return {**inputs, "token_type_ids": types.long()}, labels


def rotary_parity(reference, ours, family, suffix, backend, side):
    """The reference runs right-padded, given the positions the left-padded rows give their real tokens (counted
    along the row; 0 at padding, so that a dynamic scaling, which follows the largest position, sees ours)."""

    def reference_inputs(inputs):
        if side == "left":
            inputs = {**inputs, "position_ids": bert_positions_of_left_padding(inputs) * inputs["attention_mask"]}
        return inputs

    # GteModel and NomicBertModel have no pooler (their sequence heads add one): ours starts it, as listed
    ours_only = ("pooler_output",) if suffix == "Model" and family != "jina_embeddings_v3" else ()
    assert_parity(reference, ours, suffix, backend, side, reference_inputs, typed_batch, ours_only)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize(("family", "suffix"), MATRIX)
def test_every_rotary_family_head_backend_and_padding_side_converts_with_parity(
    converted, family, suffix, backend, side
):
    reference, ours, _ = converted(family, suffix)
    rotary_parity(reference, ours, family, suffix, backend, side)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_converted_folder_records_the_rotary_base_and_every_source_tensor(converted, family):
    _, ours, folder = converted(family, "ForMaskedLM")
    report = json.loads((folder / "conversion.json").read_text())
    source = load_file(next((folder.parent / "source").glob("*.safetensors")))
    assert set(report["mapped"]) | set(report["skipped"]) == set(source)
    assert ours.config.position_embedding_type == "rope" and report["source_family"] == family
    assert ours.model.rotary.full_attention_inv_freq[1].item() == pytest.approx(FAMILIES[family][2] ** (-2 / 8))


@pytest.mark.parametrize("suffix", ["ForMaskedLM", "ForSequenceClassification"])
def test_a_gte_head_checkpoint_with_the_remote_code_prefix_new_converts_to_the_same_tensors(
    converted, suffix, tmp_path
):
    """The original GTE release keeps its heads' encoder under `new.` (transformers' port renames it on load)."""
    _, _, folder = converted("gte", suffix)
    original = tmp_path / "original"
    original.mkdir()
    for path in (folder.parent / "source").iterdir():
        if path.suffix == ".safetensors":
            renamed = {
                f"new.{k.removeprefix('gte.')}" if k.startswith("gte.") else k: v for k, v in load_file(path).items()
            }
            assert any(key.startswith("new.") for key in renamed)
            save_file(renamed, original / path.name, metadata={"format": "pt"})
        else:
            (original / path.name).write_bytes(path.read_bytes())
    expected = load_file(folder / "model.safetensors")
    actual = load_file(encoderstack.convert(original, tmp_path / "out") / "model.safetensors")
    assert actual.keys() == expected.keys()
    assert all(torch.equal(actual[key], tensor) for key, tensor in expected.items())


def test_a_gte_without_token_types_and_a_bert_tokenizer_ignores_token_types_as_gte_does(tmp_path):
    """GTE-en-v1.5: `type_vocab_size` 0, and a BERT tokenizer."""
    source = rope_folder(tmp_path / "gte", "gte", "ForMaskedLM", type_vocab_size=0)
    assert_token_types_are_ignored_as_the_reference_ignores_them(source, transformers.GteForMaskedLM, tmp_path / "out")


@pytest.mark.parametrize("family", FAMILIES)
def test_flattened_rows_give_each_sequence_what_the_familys_class_gives_it_alone(converted, family):
    reference, ours, _ = converted(family, "Model")
    ids = torch.randint(PAD + 1, 99, (1, 12), generator=torch.Generator().manual_seed(7))
    bounds = (0, 5, 7, 12)
    with torch.no_grad():
        flattened = ours(input_ids=ids, cu_seq_lens_q=torch.tensor(bounds), max_length_q=5)
        alone = [reference(input_ids=ids[:, a:b]).last_hidden_state[0] for a, b in zip(bounds, bounds[1:])]
    torch.testing.assert_close(flattened.last_hidden_state[0], torch.cat(alone), atol=1e-5, rtol=0)


SCALINGS = {
    "dynamic NTK": {"rope_type": "dynamic", "rope_theta": 1000.0, "factor": 2.0},  # NomicBERT's long-context setting
    "linear": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0},
}


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_scaled_rotary_frequencies_convert_with_parity_past_the_trained_length(family, scaling, side, tmp_path):
    """8 trained positions and rows of 10 tokens: the dynamic scaling recomputes its frequencies for the longer
    sequence, in the reference and in ours alike."""
    source = rope_folder(
        tmp_path / "source", family, "ForMaskedLM", rope_parameters=SCALINGS[scaling], max_position_embeddings=8
    )
    folder = encoderstack.convert(source, tmp_path / "out", verify=False)
    reference = getattr(transformers, FAMILIES[family][0] + "ForMaskedLM").from_pretrained(source).eval()
    ours = encoderstack.EncoderStackForMaskedLM.from_pretrained(folder).eval()
    assert ours.config.rope_parameters == reference.config.rope_parameters  # the family's own, in its flat form
    rotary_parity(reference, ours, family, "ForMaskedLM", "eager", side)


def broken_copy(folder, tmp_path, edit_config=None, edit_weights=None):
    broken = tmp_path / "broken"
    broken.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(edit_config(config) if edit_config else config))
    weights = load_file(folder / "model.safetensors")
    save_file(edit_weights(weights) if edit_weights else weights, broken / "model.safetensors")
    return encoderstack.EncoderStackModel.from_pretrained(broken).eval()


def with_rope_theta(config, theta):
    config = {**config, "rope_theta": theta}
    if config.get("rope_parameters"):
        config["rope_parameters"] = {
            kind: {**value, "rope_theta": theta} if isinstance(value, dict) else value
            for kind, value in config["rope_parameters"].items()
        }
        if "rope_theta" in config["rope_parameters"]:
            config["rope_parameters"]["rope_theta"] = theta
    return config


def swapped(weights, first, second):
    weights[first], weights[second] = weights[second], weights[first]
    return weights


BREAKS = {
    "the rotary base": {"edit_config": lambda config: with_rope_theta(config, 10000.0)},
    "query and key swapped": {
        "edit_weights": lambda w: swapped(w, "layers.0.attention.query.weight", "layers.0.attention.key.weight")
    },
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("broken", BREAKS)
def test_a_conversion_broken_on_purpose_fails_the_parity_check(converted, family, broken, tmp_path):
    reference, ours, folder = converted(family, "Model")
    wrong = broken_copy(folder, tmp_path, **BREAKS[broken])
    with pytest.raises(AssertionError):
        rotary_parity(reference, wrong, family, "Model", "eager", "right")
