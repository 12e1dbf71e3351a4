"""NeoBERT's forward, transcribed for the conversion tests: NeoBERT is remote code only (chandar-lab/NeoBERT, whose
model.py needs xformers), so the reference is this independent transcription of its published equations, written
apart from EncoderStack's key map and layers:

- token embeddings `encoder`, no embedding norm; rotary positions on the complex pairs (2i, 2i+1) of every head,
  base 10 000, position = index in the row;
- each block pre-RMSNorm (x * rsqrt(mean(x^2) + eps) * weight): x += wo(attention(attention_norm(x))), then
  x += w3(silu(w1 h) * (w2 h)) with h = ffn_norm(x) and `ffn.w12` = [w1; w2] (xformers' SwiGLU), no biases;
- the fused `qkv` is [q; k; v] within each head (`qkv(x).view(batch, seq, heads, 3 * head_dim).chunk(3, -1)`);
- a final RMSNorm `layer_norm`; NeoBERTLMHead: `decoder` (with bias) on every token; NeoBERTHFForSequenceClassification:
  `classifier(tanh(dense(h[:, 0])))`.
"""

import json

import torch
from safetensors.torch import save_file
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_pairs(x, theta=10000.0):
    """x: (batch, seq, heads, head_dim); each pair (2i, 2i+1) as one complex number, turned by position * w_i."""
    head_dim = x.shape[-1]
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    turns = torch.polar(
        torch.ones(x.shape[1], head_dim // 2), torch.outer(torch.arange(x.shape[1]).float(), frequencies)
    )
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * turns[None, :, None, :]).flatten(3)


class SwiGLU(nn.Module):
    def __init__(self, hidden, inner):
        super().__init__()
        self.w12 = nn.Linear(hidden, 2 * inner, bias=False)
        self.w3 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        w1x, w2x = self.w12(x).chunk(2, dim=-1)
        return self.w3(nn.functional.silu(w1x) * w2x)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, self.heads = config["hidden_size"], config["num_attention_heads"]
        inner = 8 * ((int(2 * config["intermediate_size"] / 3) + 7) // 8)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        self.ffn = SwiGLU(hidden, inner)
        self.attention_norm = RMSNorm(hidden, config["norm_eps"])
        self.ffn_norm = RMSNorm(hidden, config["norm_eps"])

    def forward(self, x, additive_mask):
        batch, seq, hidden = x.shape
        head_dim = hidden // self.heads
        q, k, v = self.qkv(self.attention_norm(x)).view(batch, seq, self.heads, 3 * head_dim).chunk(3, dim=-1)
        q, k = rotate_pairs(q), rotate_pairs(k)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / head_dim**0.5 + additive_mask
        attended = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(batch, seq, hidden)
        x = x + self.wo(attended)
        return x + self.ffn(self.ffn_norm(x))


class NeoBERT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.encoder = nn.Embedding(config["vocab_size"], config["hidden_size"], padding_idx=config["pad_token_id"])
        self.transformer_encoder = nn.ModuleList(Block(config) for _ in range(config["num_hidden_layers"]))
        self.layer_norm = RMSNorm(config["hidden_size"], config["norm_eps"])

    def forward(self, input_ids, attention_mask):
        additive = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        x = self.encoder(input_ids)
        for block in self.transformer_encoder:
            x = block(x, additive)
        return self.layer_norm(x)


class NeoBERTLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = NeoBERT(config)
        self.decoder = nn.Linear(config["hidden_size"], config["vocab_size"])

    def forward(self, input_ids, attention_mask):
        return self.decoder(self.model(input_ids, attention_mask))


class NeoBERTHFForSequenceClassification(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = NeoBERT(config)
        self.dense = nn.Linear(config["hidden_size"], config["hidden_size"])
        self.classifier = nn.Linear(config["hidden_size"], config["num_labels"])

    def forward(self, input_ids, attention_mask):
        return self.classifier(torch.tanh(self.dense(self.model(input_ids, attention_mask)[:, 0])))


CLASSES = {cls.__name__: cls for cls in (NeoBERT, NeoBERTLMHead, NeoBERTHFForSequenceClassification)}


def neobert_folder(folder, architecture: str, seed: int = 0):
    """A random NeoBERT of the given class saved as the Hub's checkpoints are (config.json, model.safetensors);
    returns the folder and the reference model, in eval mode."""
    config = {
        "model_type": "neobert",
        "architectures": [architecture],
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 60,  # SwiGLU width int(2 * 60 / 3) = 40, a multiple of 8
        "norm_eps": 1e-6,
        "vocab_size": 99,
        "pad_token_id": 1,
        "max_length": 64,
        "rope": True,
        "rms_norm": True,
        "hidden_act": "SwiGLU",
        "dropout": 0.0,
        "num_labels": 3,
    }
    torch.manual_seed(seed)
    model = CLASSES[architecture](config).eval()
    with torch.no_grad():
        for param in model.parameters():  # away from the init so that no weight is trivially 0 or 1
            param.add_(torch.randn_like(param) * 0.05)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, folder / "model.safetensors")
    return folder, model
