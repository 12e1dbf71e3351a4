"""Read a checkpoint's tensors one at a time, whatever file format holds them.

safetensors first; a pickle checkpoint only through `torch.load(weights_only=True)`. Every reader raises
`ConversionError` naming the file for a file it cannot read. A `Source` is what each dialect (a Hugging Face folder,
Google's TensorFlow release in tensorflow.py) opens a checkpoint as.
"""

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..jsonfile import read_json_object
from .keymap import ConversionError

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class TensorSource:
    """Names, shapes and dtypes up front; the tensors themselves only when asked for, one at a time."""

    files: list[Path]
    format: str

    def keys(self) -> list[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, key: str) -> torch.dtype:
        raise NotImplementedError

    def get(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def file_of(self, key: str) -> Path:
        """The file that holds `key`, for messages."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class SafetensorsSource(TensorSource):
    format = "safetensors"

    def __init__(self, files: list[Path]):
        self.files = files
        self._handles, self._owner = [], {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as error:
                raise ConversionError(f"{file}: not a readable safetensors file ({error})") from None
            self._handles.append(handle)
            for key in handle.keys():  # noqa: SIM118  (safe_open is not iterable)
                if key in self._owner:
                    raise ConversionError(f"{file}: tensor {key!r} is also in {self._owner[key][0]}")
                self._owner[key] = (file, handle)

    def keys(self):
        return sorted(self._owner)

    def shape(self, key):
        return tuple(self._owner[key][1].get_slice(key).get_shape())

    def dtype(self, key):
        name = self._owner[key][1].get_slice(key).get_dtype()
        if name not in SAFETENSORS_DTYPES:
            raise ConversionError(f"{self._owner[key][0]}: tensor {key!r} has unsupported dtype {name}")
        return SAFETENSORS_DTYPES[name]

    def get(self, key):
        return self._owner[key][1].get_tensor(key)

    def file_of(self, key):
        return self._owner[key][0]


class TorchPickleSource(TensorSource):
    format = "pytorch_model.bin (torch.load, weights_only=True)"

    def __init__(self, files: list[Path]):
        self.files = files
        self._tensors, self._owner = {}, {}
        for file in files:
            state = self._load(file)
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise ConversionError(f"{file}: expected a flat state dict of tensors")
            self._tensors.update(state)
            self._owner.update(dict.fromkeys(state, file))

    @staticmethod
    def _load(file: Path):
        with warnings.catch_warnings():  # torch warns about pickle protocols: the error is the one line we print
            warnings.simplefilter("ignore", UserWarning)
            try:  # memory-mapped where the file is a zip archive (torch >= 1.6), so nothing is read twice
                return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as error:  # malformed, truncated or hostile: an unpickling error says which
                if "mmap" not in str(error):
                    raise ConversionError(f"{file}: not a readable PyTorch checkpoint ({_reason(error)})") from None
            try:
                return torch.load(file, map_location="cpu", weights_only=True)
            except Exception as error:
                raise ConversionError(f"{file}: not a readable PyTorch checkpoint ({_reason(error)})") from None

    def keys(self):
        return sorted(self._tensors)

    def shape(self, key):
        return tuple(self._tensors[key].shape)

    def dtype(self, key):
        return self._tensors[key].dtype

    def get(self, key):
        return self._tensors[key]

    def file_of(self, key):
        return self._owner[key]


def _reason(error: Exception) -> str:
    """torch.load's own message is a page long, and for a refused pickle it advises `weights_only=False`, which
    would run whatever the pickle holds: keep only the sentence that says what was wrong."""
    text = str(error).replace("WeightsUnpickler error:", "\n\n")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not paragraphs or not paragraphs[0].startswith("Weights only load failed"):
        return paragraphs[0] if paragraphs else type(error).__name__
    reasons = [p for p in paragraphs[1:] if "weights_only" not in p and not p.startswith("Check the documentation")]
    reason = reasons[0].split(". ")[0].rstrip(".") if reasons else "it holds something other than tensors"
    return f"refused by torch.load(weights_only=True): {reason}"


def _sharded(folder: Path, index_name: str) -> list[Path]:
    index = folder / index_name
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConversionError(f"{index}: not a readable shard index ({error})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
        raise ConversionError(
            f"{index}: weight_map must be an object of tensor name -> shard file name, got {type(weight_map).__name__}"
        )
    names = sorted(set(weight_map.values()))
    for name in names:  # a shard index names files of its own folder; anything else is a crafted index
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ConversionError(f"{index}: shard {name!r} lies outside the folder {folder}; not read")
    files = [folder / name for name in names]
    for file in files:
        if not file.is_file():
            raise ConversionError(f"{index}: shard {file.name} is missing")
    return files


def has_hf_weights(folder: Path) -> bool:
    return any((folder / name).is_file() for name in WEIGHT_FILE_NAMES)


def open_hf_weights(folder: Path) -> TensorSource | None:
    """The weights of a Hugging Face model folder, preferring safetensors; None if it holds none."""
    if (folder / "model.safetensors").is_file():
        return SafetensorsSource([folder / "model.safetensors"])
    if (folder / "model.safetensors.index.json").is_file():
        return SafetensorsSource(_sharded(folder, "model.safetensors.index.json"))
    if (folder / "pytorch_model.bin").is_file():
        return TorchPickleSource([folder / "pytorch_model.bin"])
    if (folder / "pytorch_model.bin.index.json").is_file():
        return TorchPickleSource(_sharded(folder, "pytorch_model.bin.index.json"))
    return None


def require_hf_weights(folder: Path) -> TensorSource:
    """`open_hf_weights`, refusing a folder without weights; a file that does not read (truncated, not a checkpoint)
    is refused by its reader, naming the file."""
    tensors = open_hf_weights(folder)
    if tensors is None:
        raise ConversionError(f"{folder}: no weights found (looked for {', '.join(WEIGHT_FILE_NAMES)})")
    return tensors


WEIGHT_FILE_NAMES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass
class Source:
    """A checkpoint to convert: its folder, its config as a dict, its tensors, and how to name them in BERT terms."""

    folder: Path
    config: dict
    tensors: TensorSource
    bert_names: dict  # source key -> (Hugging Face BERT key, transpose?)
    skipped: dict = field(default_factory=dict)  # source keys skipped before mapping (optimizer slots, ...)
    own_files: tuple = ()  # files that make up the checkpoint itself, not copied to the output
    copy_other_files: bool = True  # copy the folder's other files (tokenizer, modules, ...) as they are
    notes: dict = field(default_factory=dict)  # choices made for this source, recorded in conversion.json
    write_extras: Callable[[Path], None] | None = None  # e.g. a tokenizer built from a TF release's vocab.txt
    reference: str = "source"  # verify against the source folder, or "google": Google's math over the tensors
    config_file: str = "config.json"

    @property
    def config_path(self) -> Path:
        return self.folder / self.config_file


def read_config(folder: Path, name: str = "config.json") -> dict:
    return read_json_object(folder / name, ConversionError)


def copy_other_files(source: Source, folder: Path) -> None:
    """Every file of the source that is not the checkpoint itself (tokenizer, sentence-transformers modules, ...).

    A link that leads out of the source folder is refused: the output may be published, and a checkout can hold a
    link to any file of the machine. (A Hub snapshot's files are links into the Hub cache, which is allowed.)"""
    from huggingface_hub import constants

    roots = [Path(os.path.realpath(path)) for path in (source.folder, constants.HF_HUB_CACHE)]

    def copy_inside(item, destination):
        real = Path(os.path.realpath(item))
        if not any(root == real or root in real.parents for root in roots):
            raise ConversionError(
                f"{item}: a link to {real}, outside the source folder; not copied (copy the "
                "file into the folder to include it)"
            )
        shutil.copyfile(item, destination)

    for item in sorted(source.folder.iterdir()):
        if item.name in source.own_files or item.name.startswith(".") or (folder / item.name).exists():
            continue
        if item.is_dir():
            shutil.copytree(item, folder / item.name, copy_function=copy_inside)
        elif item.is_file():
            copy_inside(item, folder / item.name)
