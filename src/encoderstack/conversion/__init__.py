"""Conversion of BERT checkpoints (Hugging Face format, Megatron-BERT, Google's TensorFlow release) to EncoderStack."""

from .converter import convert, export_bert
from .keymap import TASKS, ConversionError
from .on_the_fly import load_converted

__all__ = ["TASKS", "ConversionError", "convert", "export_bert", "load_converted"]
