"""Read a checkpoint's tensors one at a time, whatever file format holds them.

safetensors first; a pickle checkpoint only through `torch.load(weights_only=True)`. Every reader raises
`ConversionError` naming the file for a file it cannot read.
"""

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .keymap import ConversionError

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
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
            for key in handle.keys():
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


class TorchPickleSource(TensorSource):
    format = "pytorch_model.bin (torch.load, weights_only=True)"

    def __init__(self, files: list[Path]):
        self.files = files
        self._tensors = {}
        for file in files:
            state = self._load(file)
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise ConversionError(f"{file}: expected a flat state dict of tensors")
            self._tensors.update(state)

    @staticmethod
    def _load(file: Path):
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


def _reason(error: Exception) -> str:
    """torch.load's own message is a page long; keep the line that says what was wrong."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    refused = next((line for line in lines if line.startswith("WeightsUnpickler error:")), None)
    if refused:
        return "refused by torch.load(weights_only=True): " + refused.removeprefix("WeightsUnpickler error: ")
    return lines[0] if lines else type(error).__name__


def _sharded(folder: Path, index_name: str) -> list[Path]:
    index = folder / index_name
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConversionError(f"{index}: not a readable shard index ({error})") from None
    names = sorted(set(weight_map.values()))
    for name in names:  # a shard index names files of its own folder; anything else is a crafted index
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ConversionError(f"{index}: shard {name!r} lies outside the folder {folder}; not read")
    files = [folder / name for name in names]
    for file in files:
        if not file.is_file():
            raise ConversionError(f"{index}: shard {file.name} is missing")
    return files


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


WEIGHT_FILE_NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                     "pytorch_model.bin.index.json")
