"""EncoderStack: BERT's encoder stack with the normalization placement as a config choice, as a transformers plugin.

Importing the package registers the config and every model class with the Auto classes (importing twice is harmless).
"""

import transformers

from . import modeling_encoderstack
from .configuration_encoderstack import EncoderStackConfig
from .modeling_encoderstack import (
    AUTO_MAP,
    EncoderStackForMaskedLM,
    EncoderStackForMultipleChoice,
    EncoderStackForPreTraining,
    EncoderStackForQuestionAnswering,
    EncoderStackForSequenceClassification,
    EncoderStackForTokenClassification,
    EncoderStackModel,
    EncoderStackPreTrainedModel,
)
from .version import __version__  # noqa: F401  (encoderstack.__version__)


def _register() -> None:
    transformers.AutoConfig.register(EncoderStackConfig.model_type, EncoderStackConfig, exist_ok=True)
    EncoderStackConfig.register_for_auto_class()
    for auto_name, reference in AUTO_MAP.items():
        if auto_name == "AutoConfig":
            continue
        model_class = getattr(modeling_encoderstack, reference.split(".")[-1])
        getattr(transformers, auto_name).register(EncoderStackConfig, model_class, exist_ok=True)
        model_class.register_for_auto_class(auto_name)


_register()

from .conversion import ConversionError, convert, export_bert  # noqa: E402  (after registration: it needs it)
from .export_onnx import ExportError, export_onnx  # noqa: E402
from .hub import push_folder  # noqa: E402  (also makes every model's push_to_hub publish the EncoderStack way)
from .hub_card import HubError, build_card, write_card  # noqa: E402
from .output_folder import OutputFolderError  # noqa: E402

__all__ = [
    "AUTO_MAP",
    "ConversionError",
    "ExportError",
    "HubError",
    "OutputFolderError",
    "build_card",
    "convert",
    "export_bert",
    "export_onnx",
    "push_folder",
    "write_card",
    "EncoderStackConfig",
    "EncoderStackPreTrainedModel",
    "EncoderStackModel",
    "EncoderStackForMaskedLM",
    "EncoderStackForPreTraining",
    "EncoderStackForSequenceClassification",
    "EncoderStackForTokenClassification",
    "EncoderStackForQuestionAnswering",
    "EncoderStackForMultipleChoice",
]
