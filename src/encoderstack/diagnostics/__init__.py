"""Why normalization placement matters, measured: per-layer diagnostics for any EncoderStack model, a synthetic
masked-LM task to train on, and the report that puts them together (`encoderstack diagnose`, in commands/); `--corpus`
trains on real text instead, through the pre-training data path (`diagnostics.corpus`).

The measurements take a model and a batch (`input_ids`, optionally `attention_mask` / `token_type_ids` /
`position_ids`, and `labels` for the masked-LM loss) and work on any EncoderStack model, a converted checkpoint
included. The plots need matplotlib (`pip install 'encoderstack[diagnostics]'`).
"""

from .measure import (
    ResidualStreams,
    activation_rms_per_layer,
    angular_distance_per_layer,
    consecutive_layer_similarity,
    gradient_norms_per_layer,
    readout_surrogate_loss,
    residual_streams,
)
from .report import QUICK, ReportSettings, run_report
from .synthetic import SyntheticMLMTask, TrainingRun, diagnostic_config, divergence, train_synthetic_mlm

__all__ = [
    "QUICK",
    "ReportSettings",
    "ResidualStreams",
    "SyntheticMLMTask",
    "TrainingRun",
    "activation_rms_per_layer",
    "angular_distance_per_layer",
    "consecutive_layer_similarity",
    "diagnostic_config",
    "divergence",
    "gradient_norms_per_layer",
    "readout_surrogate_loss",
    "residual_streams",
    "run_report",
    "train_synthetic_mlm",
]
