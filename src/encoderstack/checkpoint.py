"""What an EncoderStack checkpoint folder holds, for every command that writes or checks one (convert, export,
fine-tune, pre-train, push): the files that travel with the weights, and the tensors the weights must be."""

import hashlib
import shutil
from pathlib import Path

import torch

from . import modeling_encoderstack
from .configuration_encoderstack import EncoderStackConfig

# `trust_remote_code=True` loads the model from these three, so they travel with every checkpoint.
CODE_FILES = ("configuration_encoderstack.py", "execution_encoderstack.py", "modeling_encoderstack.py")
# A folder has a tokenizer when it holds one of these (tokenizer_config.json and the others only accompany them).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "sentencepiece.bpe.model")


def copy_code_files(folder: Path) -> None:
    for name in CODE_FILES:
        shutil.copyfile(Path(__file__).with_name(name), folder / name)


def has_tokenizer(folder: Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def expected_tensors(config: EncoderStackConfig, class_name: str) -> dict:
    """Every tensor `class_name` stores, with its shape (built on the meta device: no memory, no init)."""
    with torch.device("meta"):
        model = getattr(modeling_encoderstack, class_name)(config)
    tied = set(model._tied_weights_keys or {}) if config.tie_word_embeddings else set()
    return {key: tuple(value.shape) for key, value in model.state_dict().items() if key not in tied}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()
