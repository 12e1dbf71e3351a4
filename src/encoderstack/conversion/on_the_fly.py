"""`EncoderStack*.from_pretrained` on a BERT-family folder: loaded through transformers' own key mapping, no copy.

The plan (`converter.plan`, which reads only names, shapes and dtypes) decides every tensor and refuses what
`convert` refuses; transformers then loads the source files with one exact renaming per planned tensor
(`from_pretrained(key_mapping=...)`), and the load is checked against the plan, so that the model holds the numbers
`convert` would have written. What a key mapping cannot do — translate the config, skip a tensor, refuse one, read
TensorFlow's files — stays with the plan or with the converter (TensorFlow releases are converted into a temporary
folder and loaded from there).
"""

import logging
import os
import re
import tempfile
from pathlib import Path

import transformers

from ..configuration_encoderstack import EncoderStackConfig
from .converter import Plan, SourceRows, all_finite, bert_family, convert, open_source, plan
from .keymap import ConversionError, task_for_encoderstack_class
from .sources import read_config

SKIPPED = "encoderstack_skipped."  # a skipped tensor is renamed here: no model has it, so transformers sets it aside


def whole_tensors(conversion: Plan) -> dict | None:
    """{target: source key} where every target is one source tensor as it is; None where some target is built from
    rows (a fused QKV projection split, a packed [up; gate] reordered), which a renaming cannot express."""
    whole = {
        target: pieces[0].key for target, pieces in conversion.mapped.items() if pieces == (SourceRows(pieces[0].key),)
    }
    return whole if len(whole) == len(conversion.mapped) else None


def key_mapping(conversion: Plan) -> dict | None:
    """One anchored renaming per source tensor: mapped ones to their target, skipped ones out of the model's way; None
    where renamings cannot express the plan. A planned key is never renamed twice: transformers applies every matching
    renaming in turn, and an exact, anchored source name matches only itself."""
    whole = whole_tensors(conversion)
    if whole is None:
        return None
    mapping = {f"^{re.escape(key)}$": target for target, key in whole.items()}
    mapping |= {f"^{re.escape(key)}$": SKIPPED + str(n) for n, key in enumerate(sorted(conversion.skipped))}
    renamed_again = set(mapping.values()) & set(whole.values()) - {
        target for target, key in whole.items() if key == target
    }
    return mapping if not renamed_again else None


def on_the_fly(model_class, folder: Path, task_name: str, *args, **kwargs):
    """The model of `model_class`, loaded from the BERT-family folder by transformers with our key mapping; None where
    renamings cannot express the source: a TensorFlow release (its own file format, transposed kernels) or a family
    whose targets are built from rows of fused tensors (GTE, NomicBERT, jina-embeddings-v3, ModernBERT, ...)."""
    source = open_source(folder)
    try:
        if source.reference != "source" or any(transpose for _, transpose in source.bert_names.values()):
            return None
        conversion = plan(source, task_name)
        mapping = key_mapping(conversion)
        if mapping is None:
            return None
        wants_info = kwargs.pop("output_loading_info", False)
        with tempfile.TemporaryDirectory(prefix="encoderstack-config-") as scratch:
            if "config" not in kwargs:  # a path, so that transformers applies config kwargs (num_labels=...) as usual
                conversion.config.save_pretrained(scratch)
                kwargs["config"] = scratch
            with quiet_load_report():  # its report would list the planned skips as unexpected; checked below instead
                model, info = transformers.PreTrainedModel.from_pretrained.__func__(
                    model_class, folder, *args, key_mapping=mapping, output_loading_info=True, **kwargs
                )
        check_load(model, info, conversion, source)
        info["unexpected_keys"] = set()  # only the planned skips were, under our names (checked)
        model._weight_conversions = []  # save_pretrained writes EncoderStack names, not the source's back
        model.config.name_or_path = str(folder)
        return (model, info) if wants_info else model
    finally:
        source.tensors.close()


class quiet_load_report(logging.Filter):
    """Leaves out transformers' load report of the one load whose report `check_load` replaces (a filter, not a
    level: transformers runs other checks when its logger's level is raised)."""

    logger = logging.getLogger("transformers.modeling_utils")

    def filter(self, record):
        return " LOAD REPORT" not in record.getMessage()

    def __enter__(self):
        self.logger.addFilter(self)

    def __exit__(self, *exc):
        self.logger.removeFilter(self)


def check_load(model, info: dict, conversion: Plan, source) -> None:
    """Every source tensor went where the plan says: mapped ones loaded, skipped ones set aside, nothing else missing
    but the tensors the plan initializes; no loaded weight holds NaN or infinity (as `convert` refuses them)."""
    skipped = {SKIPPED + str(n) for n in range(len(conversion.skipped))}
    surprises = {
        "missing": sorted(set(info["missing_keys"]) - set(conversion.initialized)),
        "unexpected": sorted(set(info["unexpected_keys"]) - skipped),
        "mismatched": sorted(str(key) for key in info["mismatched_keys"]),
    }
    surprises = {kind: keys for kind, keys in surprises.items() if keys}
    if surprises or info["error_msgs"]:
        found = "; ".join(f"{kind}: {', '.join(keys)}" for kind, keys in surprises.items()) or info["error_msgs"][0]
        raise ConversionError(f"{source.folder}: loading into {type(model).__name__} did not follow the plan ({found})")
    if conversion.initialized:
        logging.getLogger(__name__).warning(
            "%s: %s starts from the usual initialization (not in the source): %s",
            source.folder,
            type(model).__name__,
            ", ".join(conversion.initialized),
        )
    for target, key in whole_tensors(conversion).items():
        if not all_finite(model.get_parameter(target)):
            raise ConversionError(f"{source.tensors.file_of(key)}: tensor {key!r} holds NaN or infinite values")


def load_converted(model_class, name_or_path, *args, **kwargs):
    """`EncoderStackFor*.from_pretrained` on a BERT-family checkpoint: loaded through transformers' key mapping
    (`on_the_fly`), or where that cannot express the source, converted into a temporary folder and loaded there.
    Returns None for an EncoderStack folder (or a Hub id, or no path), which then loads the ordinary way; a folder of
    a family EncoderStack cannot express (DeBERTa, Funnel, ...) is refused as `convert` refuses it: transformers would
    load it as a mostly random model."""
    if not isinstance(name_or_path, (str, os.PathLike)):  # None with a config and a state_dict: nothing to convert
        return None
    try:
        folder = Path(name_or_path) if Path(name_or_path).exists() else None
        config = read_config(folder) if folder is not None and folder.is_dir() else None
    except ConversionError:
        return None
    if config is None or config.get("model_type", EncoderStackConfig.model_type) == EncoderStackConfig.model_type:
        return None
    bert_family(config, folder / "config.json")
    task = task_for_encoderstack_class(model_class.__name__)
    model = on_the_fly(model_class, folder, task.name, *args, **kwargs)
    if model is not None:
        return model
    with tempfile.TemporaryDirectory(prefix="encoderstack-") as scratch:
        convert(folder, Path(scratch) / "model", task=task.name, verify=False)
        return model_class.from_pretrained(Path(scratch) / "model", *args, **kwargs)
