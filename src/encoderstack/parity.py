"""How EncoderStack's outputs are compared with a reference (transformers, Google's math, ONNX Runtime): on the real
tokens only, and reported as the largest difference per output and backend."""

import torch


def real_tokens(tensor: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The real-token (not padding) rows of a per-token tensor; a sequence-level tensor (pooler, class logits) whole."""
    if tensor.dim() >= 2 and tuple(tensor.shape[:2]) == tuple(attention_mask.shape):
        return tensor[attention_mask.bool()]
    return tensor


def parity_rows(parity: dict, missing: str = "–") -> tuple[list[str], list[tuple[str, list[str]]]]:
    """A parity record (conversion.json's, export.json's) as a table: its backends, and one row per output with each
    backend's largest difference (`missing` where a backend has none)."""
    backends = list(parity["results"])
    values = {}
    for backend, results in parity["results"].items():
        for row in results:
            values.setdefault(row["output"], {})[backend] = row["max_abs_diff"]
    return backends, [
        (output, [f"{row[b]:.2e}" if b in row else missing for b in backends]) for output, row in values.items()
    ]
