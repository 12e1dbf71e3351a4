"""The model card (README.md) of an EncoderStack folder, built from what the folder itself says: its config, its
conversion record (`conversion.json`) and the metadata of the card it replaces (a converted folder starts with the
source's card, whose license, languages and datasets still hold for the same weights)."""

import warnings
from importlib.resources import files
from pathlib import Path

import jinja2
import torch
import yaml
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.repocard import metadata_load

from .. import modeling_encoderstack
from ..checkpoint import has_tokenizer
from ..configuration_encoderstack import PLACEMENT_REGISTRY, EncoderStackConfig
from ..jsonfile import read_json_object
from ..modeling_encoderstack import AUTO_MAP
from ..parity import parity_rows

CARD_NAME = "README.md"
# EncoderStack class -> (Hub pipeline tag, what it is). The Hub has no pipeline tag for multiple choice.
HEADS = {
    "EncoderStackModel": ("feature-extraction", "encoder"),
    "EncoderStackForMaskedLM": ("fill-mask", "masked language model"),
    "EncoderStackForPreTraining": ("fill-mask", "pre-training model (masked LM and next-sentence heads)"),
    "EncoderStackForSequenceClassification": ("text-classification", "sequence classifier"),
    "EncoderStackForTokenClassification": ("token-classification", "token classifier"),
    "EncoderStackForQuestionAnswering": ("question-answering", "extractive question-answering model"),
    "EncoderStackForMultipleChoice": (None, "multiple-choice model"),
    "EncoderStackForReplacedTokenDetection": (None, "replaced-token detector (ELECTRA's discriminator)"),
}
AUTO_CLASSES = {reference.split(".")[-1]: auto_name for auto_name, reference in AUTO_MAP.items()}
PLACEMENT_TAGS = {name: entry.tag for name, entry in PLACEMENT_REGISTRY.items()}
# Facts about the weights, not about this particular folder: they hold for the converted model as for its source.
CARRIED_METADATA = ("license", "license_name", "license_link", "language", "datasets", "metrics")


class HubError(ValueError):
    """A folder that cannot be described or published as it is, or a push the Hub refuses; the message says why."""


def read_folder_config(folder: Path) -> tuple[EncoderStackConfig, str]:
    """The folder's EncoderStack config and the class it was saved from."""
    path = Path(folder) / "config.json"
    fields = read_json_object(path, HubError)
    model_type = fields.get("model_type")
    if model_type != EncoderStackConfig.model_type:
        raise HubError(f"{path}: not an EncoderStack config (model_type {model_type!r})")
    try:
        config = EncoderStackConfig.from_dict(fields)
    except Exception as error:  # the config's own validation names the field
        raise HubError(f"{path}: {error}") from None
    class_name = (config.architectures or ["EncoderStackModel"])[0]
    if class_name not in HEADS:
        raise HubError(f"{path}: architecture {class_name!r} is not an EncoderStack class ({', '.join(HEADS)})")
    return config, class_name


def read_conversion(folder: Path, name: str = "conversion.json") -> dict | None:
    path = folder / name
    return read_json_object(path, HubError) if path.exists() else None


def carried_metadata(folder: Path) -> dict:
    """License, languages, datasets and metrics from the card already in the folder (the source's, or ours)."""
    path = folder / CARD_NAME
    if not path.is_file():
        return {}
    try:
        metadata = metadata_load(path) or {}
    except (yaml.YAMLError, ValueError) as error:
        warnings.warn(f"{path}: metadata not readable, nothing carried over ({error})", stacklevel=3)
        return {}
    return {key: metadata[key] for key in CARRIED_METADATA if metadata.get(key) is not None}


def table_cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def layer_count(config) -> str:
    """The depth, and the layers stored where some share weights (ALBERT's groups)."""
    stored = len(set(config.stored_layer_of()))
    if stored == config.num_hidden_layers:
        return str(config.num_hidden_layers)
    groups = f"`num_hidden_groups` {config.num_hidden_groups}, `inner_group_num` {config.inner_group_num}"
    return f"{config.num_hidden_layers}, sharing {stored} stored layers ({groups})"


def architecture_rows(config: EncoderStackConfig, class_name: str) -> list[tuple[str, str]]:
    with torch.device("meta"):
        parameters = sum(p.numel() for p in getattr(modeling_encoderstack, class_name)(config).parameters())
    positions = {
        "absolute": f"learned, up to {config.max_position_embeddings} tokens",
        "sinusoidal": "fixed sinusoids (2017 Transformer)",
        "rope": f"rotary, θ = {config.rope_theta:g}",
        None: "none at the input",
    }[config.position_embedding_type]
    if config.position_embedding_type == "rope":
        types = sorted(set(config.layer_types or ["full_attention"]))
        rows = {name: config.rope_parameters_by_type()[name] for name in types}
        positions = "rotary, " + "; ".join(
            (f"{name}: " if len(rows) > 1 else "")
            + f"θ = {row['rope_theta']:g}"
            + ("" if row["rope_type"] == "default" else f" ({row['rope_type']})")
            for name, row in rows.items()
        )
    if config.relative_attention == "bias":
        positions += (
            f"; a learned relative-position bias in every layer's scores ({config.relative_attention_num_buckets} "
            f"buckets, max distance {config.relative_attention_max_distance})"
        )
    elif config.relative_attention == "disentangled":
        buckets = f"{config.position_buckets} log buckets" if config.position_buckets else "no buckets"
        positions += (
            f"; DeBERTa's disentangled attention ({'+'.join(config.pos_att_type)}, {buckets}, max distance "
            f"{config.max_relative_positions or config.max_position_embeddings}"
            + (", shared key projections" if config.share_att_key else "")
            + ")"
        )
    return [
        (
            "class",
            f"`{class_name}`" + (f" (loads with `{AUTO_CLASSES[class_name]}`)" if class_name in AUTO_CLASSES else ""),
        ),
        ("norm placement", f"`{config.norm_placement}`: {PLACEMENT_REGISTRY[config.norm_placement].equation}"),
        ("layers", layer_count(config)),
        ("hidden size", config.hidden_size),
        (
            "attention heads",
            f"{config.num_attention_heads} (head size {config.hidden_size // config.num_attention_heads})",
        ),
        ("intermediate size", config.intermediate_size),
        ("activation", f"`{config.hidden_act}`"),
        ("positions", f"`{config.position_embedding_type}`: {positions}"),
        (
            "norm type",
            f"`{config.norm_type}` (eps {config.layer_norm_eps:g}), "
            f"{'with' if config.embedding_norm else 'without'} an embedding norm",
        ),
        ("vocabulary", f"{config.vocab_size} tokens, {config.type_vocab_size} token types"),
        ("parameters", f"{parameters / 1e6:.1f}M" if parameters >= 1e5 else f"{parameters:,}"),
    ]


def provenance(conversion: dict) -> dict:
    """conversion.json, as the card shows it. A local source shows only its folder name: the card is public."""
    hub_id = conversion.get("source_hub_id")
    source = (
        f"[`{hub_id}`](https://huggingface.co/{hub_id})"
        if hub_id
        else f"in the local folder `{Path(conversion['source']).name}`"
    )
    parity = conversion.get("parity")
    if parity is not None:
        backends, rows = parity_rows(parity)
        parity = {**parity, "backends": backends, "rows": rows}
    return {**conversion, "source_shown": source, "parity": parity}


def build_card(folder, repo_id: str | None = None, extra_tags=()) -> ModelCard:
    """The model card of an EncoderStack folder. `repo_id` names the repository in the loading examples (by default
    the folder's name, which loads the local folder); `extra_tags` are added to the metadata's tags."""
    folder = Path(folder)
    config, class_name = read_folder_config(folder)
    conversion = read_conversion(folder)
    finetune, pretrain = read_conversion(folder, "finetune.json"), read_conversion(folder, "pretrain.json")
    pipeline_tag, description = HEADS[class_name]
    tags = ["encoderstack", PLACEMENT_TAGS[config.norm_placement]]
    if conversion is not None:
        megatron = (conversion.get("source_architecture") or "").startswith("Megatron")
        tags.append(conversion.get("source_family") or ("megatron-bert" if megatron else "bert"))
    elif family := (finetune or pretrain or {}).get("source_family"):
        tags.append(family)
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=[*tags, *extra_tags],
        base_model=(conversion or {}).get("source_hub_id"),
        **carried_metadata(folder),
    )
    environment = jinja2.Environment(
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined
    )
    environment.filters["cell"] = table_cell
    environment.filters["name"] = lambda path: Path(path).name  # local paths stay private: the card is public
    template = environment.from_string(files(__package__).joinpath("model_card.md").read_text(encoding="utf-8"))
    content = template.render(
        card_data=card_data.to_yaml(),
        title=(repo_id or folder.resolve().name).split("/")[-1],
        repo=repo_id or folder.resolve().name,
        description=description,
        config=config,
        class_name=class_name,
        auto_class=AUTO_CLASSES.get(class_name),
        architecture=architecture_rows(config, class_name),
        has_tokenizer=has_tokenizer(folder),
        conversion=provenance(conversion) if conversion is not None else None,
        finetune=finetune,
        pretrain=pretrain,
        has_loss_plot=(folder / "loss.png").is_file(),
        labels=sorted(config.id2label.items())
        if pipeline_tag in ("text-classification", "token-classification")
        else [],
    )
    return ModelCard(content)


def write_card(folder, repo_id: str | None = None, extra_tags=()) -> Path:
    """Write (or rebuild) the folder's README.md; returns its path."""
    card = build_card(folder, repo_id, extra_tags)
    path = Path(folder) / CARD_NAME
    card.save(path)
    return path


__all__ = ["HubError", "build_card", "write_card", "read_folder_config"]
