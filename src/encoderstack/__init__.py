"""EncoderStack: BERT's encoder stack with the normalization placement as a config choice, as a transformers plugin.

Importing the package calls `register()`: the Auto classes, and the hooks it adds to the model classes.
"""

import transformers

from . import modeling_encoderstack
from .configuration_encoderstack import EncoderStackConfig
from .conversion import ConversionError, convert, export_bert, load_converted
from .exporters import ExportError, export, export_onnx, export_openvino
from .hub import push_folder, push_model
from .hub_card import HubError, build_card, write_card
from .modeling_encoderstack import (
    AUTO_MAP,
    EncoderStackForMaskedLM,
    EncoderStackForMultipleChoice,
    EncoderStackForPreTraining,
    EncoderStackForQuestionAnswering,
    EncoderStackForReplacedTokenDetection,
    EncoderStackForSequenceClassification,
    EncoderStackForTokenClassification,
    EncoderStackModel,
    EncoderStackPreTrainedModel,
)
from .output_folder import OutputFolderError
from .version import __version__


def register() -> None:
    """Everything the installed package adds to transformers and to the model classes, in one place (importing the
    package calls it; calling it again is harmless):

    - the config and every model class, registered with the Auto classes;
    - `from_pretrained` of every EncoderStack class also converts BERT checkpoints on the fly (`load_converted`);
    - `push_to_hub` checks what it sends and writes the EncoderStack model card (`push_model`).

    The three code files travel with every checkpoint for `trust_remote_code=True`; there these hooks are None and the
    classes load EncoderStack checkpoints and push the way transformers does.
    """
    transformers.AutoConfig.register(EncoderStackConfig.model_type, EncoderStackConfig, exist_ok=True)
    EncoderStackConfig.register_for_auto_class()
    for auto_name, reference in AUTO_MAP.items():
        if auto_name == "AutoConfig":
            continue
        model_class = getattr(modeling_encoderstack, reference.split(".")[-1])
        getattr(transformers, auto_name).register(EncoderStackConfig, model_class, exist_ok=True)
        model_class.register_for_auto_class(auto_name)
    EncoderStackPreTrainedModel.checkpoint_converter = staticmethod(load_converted)
    EncoderStackPreTrainedModel.hub_publisher = staticmethod(push_model)


register()

__all__ = [
    "__version__",
    "AUTO_MAP",
    "ConversionError",
    "ExportError",
    "HubError",
    "OutputFolderError",
    "build_card",
    "convert",
    "export",
    "export_bert",
    "export_onnx",
    "export_openvino",
    "push_folder",
    "register",
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
    "EncoderStackForReplacedTokenDetection",
]
