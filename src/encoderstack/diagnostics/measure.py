"""Per-layer measurements on any EncoderStack model: gradient norms, activation scale, and similarity across depth.

Each runs the model in eval mode (dropout off, so the numbers depend only on the weights and the batch) and puts
back the mode it found. Only real tokens count: positions where `attention_mask` is 0 are left out.
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..modeling_encoderstack import EncoderStackForMaskedLM, EncoderStackPreTrainedModel

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")


@dataclass
class ResidualStreams:
    """The embedding output and every layer's output, as the next layer reads them (before any final norm).

    `hidden[i]` is the stream after layer i (`hidden[0]`: the embeddings), the `a` stream for ResiDual; `dual[i]` is
    ResiDual's un-normalized `d` stream in units of the embeddings (divided by `resi_dual_scale`), None otherwise.
    """

    hidden: list[torch.Tensor]
    dual: list[torch.Tensor] | None
    real_tokens: torch.Tensor  # (batch, seq) bool


@contextmanager
def eval_mode(model: nn.Module):
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def real_token_mask(batch: dict) -> torch.Tensor:
    attention_mask = batch.get("attention_mask")
    if attention_mask is None:
        return torch.ones(batch["input_ids"].shape[:2], dtype=torch.bool)
    return attention_mask.bool()


def model_inputs(batch: dict) -> dict:
    return {key: value for key, value in batch.items() if key in MODEL_INPUTS}


@torch.no_grad()
def residual_streams(model: EncoderStackPreTrainedModel, batch: dict) -> ResidualStreams:
    """Read the streams with forward hooks: `output_hidden_states` replaces the last layer's output with the model's
    final output (after the final norm, or `a + LN(d)` for ResiDual) and never shows ResiDual's `d` stream."""
    encoder = model.base_model
    outputs = []

    def keep(module, args, output):
        outputs.append(output)

    hooks = [module.register_forward_hook(keep) for module in (encoder.embeddings, *encoder.layers)]
    try:
        with eval_mode(encoder):  # recording hidden states keeps the padded path: every stream is (batch, seq, hidden)
            encoder(**model_inputs(batch), output_hidden_states=True)
    finally:
        for hook in hooks:
            hook.remove()
    embeddings, *layers = outputs
    hidden = [embeddings] + [stream for stream, _ in layers]
    dual = None
    if layers[-1][1] is not None:  # ResiDual: d starts from the embeddings too
        dual = [embeddings] + [stream / encoder.config.resi_dual_scale for _, stream in layers]
    return ResidualStreams(hidden=hidden, dual=dual, real_tokens=real_token_mask(batch))


def rms(tensor: torch.Tensor, real_tokens: torch.Tensor) -> float:
    return tensor[real_tokens].float().pow(2).mean().sqrt().item()


def activation_rms_per_layer(model: EncoderStackPreTrainedModel, batch: dict) -> dict[str, list[float]]:
    """Root mean square of the stream after the embeddings and after each layer: `{"hidden": [...]}` (N + 1 values),
    plus `"dual"` for ResiDual's `d` stream."""
    streams = residual_streams(model, batch)
    curves = {"hidden": [rms(h, streams.real_tokens) for h in streams.hidden]}
    if streams.dual is not None:
        curves["dual"] = [rms(d, streams.real_tokens) for d in streams.dual]
    return curves


def mean_cosine(first: torch.Tensor, second: torch.Tensor, real_tokens: torch.Tensor) -> float:
    similarity = nn.functional.cosine_similarity(first[real_tokens].float(), second[real_tokens].float(), dim=-1)
    return similarity.mean().item()


def consecutive_layer_similarity(model: EncoderStackPreTrainedModel, batch: dict) -> dict[str, list[float]]:
    """Mean over real tokens of cos(h_{i-1}, h_i) for each layer i = 1..N (the input of layer 1 is the embedding
    output). Values near 1 in the upper layers mean those layers barely change the representation: the collapse
    signal. Keys as in `activation_rms_per_layer`."""
    streams = residual_streams(model, batch)
    curves = {"hidden": streams.hidden}
    if streams.dual is not None:
        curves["dual"] = streams.dual
    return {
        name: [mean_cosine(before, after, streams.real_tokens) for before, after in zip(states, states[1:])]
        for name, states in curves.items()
    }


def angular_distance_per_layer(model: EncoderStackPreTrainedModel, batch: dict) -> list[float]:
    """Mean over real tokens of arccos(cos(h_{i-1}, h_i)) / pi for each layer i = 1..N, on the hidden stream: the
    "curse of depth" redundancy measure (Sun et al. 2025, after Gromov et al. 2024), 0 for a layer that leaves the
    direction of every token unchanged, 1 for one that reverses it. In float64: near cos = 1, where redundant layers
    sit, arccos magnifies a float32 rounding of the cosine a hundredfold."""
    streams = residual_streams(model, batch)
    real = streams.real_tokens
    return [
        torch.nn.functional.cosine_similarity(before[real].double(), after[real].double(), dim=-1)
        .clamp(-1.0, 1.0)
        .arccos()
        .div(math.pi)
        .mean()
        .item()
        for before, after in zip(streams.hidden, streams.hidden[1:])
    ]


def readout_surrogate_loss(last_hidden_state: torch.Tensor, real_tokens: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The loss for a model without an MLM head: a fixed random linear read-out of the encoder output,
    mean over real tokens of <h, r> with r ~ N(0, I) drawn from `seed`, one r per position."""
    generator = torch.Generator().manual_seed(seed)
    readout = torch.randn(last_hidden_state.shape, generator=generator).to(last_hidden_state)
    return (last_hidden_state * readout)[real_tokens].sum() / real_tokens.sum()


def gradient_norms_per_layer(model: EncoderStackPreTrainedModel, batch: dict) -> list[float]:
    """The L2 norm of all of layer i's parameter gradients after one backward pass, for each layer i = 1..N.

    The loss is the masked-LM loss for an `EncoderStackForMaskedLM` (the batch must hold `labels`), and
    `readout_surrogate_loss` on the encoder output for any other model. Gradients are cleared before and after.
    """
    with eval_mode(model):
        model.zero_grad(set_to_none=True)
        if isinstance(model, EncoderStackForMaskedLM):
            loss = model(**model_inputs(batch), labels=batch["labels"]).loss
        else:
            loss = readout_surrogate_loss(
                model.base_model(**model_inputs(batch)).last_hidden_state, real_token_mask(batch)
            )
        loss.backward()
        norms = [layer_gradient_norm(layer) for layer in model.base_model.layers]
        model.zero_grad(set_to_none=True)
    return norms


def layer_gradient_norm(layer: nn.Module) -> float:
    grads = [param.grad.flatten() for param in layer.parameters() if param.grad is not None]
    return torch.linalg.vector_norm(torch.cat(grads)).item()
