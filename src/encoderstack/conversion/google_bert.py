"""Google BERT's forward pass (google-research/bert `modeling.py`) in float64 numpy, read straight from a TensorFlow
checkpoint's variables: the reference a TensorFlow conversion is verified against, independent of our key map, of
our model and of transformers' BERT."""

import math

import numpy as np
import torch

from .keymap import ConversionError


def gelu(x: np.ndarray, form: str) -> np.ndarray:
    if form == "tanh":  # Google's `gelu`
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + torch.special.erf(torch.from_numpy(x / math.sqrt(2.0))).numpy())


ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: gelu(x, "tanh"),
    "gelu_new": lambda x: gelu(x, "tanh"),
    "gelu": lambda x: gelu(x, "erf"),
    "relu": lambda x: np.maximum(x, 0.0),
}


def layer_norm(x, gamma, beta, eps):
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + eps) * gamma + beta


class GoogleBert:
    """`outputs(batch)`: every output the converted class gives, named as it names them, from the TF variables."""

    def __init__(self, tensors, config, task: str):
        if config.hidden_act not in ACTIVATIONS:
            raise ConversionError(f"verification has no reference for hidden_act={config.hidden_act!r}")
        self.tensors, self.config, self.task = tensors, config, task
        self.names = set(tensors.keys())
        self.act = ACTIVATIONS[config.hidden_act]

    def w(self, name):
        return self.tensors.get(name).double().numpy()

    def dense(self, x, scope):
        return x @ self.w(f"{scope}/kernel") + self.w(f"{scope}/bias")

    def norm(self, x, scope):
        return layer_norm(x, self.w(f"{scope}/gamma"), self.w(f"{scope}/beta"), self.config.layer_norm_eps)

    def encoder(self, ids, types, mask):
        seq = ids.shape[1]
        x = (
            self.w("bert/embeddings/word_embeddings")[ids]
            + self.w("bert/embeddings/token_type_embeddings")[types]
            + self.w("bert/embeddings/position_embeddings")[:seq]
        )
        x = self.norm(x, "bert/embeddings/LayerNorm")
        hidden_states = [x]
        heads = self.config.num_attention_heads
        head_dim = x.shape[-1] // heads
        additive = (1.0 - mask[:, None, None, :]) * -10000.0
        for n in range(self.config.num_hidden_layers):
            scope = f"bert/encoder/layer_{n}"
            split = lambda t: t.reshape(*t.shape[:2], heads, head_dim).transpose(0, 2, 1, 3)  # noqa: E731
            q, k, v = (split(self.dense(x, f"{scope}/attention/self/{part}")) for part in ("query", "key", "value"))
            scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(head_dim) + additive
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            context = (probs @ v).transpose(0, 2, 1, 3).reshape(x.shape)
            attended = self.dense(context, f"{scope}/attention/output/dense")
            x = self.norm(attended + x, f"{scope}/attention/output/LayerNorm")
            inner = self.act(self.dense(x, f"{scope}/intermediate/dense"))
            x = self.norm(self.dense(inner, f"{scope}/output/dense") + x, f"{scope}/output/LayerNorm")
            hidden_states.append(x)
        return hidden_states

    def outputs(self, batch: dict) -> dict[str, torch.Tensor]:
        ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].double().numpy()
        types = batch["token_type_ids"].numpy() if "token_type_ids" in batch else np.zeros_like(ids)
        hidden_states = self.encoder(ids, types, mask)
        sequence = hidden_states[-1]
        out = {"last_hidden_state": sequence}
        if "bert/pooler/dense/kernel" in self.names:  # else a new pooler, which verification skips
            pooled = out["pooler_output"] = np.tanh(self.dense(sequence[:, 0], "bert/pooler/dense"))
        if self.task in ("fill-mask", "pretraining") and "cls/predictions/output_bias" in self.names:
            transformed = self.norm(
                self.act(self.dense(sequence, "cls/predictions/transform/dense")), "cls/predictions/transform/LayerNorm"
            )
            lm = transformed @ self.w("bert/embeddings/word_embeddings").T + self.w("cls/predictions/output_bias")
            out["logits" if self.task == "fill-mask" else "prediction_logits"] = lm
        if self.task == "pretraining" and "cls/seq_relationship/output_weights" in self.names:
            out["seq_relationship_logits"] = pooled @ self.w("cls/seq_relationship/output_weights").T + self.w(
                "cls/seq_relationship/output_bias"
            )
        if self.task == "text-classification" and "output_weights" in self.names:
            out["logits"] = pooled @ self.w("output_weights").T + self.w("output_bias")
        if self.task == "question-answering" and "cls/squad/output_weights" in self.names:
            spans = sequence @ self.w("cls/squad/output_weights").T + self.w("cls/squad/output_bias")
            out["start_logits"], out["end_logits"] = spans[..., 0], spans[..., 1]
        outputs = {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in out.items()}
        outputs["hidden_states"] = tuple(torch.from_numpy(h) for h in hidden_states)
        return outputs
