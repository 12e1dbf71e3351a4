"""BERT checkpoint -> EncoderStack folder (and back): plan the key mapping, stream the tensors, verify, publish.

Nothing is written where the user can see it until the whole folder is complete and verified: the output is built
in a hidden sibling folder and renamed into place at the end.
"""

import dataclasses
import errno
import json
import logging
import math
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

from ..checkpoint import CODE_FILES, copy_code_files, expected_tensors, sha256
from ..configuration_encoderstack import EncoderStackConfig
from ..hub_card import write_card
from ..modeling_encoderstack import AUTO_MAP
from ..output_folder import OutputFolder
from ..version import __version__
from .keymap import (
    BERT_FIELDS,
    DECODER_OWN_BIASES,
    FAMILIES,
    REFUSED_FAMILIES,
    TASKS,
    ConversionError,
    Piece,
    Task,
    task_for_architecture,
    task_for_encoderstack_class,
    task_named,
    translate,
)
from .sources import (
    SAFETENSORS_DTYPES,
    WEIGHT_FILE_NAMES,
    Source,
    TensorSource,
    copy_other_files,
    has_hf_weights,
    read_config,
    require_hf_weights,
)

TOLERANCE = 1e-5
EMBEDDINGS = "embeddings.word_embeddings.weight"


@dataclass(frozen=True)
class SourceRows:
    """One row block of a target: a source tensor (transposed where the source stores it so), or the rows of it that
    the key map's `Piece` selects, in that order."""

    key: str
    transpose: bool = False
    rows: tuple[int, ...] | None = None

    def shape(self, source: TensorSource) -> tuple[int, ...]:
        shape = source.shape(self.key)[::-1] if self.transpose else source.shape(self.key)
        return shape if self.rows is None else (len(self.rows), *shape[1:])

    def read(self, source: TensorSource) -> torch.Tensor:
        tensor = source.get(self.key)
        if not all_finite(tensor):  # outputs would be NaN (or 0 where a mask hides them)
            raise ConversionError(f"{source.file_of(self.key)}: tensor {self.key!r} holds NaN or infinite values")
        tensor = tensor.T if self.transpose else tensor
        return tensor if self.rows is None else tensor.index_select(0, torch.tensor(self.rows))


@dataclass
class Plan:
    family: str
    task: Task
    config: EncoderStackConfig
    mapped: dict  # target key -> (SourceRows, ...): its row blocks in order (one for a tensor taken as it is)
    skipped: dict  # source key -> reason
    initialized: list  # target keys the source does not have (only when the task was chosen explicitly)


def bert_name(key: str) -> str:
    """The modern Hugging Face BERT name of a state-dict key: no `bert.` prefix, LayerNorm weight/bias."""
    key = key.removeprefix("bert.")
    return re.sub(r"LayerNorm\.gamma\Z", "LayerNorm.weight", re.sub(r"LayerNorm\.beta\Z", "LayerNorm.bias", key))


def hub_id(name_or_path) -> str | None:
    """The Hub id that a source names, or None for a local folder, file or TensorFlow checkpoint prefix."""
    local = Path(name_or_path).exists() or Path(f"{name_or_path}.index").is_file()
    return None if local else str(name_or_path)


def symlink_problem(link: Path) -> str | None:
    """What keeps a symlink from being followed (a loop, a missing target); None if nothing does."""
    try:
        link.resolve(strict=True)
    except RuntimeError:  # Python < 3.13 reports a loop this way
        return "a symlink loop"
    except OSError as error:
        return "a symlink loop" if error.errno == errno.ELOOP else f"a broken symlink (to {os.readlink(link)})"
    return None


def could_be_a_hub_id(name: str) -> bool:
    """Not path-like (a leading `.`, `/` or `~`, more than one slash) and valid by the Hub's own rules."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith((".", "/", "~", os.sep)) or name.count("/") > 1 or (os.sep != "/" and os.sep in name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_folder(name_or_path) -> Path:
    """A local path as is; anything else is taken as a Hub id and resolved through the normal cache."""
    path, name = Path(name_or_path), str(name_or_path)
    if hub_id(name_or_path) is None:
        return path
    if path.is_symlink():
        raise ConversionError(f"{path}: {symlink_problem(path)}")
    if not could_be_a_hub_id(name):
        raise ConversionError(f"{name}: no such folder")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as error:
        raise ConversionError(f"{name}: no such folder, and not resolvable on the Hub ({error})") from None


def refuse_symlink_loops(folder: Path) -> None:
    """Copying the folder's other files would follow a link loop until the OS gives up: refuse it up front."""
    for root, dirs, files in os.walk(folder):  # links to folders are listed in `dirs` but not entered
        for name in dirs + files:
            link = Path(root) / name
            if not link.is_symlink():
                continue
            if symlink_problem(link) == "a symlink loop":
                raise ConversionError(f"{link}: a symlink loop")
            target = link.resolve()
            if target.is_dir() and (target == link.parent.resolve() or target in link.parent.resolve().parents):
                raise ConversionError(f"{link}: a symlink loop (links to its own folder {target})")


def open_source(name_or_path, gelu: str = "tanh", lowercase: bool | None = None) -> Source:
    """The checkpoint at a folder, Hub id or TensorFlow prefix (`gelu`, `lowercase`: TensorFlow releases only)."""
    from .tensorflow import open_tf_source

    folder = resolve_folder(name_or_path)
    # A Hugging Face folder is one, whatever stray `*.index` file it also holds.
    hf_folder = folder.is_dir() and (folder / "config.json").is_file() and has_hf_weights(folder)
    tf_source = None if hf_folder else open_tf_source(folder, gelu=gelu, lowercase=lowercase)
    if tf_source is not None:
        return tf_source
    if not folder.is_dir():
        raise ConversionError(f"{folder}: expected a checkpoint folder")
    config = read_config(folder)
    tensors = require_hf_weights(folder)
    refuse_symlink_loops(folder)
    return Source(
        folder,
        config,
        tensors,
        {key: (bert_name(key), False) for key in tensors.keys()},  # noqa: SIM118  (a lazy weights reader, not a dict)
        own_files=WEIGHT_FILE_NAMES + ("config.json",),
    )


def encoderstack_config(source: Source, family: str, task: Task) -> EncoderStackConfig:
    config = source.config
    if config.get("is_decoder") or config.get("add_cross_attention"):
        raise ConversionError(f"{source.folder}: a decoder BERT (is_decoder / add_cross_attention) is not an encoder")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ConversionError(
            f"{source.folder}: position_embedding_type {config['position_embedding_type']!r} is not supported "
            "(EncoderStack converts absolute learned positions)"
        )
    fields = {name: config[name] for name in BERT_FIELDS if name in config}
    fields["head_layout"] = FAMILIES[family].head_layout
    try:
        fields.update(FAMILIES[family].fields(config))
    except ConversionError as error:
        raise ConversionError(f"{source.config_path}: {error}") from None
    for name, value in fields.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConversionError(f"{source.config_path}: {name} is {value}; it must be a finite number")
    if task.name == "next-sentence":
        fields.update(num_labels=2, id2label=None, label2id=None)
    elif "id2label" not in fields and "num_labels" in config:
        fields["num_labels"] = config["num_labels"]
    if config.get("dtype", config.get("torch_dtype")) is not None:
        fields["dtype"] = config.get("dtype", config.get("torch_dtype"))
    try:
        result = EncoderStackConfig(**fields)
    except Exception as error:  # the config's own validation says what is wrong (strict dataclasses wrap it)
        raise ConversionError(
            f"{source.config_path}: config cannot describe an EncoderStack: {error.__cause__ or error}"
        ) from None
    if task.name in ("text-classification", "token-classification") and result.num_labels < 1:
        raise ConversionError(f"{source.config_path}: num_labels is {result.num_labels}; a classifier needs 1 or more")
    return result


def bert_family(config: dict, config_path: Path) -> str:
    family = config.get("model_type")
    if family in REFUSED_FAMILIES:
        raise ConversionError(f"{config_path}: model_type {family!r} cannot be converted: {REFUSED_FAMILIES[family]}")
    if family not in FAMILIES:
        raise ConversionError(
            f"{config_path}: model_type {family!r} is not a BERT-family checkpoint (supported: {', '.join(FAMILIES)})"
        )
    return family


def detect_task(source: Source) -> tuple[str, Task]:
    family_name = bert_family(source.config, source.config_path)
    architectures = source.config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
        raise ConversionError(
            f"{source.config_path}: architectures must be a list of class names, got {architectures!r}"
        )
    if len(architectures) > 1:
        raise ConversionError(f"{source.config_path}: several architectures {architectures}; choose one with --task")
    if architectures:
        try:
            family, task = task_for_architecture(architectures[0])
        except ConversionError as error:
            raise ConversionError(f"{source.config_path}: {error}") from None
        if family != family_name:
            raise ConversionError(
                f"{source.config_path}: architecture {architectures[0]} with model_type {family_name!r}"
            )
        return family, task
    family = FAMILIES[family_name]
    names = {family.local_name(bert) for bert, _ in source.bert_names.values()}
    token_heads = [TASKS[name] for name in ("pretraining", "replaced-token-detection", "fill-mask")]
    for task in (task for task in token_heads if family.has(task)):  # the first whose head keys are all there
        templates = family.head_keys_of(task)
        if all(any(translate(name, [pair]) for name in names) for pair in templates if "decoder.weight" not in pair[0]):
            return family_name, task
    return family_name, TASKS["feature-extraction"]


def stored_apart(source: Source, first: str | None, second: str | None) -> bool:
    """Whether two tensors that a head ties are both stored and differ: transformers then leaves them untied (with a
    warning), whatever the config says, and its forward reads the decoder's own (`tie_weights` in from_pretrained)."""
    return None not in (first, second) and not torch.equal(source.tensors.get(first), source.tensors.get(second))


def plan(source: Source, task_name: str | None = None) -> Plan:
    """Decide, for every source tensor, where it goes or why it is skipped; refuse anything else."""
    family_name, detected = detect_task(source)
    family = FAMILIES[family_name]
    task = task_named(task_name) if task_name else detected
    if not family.has(task):
        raise ConversionError(
            f"{source.config_path}: a {family_name} checkpoint has no {task.name!r} head "
            f"(its tasks: {', '.join(family.tasks)})"
        )
    config = encoderstack_config(source, family_name, task)
    head_keys = family.head_keys_of(task)
    source_names = {key: (family.local_name(name), transpose) for key, (name, transpose) in source.bert_names.items()}

    def source_key(target: str, pairs) -> str | None:  # found by the family's own names
        return next((key for key, (name, _) in source_names.items() if translate(name, pairs) == target), None)

    decoder, bias = source_key("lm_head.decoder.weight", head_keys), source_key("lm_head.decoder.bias", head_keys)
    if config.tie_word_embeddings and stored_apart(source, decoder, source_key(EMBEDDINGS, family.encoder_keys)):
        logging.getLogger(__name__).warning(
            "%s: tensor %r differs from the word embeddings, although %s says tie_word_embeddings=true: "
            "kept untied (tie_word_embeddings=false), as transformers loads it",
            source.tensors.file_of(decoder),
            decoder,
            source.config_path,
        )
        config.tie_word_embeddings = False
    # BERT's and RoBERTa's heads store their decoder's bias twice: the decoder's own is read where the two differ
    own_bias = next((key for key, (name, _) in source_names.items() if name in DECODER_OWN_BIASES), None)
    own_bias = own_bias if stored_apart(source, own_bias, bias) else None
    expected = expected_tensors(config, task.encoderstack_class)
    prefix = "" if task.name == "feature-extraction" else "model."
    other_heads = {pair: other.name for other in TASKS.values() if other != task for pair in family.head_keys_of(other)}
    blocks, skipped = {}, dict(source.skipped)  # blocks: target -> (block count, {block index: SourceRows})
    for key, (name, transpose) in sorted(source_names.items()):
        target = translate(name, family.encoder_keys, inner_group_num=config.inner_group_num)
        pieces = (
            [prefixed(piece, prefix) for piece in as_pieces(target)]
            if target
            else as_pieces(translate(name, head_keys))
        )
        if key == own_bias:
            pieces = [Piece("lm_head.decoder.bias")]
        if own_bias is not None and key == bias:
            skipped[key] = f"differs from the decoder's own bias {own_bias!r}, which {family.architecture(task)} reads"
        elif name in family.skipped and key != own_bias:
            skipped[key] = family.skipped[name]
        elif [piece.target for piece in pieces] == ["lm_head.decoder.weight"] and config.tie_word_embeddings:
            skipped[key] = "tied to the word embeddings (tie_word_embeddings=true)"
        elif not pieces:
            owner = next((other_heads[pair] for pair in other_heads if translate(name, [pair])), None)
            if owner is None:
                raise ConversionError(
                    f"{source.folder}: unknown tensor {key!r} (not part of a {family_name} checkpoint)"
                )
            skipped[key] = f"head of task {owner!r}, not used by task {task.name!r}"
        elif all(piece.target not in expected and piece.target.startswith(prefix + "pooler.") for piece in pieces):
            skipped[key] = f"pooler: {task.encoderstack_class} has none, as {family.architecture(task)}"
        else:
            check_source_tensor(source, key)
            for piece in pieces:
                if piece.target not in expected:
                    raise ConversionError(
                        f"{source.folder}: tensor {key!r} maps to {piece.target!r}, which {task.encoderstack_class} "
                        f"with norm_placement={config.norm_placement!r} does not have"
                    )
                rows = None
                if piece.rows is not None:
                    count = source.tensors.shape(key)[-1 if transpose else 0]
                    rows = tuple(piece.rows(config, count))
                    if not rows or max(rows) >= count:
                        raise ConversionError(
                            f"{source.folder}: tensor {key!r} has {count} rows, too few for {piece.target!r} "
                            "with this config"
                        )
                filled = blocks.setdefault(piece.target, (piece.of, {}))[1]
                if piece.block in filled:
                    raise ConversionError(
                        f"{source.folder}: tensors {filled[piece.block].key!r} and {key!r} both map to {piece.target!r}"
                    )
                filled[piece.block] = SourceRows(key, transpose, rows)
    mapped = {target: assemble(source, target, *filled, expected[target]) for target, filled in blocks.items()}

    # A source may lack the pooler (BERT's add_pooling_layer=False); a task chosen explicitly may lack its head.
    # Those start from the usual initialization and are listed; any other missing tensor is an error.
    def may_be_missing(key):
        in_head = bool(prefix) and not key.startswith(prefix)
        return key.startswith(prefix + "pooler.") or (task_name is not None and in_head)

    missing = sorted(key for key in expected if key not in mapped)
    if not all(may_be_missing(key) for key in missing):
        raise ConversionError(f"{source.folder}: missing tensors for {task.encoderstack_class}: {', '.join(missing)}")
    return Plan(family_name, task, config, mapped, skipped, missing)


def as_pieces(target) -> list[Piece]:
    """A key map's target (a name, a `Piece`, a tuple of them, or None) as a list of pieces."""
    if target is None:
        return []
    return [Piece(target)] if isinstance(target, str) else list(target) if isinstance(target, tuple) else [target]


def prefixed(piece: Piece, prefix: str) -> Piece:
    return dataclasses.replace(piece, target=prefix + piece.target)


def check_source_tensor(source: Source, key: str) -> None:
    dtype = source.tensors.dtype(key)
    if not dtype.is_floating_point:
        raise ConversionError(
            f"{source.tensors.file_of(key)}: tensor {key!r} is stored as {dtype}; a BERT weight is floating point"
        )
    if 0 in source.tensors.shape(key):
        raise ConversionError(
            f"{source.tensors.file_of(key)}: tensor {key!r} has shape {list(source.tensors.shape(key))}; "
            "no BERT has an empty weight"
        )


def assemble(source: Source, target: str, of: int, filled: dict, expected: tuple) -> tuple[SourceRows, ...]:
    """A target's row blocks in order, checked: every block given, one dtype, and the shape the config needs."""
    if sorted(filled) != list(range(of)):
        keys = ", ".join(repr(piece.key) for piece in filled.values())
        raise ConversionError(
            f"{source.folder}: {target!r} takes {of} source tensors, but the source has only {keys} for it"
        )
    pieces = tuple(filled[block] for block in range(of))
    shapes = [piece.shape(source.tensors) for piece in pieces]
    shape = (sum(shape[0] for shape in shapes), *shapes[0][1:])
    if any(tuple(other[1:]) != tuple(shapes[0][1:]) for other in shapes) or shape != tuple(expected):
        keys = ", ".join(repr(piece.key) for piece in pieces)
        given = list(shape) if len(pieces) == 1 else [list(other) for other in shapes]
        what = "has shape" if pieces[0].rows is None and len(pieces) == 1 else "gives shape"
        raise ConversionError(
            f"{source.folder}: tensor {keys} {what} {given}, but {target!r} needs {list(expected)} for this config"
        )
    if len({source.tensors.dtype(piece.key) for piece in pieces}) > 1:
        raise ConversionError(f"{source.folder}: {target!r} takes tensors of different dtypes")
    return pieces


def write_safetensors(path: Path, source: TensorSource, mapped: dict) -> None:
    """Stream the mapped tensors into one safetensors file: one source tensor in memory at a time (a target made of
    row blocks is written block by block, each block the rows of one source tensor)."""
    codes = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
    header, offset, order = {}, 0, sorted(mapped)
    for target in order:
        pieces = mapped[target]
        shapes = [piece.shape(source) for piece in pieces]
        shape = (sum(shape[0] for shape in shapes), *shapes[0][1:])
        dtype = source.dtype(pieces[0].key)
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[target] = {"dtype": codes[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for target in tqdm(order, desc="Writing tensors", unit="tensor", disable=None, leave=False):
            for piece in mapped[target]:
                tensor = piece.read(source).contiguous()
                if tensor.numel():
                    out.write(tensor.reshape(-1).view(torch.uint8).numpy())  # the tensor's own buffer, no copy


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether no value is NaN or infinite. min and max carry a NaN or an infinity through: one pass without a mask
    the size of the tensor, which made `isfinite(t).all()` 4.3 s of a 9.6 s bert-base conversion (aminmax: 19x less)."""
    if not tensor.is_floating_point() or not tensor.numel():
        return True
    low, high = tensor.aminmax()
    return bool(torch.isfinite(low) & torch.isfinite(high))


def write_encoderstack_folder(folder: Path, source: Source, conversion: Plan) -> None:
    config = conversion.config
    config.architectures = [conversion.task.encoderstack_class]
    config.auto_map = dict(AUTO_MAP)
    config.save_pretrained(folder)
    copy_code_files(folder)
    write_safetensors(folder / "model.safetensors", source.tensors, conversion.mapped)
    if source.write_extras is not None:
        source.write_extras(folder)
    if source.copy_other_files:
        copy_other_files(source, folder)


def convert(
    source_path,
    output_path,
    task: str | None = None,
    verify: bool = True,
    force: bool = False,
    gelu: str = "tanh",
    lowercase: bool | None = None,
    source_hub_id: str | None = None,
) -> Path:
    """Convert a BERT checkpoint (folder, Hub id, or TensorFlow checkpoint) into an EncoderStack folder; returns
    the output path. `source_hub_id` names the Hub model that a local source is a copy of (a Hub id source names
    itself): the record keeps it and the model card gives it as `base_model`.

    With `verify`, the result is compared with the reference transformers model on sample inputs, and a
    difference above 1e-5 on any output fails the conversion (nothing is written). For Google's TensorFlow
    releases, `gelu` picks the activation ("tanh": the original model's numbers; "erf": transformers' historical
    conversion) and `lowercase` the tokenizer's casing (default: from the folder name)."""
    task = task_named(task).name if task else None
    source = open_source(source_path, gelu=gelu, lowercase=lowercase)
    try:
        conversion = plan(source, task)
        output = OutputFolder(output_path, force, inputs=[source.folder])
        with output as folder, ThreadPoolExecutor(1) as hasher:
            # hashing the source (for the record) overlaps the write: hashlib releases the GIL on large reads
            digests = {file.name: hasher.submit(sha256, file) for file in source.tensors.files}
            write_encoderstack_folder(folder, source, conversion)
            report = {
                "encoderstack_version": __version__,
                "source": str(source_path),
                "source_hub_id": source_hub_id or hub_id(source_path),
                "source_format": source.tensors.format,
                "source_family": conversion.family,
                "source_architecture": (source.config.get("architectures") or [None])[0],
                "source_files": {name: digest.result() for name, digest in digests.items()},
                "task": conversion.task.name,
                "encoderstack_class": conversion.task.encoderstack_class,
                "norm_placement": conversion.config.norm_placement,
                **source.notes,
                "mapped": mapped_report(conversion.mapped),
                "skipped": conversion.skipped,
                "initialized": conversion.initialized,
            }
            if verify:
                report["parity"] = check_parity(source, conversion, folder)
                failures = [
                    f"{row['output']} ({backend}): {row['max_abs_diff']:.2e}"
                    for backend, rows in report["parity"]["results"].items()
                    for row in rows
                    if row["max_abs_diff"] > TOLERANCE
                ]
                if failures:
                    raise ConversionError(f"parity above {TOLERANCE:g} on {'; '.join(failures)}; nothing written")
            (folder / "conversion.json").write_text(json.dumps(report, indent=2) + "\n")
            write_card(folder, repo_id=output.path.name)  # the name it will have, not the partial one
        return output.path
    finally:
        source.tensors.close()


def mapped_report(mapped: dict) -> dict:
    """source key -> its target, or the targets it feeds where it feeds several (a fused projection)."""
    report = {}
    for target, pieces in sorted(mapped.items()):
        for piece in pieces:
            report.setdefault(piece.key, []).append(target)
    return {key: targets[0] if len(targets) == 1 else targets for key, targets in report.items()}


def check_parity(source: Source, conversion: Plan, folder: Path) -> dict:
    from .verify import verify_against_google_bert, verify_folder

    if source.reference == "source":
        return verify_folder(source.folder, conversion, folder)
    # No TensorFlow at run time: the reference is BERT's math over the checkpoint's variables, written out apart
    # from our key map, so that a wrong mapping (a missing transpose, a swapped norm) cannot hide in a round trip.
    return verify_against_google_bert(source.tensors, conversion, folder)


EXPORT_FAMILIES = {family.head_layout: name for name, family in FAMILIES.items() if family.export_config}


def export_family(config: EncoderStackConfig, folder: Path) -> str:
    """The family whose own classes express this folder's layout (BERT, RoBERTa for a converted RoBERTa, ALBERT for a
    converted ALBERT)."""
    family = EXPORT_FAMILIES.get(config.head_layout)
    if family is None:
        targets = " nor ".join(EXPORT_FAMILIES.values())
        raise ConversionError(f"{folder}: head_layout {config.head_layout!r} is exported to neither {targets}")
    offset = config.pad_token_id + 1 if family == "roberta" and config.pad_token_id is not None else None
    try:
        own = FAMILIES[family].export_fields(config)  # what its config has beyond BERT's (ALBERT: sharing, E)
    except ConversionError as error:
        raise ConversionError(f"{folder}: {error}") from None
    unsupported = {
        "norm_placement": (config.norm_placement, "post"),
        "norm_type": (config.norm_type, "layernorm"),
        "embedding_norm": (config.embedding_norm, True),
        "position_embedding_type": (config.position_embedding_type, "absolute"),
        "embedding_size": (config.embedding_size, None),
        "num_hidden_groups": (config.num_hidden_groups, None),
        "inner_group_num": (config.inner_group_num, 1),
        "position_offset": (config.position_offset, offset),
        "relative_attention": (config.relative_attention, None),
    }
    for field_name, (value, family_value) in unsupported.items():
        if field_name not in own and value != family_value:
            raise ConversionError(
                f"{folder}: {family} cannot express {field_name}={value!r} ({family} has {family_value!r})"
            )
    if config.type_vocab_size < 1:
        raise ConversionError(f"{folder}: {family} cannot express type_vocab_size=0 (it always has token types)")
    if config.hidden_act not in transformers.activations.ACT2FN:
        raise ConversionError(f"{folder}: {family} cannot express the gated activation {config.hidden_act!r}")
    return family


def export_bert(encoderstack_path, output_path, force: bool = False) -> Path:
    """A post-LN EncoderStack folder back to its family's own classes: a plain BERT folder (`BertModel` / the matching
    `BertFor*`), RoBERTa's (`RobertaModel` / `RobertaFor*`) for a converted RoBERTa, XLM-R or CamemBERT, or ALBERT's
    for a converted ALBERT (its shared layers and projected embeddings)."""
    folder = Path(encoderstack_path)
    config = read_config(folder)
    if config.get("model_type") != "encoderstack":
        raise ConversionError(f"{folder}: not an EncoderStack folder (model_type {config.get('model_type')!r})")
    try:
        config = EncoderStackConfig.from_dict(config)
    except Exception as error:  # the config's own validation says what is wrong
        raise ConversionError(f"{folder / 'config.json'}: {error}") from None
    family_name = export_family(config, folder)
    family = FAMILIES[family_name]
    class_name = (config.architectures or ["EncoderStackModel"])[0]
    try:
        task = task_for_encoderstack_class(class_name)
    except ConversionError as error:
        raise ConversionError(f"{folder / 'config.json'}: {error}") from None
    if not family.has(task):
        raise ConversionError(f"{folder}: {family_name} has no class for {class_name}")
    tensors = require_hf_weights(folder)
    prefix = "" if task.name == "feature-extraction" else "model."
    mapped = {}
    for key in tensors.keys():  # noqa: SIM118  (a lazy weights reader, not a dict)
        encoder_key = key.removeprefix(prefix) if key.startswith(prefix) else None
        name = translate(encoder_key, family.encoder_keys, True, config.inner_group_num) if encoder_key else None
        head = translate(key, family.head_keys_of(task), reverse=True)
        exported = ("" if task.name == "feature-extraction" else family.key_prefix) + name if name else head
        if exported is None:
            raise ConversionError(f"{folder}: tensor {key!r} has no {family_name} counterpart")
        mapped[exported] = (SourceRows(key),)
    if not config.tie_word_embeddings and "lm_head.decoder.bias" in tensors.keys():  # noqa: SIM118
        # untied, transformers 5 reads the decoder's own copy of the bias (it ties the two only with the embeddings)
        own_bias = next(name for name in DECODER_OWN_BIASES if name in family.skipped)
        mapped[own_bias] = (SourceRows("lm_head.decoder.bias"),)
    config_class = getattr(transformers, family.export_config)
    family_config = {name: getattr(config, name) for name in BERT_FIELDS if name in config_class.__dataclass_fields__}
    family_config |= family.export_fields(config)
    output = OutputFolder(output_path, force, inputs=[folder])
    with output as partial:
        config_class(
            **family_config, num_labels=config.num_labels, architectures=[family.architecture(task)]
        ).save_pretrained(partial)
        write_safetensors(partial / "model.safetensors", tensors, mapped)
        skip = set(WEIGHT_FILE_NAMES) | {"config.json", "conversion.json", *CODE_FILES}
        copy_other_files(Source(folder, {}, tensors, {}, own_files=tuple(skip)), partial)
        record = {"encoderstack_version": __version__, "exported_from": str(encoderstack_path)}
        (partial / "export.json").write_text(json.dumps(record, indent=2) + "\n")
    tensors.close()
    return output.path
