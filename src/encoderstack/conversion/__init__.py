"""Conversion of BERT checkpoints (Hugging Face format, Megatron-BERT, Google's TensorFlow release) to EncoderStack."""

from ..modeling_encoderstack import EncoderStackPreTrainedModel
from .converter import convert, export_bert, load_converted
from .keymap import TASKS, ConversionError

EncoderStackPreTrainedModel.checkpoint_converter = staticmethod(load_converted)

__all__ = ["TASKS", "ConversionError", "convert", "export_bert"]
