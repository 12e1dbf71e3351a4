"""The model card: Hub metadata that parses back and passes the Hub's validation, and a body that renders."""

import json
import re
import shutil

import pytest
import torch
import transformers
from conftest import HEADS, PLACEMENTS, build
from hub_server import client_pointed_at, running_hub
from huggingface_hub import ModelCard

import encoderstack
from encoderstack import HubError, build_card, write_card
from encoderstack.cli import main
from encoderstack.configuration_encoderstack import PLACEMENT_EQUATIONS
from encoderstack.hub_card import PLACEMENT_TAGS

SOURCE_CARD = """---
language:
- en
- de
license: mit
datasets:
- wikipedia
library_name: transformers
pipeline_tag: fill-mask
---

# The source's own card

Trained by someone else, described here.
"""
PIPELINE_TAGS = {
    "EncoderStackModel": "feature-extraction",
    "EncoderStackForMaskedLM": "fill-mask",
    "EncoderStackForPreTraining": "fill-mask",
    "EncoderStackForSequenceClassification": "text-classification",
    "EncoderStackForTokenClassification": "token-classification",
    "EncoderStackForQuestionAnswering": "question-answering",
    "EncoderStackForMultipleChoice": None,  # the Hub has no multiple-choice pipeline
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with running_hub() as hub, client_pointed_at(hub, tmp_path_factory.mktemp("hf_home")):
        yield hub


@pytest.fixture(scope="module")
def converted_once(tmp_path_factory):
    """A tiny BertForPreTraining with a card of its own, converted to a masked LM: the NSP head and the pooler are
    skipped, so the card has skipped tensors to list."""
    scratch = tmp_path_factory.mktemp("card")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    transformers.BertForPreTraining(config).save_pretrained(scratch / "bert")
    (scratch / "bert" / "README.md").write_text(SOURCE_CARD)
    return encoderstack.convert(scratch / "bert", scratch / "tiny-encoderstack", task="fill-mask")


@pytest.fixture
def converted(converted_once, tmp_path):
    return shutil.copytree(converted_once, tmp_path / converted_once.name)


def test_a_converted_model_gets_hub_metadata_for_its_head_placement_and_origin(converted):
    card = ModelCard.load(write_card(converted))
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "fill-mask"
    assert card.data.tags == ["encoderstack", "post-ln", "bert"]


def test_license_language_and_datasets_carry_over_from_the_source_card_whose_body_is_replaced(converted):
    card = ModelCard.load(write_card(converted))
    assert card.data.license == "mit" and card.data.language == ["en", "de"] and card.data.datasets == ["wikipedia"]
    assert "source's own card" not in card.text and "Trained by someone else" not in card.text
    assert card.text.lstrip().startswith("# tiny-encoderstack\n")


def test_base_model_is_the_source_hub_id_when_the_conversion_records_one_and_omitted_otherwise(converted):
    assert "base_model" not in build_card(converted).data.to_dict()
    record = json.loads((converted / "conversion.json").read_text())
    (converted / "conversion.json").write_text(json.dumps({**record, "source_hub_id": "google-bert/bert-base-uncased"}))
    card = build_card(converted)
    assert card.data.base_model == "google-bert/bert-base-uncased"
    assert "[`google-bert/bert-base-uncased`](https://huggingface.co/google-bert/bert-base-uncased)" in card.text


def test_converting_a_hub_id_records_it_as_the_card_s_base_model(converted_once, tmp_path, monkeypatch):
    import huggingface_hub

    snapshot = converted_once.parent / "bert"  # what snapshot_download would have put in the cache
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda name, **kwargs: str(snapshot))
    folder = encoderstack.convert("someone/tiny-bert", tmp_path / "out")
    assert ModelCard.load(folder / "README.md").data.base_model == "someone/tiny-bert"


def test_a_conversion_that_was_not_verified_says_so_instead_of_a_parity_table(converted):
    record = json.loads((converted / "conversion.json").read_text())
    del record["parity"]
    (converted / "conversion.json").write_text(json.dumps(record))
    text = build_card(converted).text
    assert "Not verified: the conversion ran with `--no-verify`." in text
    assert "| output |" not in text and "to within" not in text


@pytest.mark.parametrize("model_class", HEADS, ids=lambda c: c.__name__)
def test_a_model_built_from_a_config_gets_the_pipeline_tag_of_its_head_and_no_provenance(model_class, tmp_path):
    build(model_class, num_hidden_layers=2, norm_placement="resi_dual").save_pretrained(tmp_path / "model")
    card = ModelCard.load(write_card(tmp_path / "model"))
    assert card.data.pipeline_tag == PIPELINE_TAGS[model_class.__name__]
    assert card.data.tags == ["encoderstack", "resi-dual"]
    assert card.data.license is None and card.data.base_model is None
    assert "## Conversion" not in card.text and "generated from the model's config" in card.text


def test_every_placement_gets_its_equation_and_its_hub_tag_on_the_card(tmp_path):
    for placement in PLACEMENTS:
        folder = tmp_path / placement
        build(encoderstack.EncoderStackModel, num_hidden_layers=1, norm_placement=placement).save_pretrained(folder)
        card = ModelCard.load(write_card(folder))
        assert card.data.tags == ["encoderstack", PLACEMENT_TAGS[placement]]
        assert f"| norm placement | `{placement}`: {PLACEMENT_EQUATIONS[placement]} |" in card.text.splitlines()


def headings(text: str) -> list[str]:
    in_code = False
    found = []
    for line in text.splitlines():
        in_code ^= line.startswith("```")
        if not in_code and line.startswith("#"):
            found.append(line)
    return found


def tables(text: str) -> list[list[str]]:
    blocks, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append(line)
        elif block:
            blocks.append(block)
            block = []
    return blocks


def cells(row: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]]


def test_the_card_renders_its_headings_and_tables(converted):
    text = ModelCard.load(write_card(converted)).text
    assert headings(text) == [
        "# tiny-encoderstack",
        "## Model details",
        "## How to load",
        "## Conversion",
        "### Parity",
        "## Intended uses and limitations",
    ]
    found = tables(text)
    assert [cells(block[0]) for block in found] == [
        ["", ""],
        ["source file", "sha256"],
        ["skipped tensor", "reason"],
        ["output", "eager", "sdpa"],
    ]
    for block in found:
        assert set(block[1]) == set("|-") and all(len(cells(row)) == len(cells(block[0])) for row in block)
    record = json.loads((converted / "conversion.json").read_text())
    lines = text.splitlines()
    for row in ("| layers | 2 |", "| hidden size | 32 |", "| vocabulary | 99 tokens, 2 token types |"):
        assert row in lines
    assert "| norm placement | `post`: `h = LN(h + Drop(F(h)))`, as BERT |" in lines
    for name, digest in record["source_files"].items():
        assert f"| `{name}` | `{digest}` |" in lines
    assert len(record["skipped"]) == 4  # the NSP head and the pooler, two tensors each
    for key, reason in record["skipped"].items():
        assert f"| `{key}` | {reason} |" in lines
    assert any(re.fullmatch(r"\| attentions \| \d\.\d\de[+-]\d\d \| – \|", line) for line in lines)
    assert 'model = AutoModelForMaskedLM.from_pretrained("tiny-encoderstack", trust_remote_code=True)' in lines


def test_the_card_passes_the_hubs_validation_which_rejects_bad_metadata(hub, converted):
    card = build_card(converted)
    card.validate()
    for field, bad in (("pipeline_tag", "multiple-choice"), ("tags", "encoderstack"), ("license", "MIT License")):
        broken = ModelCard(str(card))
        setattr(broken.data, field, bad)
        with pytest.raises(ValueError, match=field):
            broken.validate()


def test_rebuilding_the_card_gives_the_same_card(converted):
    first = write_card(converted).read_text()
    assert write_card(converted).read_text() == first


def test_a_folder_that_is_not_an_encoderstack_checkpoint_gets_no_card(converted_once):
    with pytest.raises(HubError, match="not an EncoderStack config \\(model_type 'bert'\\)"):
        build_card(converted_once.parent / "bert")


def test_encoderstack_card_writes_the_card_from_the_command_line(converted, capsys):
    (converted / "README.md").unlink()
    assert main(["card", str(converted)]) == 0
    assert capsys.readouterr().out == f"wrote {converted / 'README.md'}\n"
    assert ModelCard.load(converted / "README.md").data.pipeline_tag == "fill-mask"


def test_the_card_gives_each_layer_types_rotary_base(tmp_path):
    model = build(
        encoderstack.EncoderStackModel,
        position_embedding_type="rope",
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        sliding_window=4,
        rope_parameters={"full_attention": {"rope_theta": 160000.0}, "sliding_attention": {"rope_theta": 10000.0}},
    )
    model.save_pretrained(tmp_path)
    card = encoderstack.build_card(tmp_path).text
    assert "rotary, full_attention: θ = 160000; sliding_attention: θ = 10000" in card
