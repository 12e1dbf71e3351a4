"""Conversion of BERT checkpoints (Hugging Face format, Megatron-BERT, Google's TensorFlow release) to EncoderStack."""

from .converter import convert, export_bert, load_converted
from .keymap import TASKS, ConversionError

__all__ = ["TASKS", "ConversionError", "convert", "export_bert", "load_converted"]
