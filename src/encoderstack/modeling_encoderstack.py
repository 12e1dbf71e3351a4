"""EncoderStack: BERT's bidirectional encoder stack with the normalization placement as a config choice.

Read top to bottom: embeddings, attention (with `Packing`, the one place that knows the padding-free path),
feed-forward, the residual/normalization policy (the one place that knows the placements), the layer, the stack, the
pre-trained base with its initialization, then the task heads.

Self-contained on purpose (imports torch, transformers and `.configuration_encoderstack` only): `save_pretrained`
copies this file next to the weights so that `trust_remote_code=True` works without the package.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import ModelOutput
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import capture_outputs

from .configuration_encoderstack import GATED_ACTIVATIONS, EncoderStackConfig


def make_norm(config: EncoderStackConfig) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(config.hidden_size, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


def deepnorm_alpha(config: EncoderStackConfig) -> float:
    """DeepNet's residual scale for an N-layer encoder: alpha = (2N)^(1/4); 1 for every other placement."""
    return (2 * config.num_hidden_layers) ** 0.25 if config.norm_placement == "deepnorm" else 1.0


def deepnorm_beta(config: EncoderStackConfig) -> float:
    """DeepNet's init gain for the value/output projections and the FFN: beta = (8N)^(-1/4); 1 otherwise."""
    return (8 * config.num_hidden_layers) ** -0.25 if config.norm_placement == "deepnorm" else 1.0


def sinusoidal_positions(position_ids: torch.Tensor, dim: int) -> torch.Tensor:
    """The 2017 Transformer's fixed table, PE[p, 2i] = sin(p / 10000^(2i/d)) and PE[p, 2i+1] = cos(...)."""
    inv_freq = torch.exp(torch.arange(0, dim, 2, device=position_ids.device) * (-math.log(10000.0) / dim))
    angles = position_ids.unsqueeze(-1).float() * inv_freq
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[..., :dim]


class EncoderStackEmbeddings(nn.Module):
    """Word + token-type (+ learned or sinusoidal position) embeddings, optionally normalized, then dropout."""

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        self.position_embedding_type = config.position_embedding_type
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        if config.position_embedding_type == "absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.norm = make_norm(config) if config.embedding_norm else nn.Identity()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids, position_ids, inputs_embeds):
        embeddings = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if token_type_ids is None:  # all type 0: one broadcast row instead of a gather
            embeddings = embeddings + self.token_type_embeddings.weight[0]
        else:
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if self.position_embedding_type == "absolute":
            embeddings = embeddings + self.position_embeddings(position_ids)
        elif self.position_embedding_type == "sinusoidal":
            embeddings = embeddings + sinusoidal_positions(position_ids, embeddings.shape[-1]).to(embeddings.dtype)
        return self.dropout(self.norm(embeddings))


class EncoderStackRotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embedding (RoFormer), computed once per forward and shared by all layers."""

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.theta = config.rope_theta
        self.inv_freq = nn.Buffer(self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids.unsqueeze(-1).float() * self.inv_freq
        # (..., 1, head_dim): broadcasts over the heads of (batch, seq, heads, head_dim) and packed (tokens, heads, ...)
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(-2)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class Packing:
    """The real tokens of a padded batch, row after row: built once per forward from the attention mask.

    On the padding-free path everything position-wise (embeddings, projections, FFN, norms, token heads) runs on the
    packed tokens, and attention runs on each sequence alone, so it needs no mask and does no work on padding.
    """

    def __init__(self, real: torch.Tensor, lengths: list[int]):
        """`real`: the boolean (batch, seq) mask of real tokens; `lengths`: its row sums."""
        self.shape = tuple(real.shape)
        self.index = real.flatten().nonzero().squeeze(-1)
        self.lengths = [length for length in lengths if length]  # a row of only padding has no tokens

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(batch, seq, ...) -> (tokens, ...)"""
        return padded.flatten(0, 1).index_select(0, self.index)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(tokens, ...) -> (batch, seq, ...), with zeros at the padding"""
        padded = packed.new_zeros(self.shape[0] * self.shape[1], *packed.shape[1:])
        return padded.index_copy_(0, self.index, packed).unflatten(0, self.shape)

    def attend(self, attention, module, query, key, value, **kwargs) -> torch.Tensor:
        """`attention` on each sequence alone, without a mask: (tokens, heads, head_dim) in and out."""
        contexts = []
        for sequence in zip(*(x.split(self.lengths) for x in (query, key, value))):
            q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in sequence)  # (1, heads, length, head_dim)
            contexts.append(attention(module, q, k, v, None, **kwargs)[0].squeeze(0))
        return torch.cat(contexts)


class EncoderStackAttention(nn.Module):
    """Bidirectional multi-head self-attention, dispatched to the configured attention backend."""

    is_causal = False

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.output = nn.Linear(config.hidden_size, config.hidden_size)
        self.value.init_gain = self.output.init_gain = deepnorm_beta(config)
        self.attention_dropout = config.attention_probs_dropout_prob

    def forward(self, hidden_states, attention_mask, rotary=None, **kwargs):
        """`hidden_states` is (batch, seq, hidden) with the backend's `attention_mask`, or the packed (tokens, hidden)
        with the `Packing` in its place."""
        heads_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key, value = (proj(hidden_states).view(heads_shape) for proj in (self.query, self.key, self.value))
        if rotary is not None:
            query, key = apply_rotary(query, *rotary), apply_rotary(key, *rotary)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        kwargs.update(scaling=self.scaling, dropout=self.attention_dropout if self.training else 0.0)
        if isinstance(attention_mask, Packing):
            context, weights = attention_mask.attend(attention, self, query, key, value, **kwargs), None
        else:
            query, key, value = (x.transpose(1, 2) for x in (query, key, value))
            context, weights = attention(self, query, key, value, attention_mask, **kwargs)
        return self.output(context.reshape(*hidden_states.shape[:-1], -1)), weights


class EncoderStackMLP(nn.Module):
    """Position-wise feed-forward network; `geglu`/`swiglu` gate the activation with a second projection."""

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        self.gated = config.hidden_act in GATED_ACTIVATIONS
        self.act = ACT2FN[GATED_ACTIVATIONS.get(config.hidden_act, config.hidden_act)]
        self.up = nn.Linear(config.hidden_size, config.intermediate_size * (2 if self.gated else 1))
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)
        self.up.init_gain = self.down.init_gain = deepnorm_beta(config)

    def forward(self, hidden_states):
        if self.gated:
            gate, up = self.up(hidden_states).chunk(2, dim=-1)
            return self.down(self.act(gate) * up)
        return self.down(self.act(self.up(hidden_states)))


@dataclass(frozen=True)
class Placement:
    """Which norms a placement uses around each sublayer F (see the README for the equations)."""

    norm_in: bool  # F(LN(h))
    norm_branch: bool  # LN(F(.)) before the residual add
    norm_out: bool  # LN(h + F(.))
    final_norm: bool  # one more norm after the last layer
    dual_stream: bool = False  # ResiDual: also accumulate the un-normalized sum of every F


PLACEMENTS = {
    "post": Placement(norm_in=False, norm_branch=False, norm_out=True, final_norm=False),
    "pre": Placement(norm_in=True, norm_branch=False, norm_out=False, final_norm=True),
    "sandwich": Placement(norm_in=True, norm_branch=True, norm_out=False, final_norm=True),
    "deepnorm": Placement(norm_in=False, norm_branch=False, norm_out=True, final_norm=False),
    "resi_dual": Placement(norm_in=False, norm_branch=False, norm_out=True, final_norm=True, dual_stream=True),
}


class Residual(nn.Module):
    """The residual connection and norms around one sublayer: the only code that knows the placements.

    `stream` is the hidden state the sublayers read; `dual` is ResiDual's un-normalized stream (None otherwise).
    """

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        placement = PLACEMENTS[config.norm_placement]
        self.norm_in = make_norm(config) if placement.norm_in else nn.Identity()
        self.norm_branch = make_norm(config) if placement.norm_branch else nn.Identity()
        self.norm_out = make_norm(config) if placement.norm_out else nn.Identity()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.alpha = deepnorm_alpha(config)
        self.dual_scale = config.resi_dual_scale

    def forward(self, stream, dual, branch):
        branch = self.dropout(self.norm_branch(branch))
        if dual is not None:
            dual = dual + self.dual_scale * branch
        residual = stream if self.alpha == 1.0 else self.alpha * stream
        return self.norm_out(residual + branch), dual


class EncoderStackLayer(GradientCheckpointingLayer):
    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        self.attention = EncoderStackAttention(config)
        self.attention_residual = Residual(config)
        self.mlp = EncoderStackMLP(config)
        self.mlp_residual = Residual(config)

    def forward(self, hidden_states, dual, attention_mask, rotary=None, **kwargs):
        attended, _ = self.attention(self.attention_residual.norm_in(hidden_states), attention_mask, rotary, **kwargs)
        hidden_states, dual = self.attention_residual(hidden_states, dual, attended)
        transformed = self.mlp(self.mlp_residual.norm_in(hidden_states))
        return self.mlp_residual(hidden_states, dual, transformed)


class EncoderStackFinal(nn.Module):
    """What follows the last layer: nothing (post, deepnorm), LN(h) (pre, sandwich), or a + LN(d) (ResiDual)."""

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        self.norm = make_norm(config) if PLACEMENTS[config.norm_placement].final_norm else nn.Identity()

    def forward(self, stream, dual):
        return self.norm(stream) if dual is None else stream + self.norm(dual)


class EncoderStackPooler(nn.Module):
    """BERT's pooler: tanh(dense(first token))."""

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states):
        return torch.tanh(self.dense(hidden_states[:, 0]))


class EncoderStackLMHead(nn.Module):
    """BERT's masked-LM head: dense, activation, norm, then the decoder tied to the word embeddings."""

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[GATED_ACTIVATIONS.get(config.hidden_act, config.hidden_act)]
        self.norm = make_norm(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, hidden_states):
        return self.decoder(self.norm(self.act(self.dense(hidden_states))))


class EncoderStackPreTrainedModel(PreTrainedModel):
    config: EncoderStackConfig
    config_class = EncoderStackConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["EncoderStackEmbeddings", "EncoderStackLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": EncoderStackLayer, "attentions": EncoderStackAttention}

    # Installed by the `encoderstack` package so that `from_pretrained` also converts BERT checkpoints on the fly;
    # a remote-code copy of this file has none and loads EncoderStack checkpoints only.
    checkpoint_converter = None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        converter = EncoderStackPreTrainedModel.checkpoint_converter
        model = converter(cls, pretrained_model_name_or_path, *args, **kwargs) if converter else None
        return model if model is not None else super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        self.config.auto_map = dict(AUTO_MAP)
        return super().save_pretrained(save_directory, *args, **kwargs)

    # Installed by the `encoderstack` package so that `push_to_hub` checks what it sends and writes the package's
    # model card (transformers' own writes a generic template); a remote-code copy pushes the way transformers does.
    hub_publisher = None

    def push_to_hub(self, repo_id: str, **kwargs):
        """Save the model with its card and code files and push it to the Hub repository `repo_id` in one commit."""
        publisher = EncoderStackPreTrainedModel.hub_publisher
        return publisher(self, repo_id, **kwargs) if publisher else super().push_to_hub(repo_id, **kwargs)

    def _init_weights(self, module):
        """BERT's init (normal(0, initializer_range), zero biases, unit norms), plus DeepNet's beta gain."""
        super()._init_weights(module)
        if getattr(module, "init_gain", 1.0) != 1.0:
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range * module.init_gain)
        elif isinstance(module, EncoderStackRotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq())


class EncoderStackModel(EncoderStackPreTrainedModel):
    """The bare encoder: embeddings, N layers, the placement's final step, and (optionally) BERT's pooler."""

    def __init__(self, config: EncoderStackConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = EncoderStackEmbeddings(config)
        self.rotary = EncoderStackRotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        self.layers = nn.ModuleList(EncoderStackLayer(config) for _ in range(config.num_hidden_layers))
        self.final = EncoderStackFinal(config)
        self.pooler = EncoderStackPooler(config) if add_pooling_layer else None
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    @capture_outputs
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        padding_free: bool | None = None,
        packing: Packing | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPooling:
        """`padding_free` overrides `config.padding_free` for this call (see `packing_for`); `packing` is passed by
        the heads that run their own token-level work on the same packed tokens."""
        self._check_inputs(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        batch_size, seq_length = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        device = input_ids.device if input_ids is not None else inputs_embeds.device
        if position_ids is None:
            position_ids = torch.arange(seq_length, device=device)
        position_ids = position_ids.expand(batch_size, seq_length)
        packing = packing if packing is not None else self.packing_for(attention_mask, padding_free, **kwargs)
        if packing is not None:  # gather the real tokens once, before the embeddings
            input_ids, token_type_ids, position_ids, inputs_embeds = (
                None if x is None else packing.pack(x) for x in (input_ids, token_type_ids, position_ids, inputs_embeds)
            )

        hidden_states = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)
        if packing is not None:
            mask = packing
        else:
            mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden_states,
                                             attention_mask=attention_mask)
        rotary = self.rotary(position_ids, hidden_states.dtype) if self.rotary is not None else None
        dual = hidden_states * self.config.resi_dual_scale if PLACEMENTS[self.config.norm_placement].dual_stream else None
        for layer in self.layers:
            hidden_states, dual = layer(hidden_states, dual, mask, rotary, **kwargs)
        hidden_states = self.final(hidden_states, dual)
        if packing is not None:  # scatter once, at the end
            hidden_states = packing.unpack(hidden_states)
        pooled = self.pooler(hidden_states) if self.pooler is not None else None
        return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=pooled)

    def packing_for(self, attention_mask, padding_free=None, **kwargs) -> Packing | None:
        """The packing of the real tokens when this forward runs padding-free, else None (the padded path).

        Padding-free is on by `config.padding_free` or the `padding_free` argument, and runs only when the mask has
        both padding and real tokens: a batch without padding has nothing to gain. Requested hidden states and
        attention maps are recorded by hooks on the layers, so they take the padded path and come out as in BERT.
        """
        if padding_free is None:
            padding_free = self.config.padding_free
        if not isinstance(padding_free, bool):
            raise ValueError(f"`padding_free` must be True, False or None, got {padding_free!r}.")
        recorded = any(kwargs.get(f"output_{name}", getattr(self.config, f"output_{name}", False))
                       for name in ("hidden_states", "attentions"))
        if not padding_free or recorded or attention_mask is None or attention_mask.dim() != 2:
            return None
        if torch.compiler.is_compiling():  # packed shapes change with every batch (a recompile each): stay padded
            return None
        real = attention_mask.bool()
        lengths = real.sum(-1).tolist()  # the one host sync of the decision
        return Packing(real, lengths) if any(lengths) and min(lengths) < real.shape[-1] else None

    def _check_inputs(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds):
        """Turn the mistakes that would otherwise surface as an index error deep in a kernel into a clear message."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
        shape = tuple(input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1])
        if len(shape) != 2:
            raise ValueError(f"Expected inputs of shape (batch, sequence), got {shape}.")
        for name, value in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                            ("position_ids", position_ids)):
            if value is not None and value.dim() == 2 and tuple(value.shape) != shape:
                raise ValueError(f"`{name}` has shape {tuple(value.shape)}, but the inputs have shape {shape}.")
        limit = self.config.max_position_embeddings
        if self.config.position_embedding_type == "absolute" and position_ids is None and shape[1] > limit:
            raise ValueError(
                f"Sequence length {shape[1]} exceeds `max_position_embeddings` ({limit}) of learned positions."
            )
        if torch.compiler.is_compiling():
            return
        ranges = [("input_ids", input_ids, self.config.vocab_size), ("token_type_ids", token_type_ids,
                  self.config.type_vocab_size)]
        if self.config.position_embedding_type == "absolute":
            ranges.append(("position_ids", position_ids, limit))
        for name, ids, size in ranges:
            if ids is not None and ids.numel() and (ids.min() < 0 or ids.max() >= size):
                raise ValueError(
                    f"`{name}` must lie in [0, {size - 1}], got values from {ids.min().item()} to {ids.max().item()}."
                )


@dataclass
class EncoderStackForPreTrainingOutput(ModelOutput):
    """Masked-LM and next-sentence logits; `loss` is their sum when both label sets are given."""

    loss: torch.Tensor | None = None
    prediction_logits: torch.Tensor | None = None
    seq_relationship_logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


def mean_loss(per_item: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Mean over this batch, or, under Trainer's gradient accumulation, the sum over the whole accumulated batch's
    item count, so that k accumulated steps give the same update as one step on the combined batch."""
    if num_items_in_batch is None:
        return per_item.mean()
    return per_item.sum() / num_items_in_batch


def cross_entropy(logits, labels, num_items_in_batch=None, ignore_index=-100):
    labels = labels.to(logits.device).reshape(-1)
    loss = nn.functional.cross_entropy(logits.float().reshape(labels.numel(), -1), labels, reduction="none",
                                       ignore_index=ignore_index)
    if num_items_in_batch is None:
        return loss.sum() / (labels != ignore_index).sum()
    return loss.sum() / num_items_in_batch


def per_token(head, hidden_states, packing: Packing | None, labels=None, num_items_in_batch=None):
    """A token-level head's logits and, given `labels`, their cross-entropy. Padding-free, both run on the real tokens
    only: the logits come back with zeros at the padding, and labels at padded positions count for nothing."""
    if packing is not None:
        hidden_states = packing.pack(hidden_states)
        labels = packing.pack(labels) if labels is not None else None
    logits = head(hidden_states)
    loss = cross_entropy(logits, labels, num_items_in_batch) if labels is not None else None
    return (logits if packing is None else packing.unpack(logits)), loss


class EncoderStackHead(EncoderStackPreTrainedModel):
    """Shared plumbing of the task heads: the encoder (pooled or not) and the forward arguments they all take."""

    uses_pooler = False

    def __init__(self, config: EncoderStackConfig):
        super().__init__(config)
        self.model = EncoderStackModel(config, add_pooling_layer=self.uses_pooler)

    def encode(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, padding_free=None,
               **kwargs):
        """The encoder's outputs, and the packing it ran on (None on the padded path) for the token-level heads."""
        kwargs.pop("num_items_in_batch", None)
        packing = self.model.packing_for(attention_mask, padding_free, **kwargs)
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            padding_free=packing is not None,  # decided once, here: the encoder does not look at the mask again
            packing=packing,
            return_dict=True,
            **kwargs,
        )
        return outputs, packing


class EncoderStackClassifierHead(EncoderStackHead):
    """Dropout + one linear layer on the pooled output (sequence-level heads) or on every token."""

    num_outputs = None  # defaults to config.num_labels

    def __init__(self, config: EncoderStackConfig):
        super().__init__(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, self.num_outputs or config.num_labels)
        self.post_init()

    def classify(self, *inputs, **kwargs):
        """The logits of the pooled first token (the sequence-level heads; token-level ones use `per_token`)."""
        outputs, _ = self.encode(*inputs, **kwargs)
        return self.logits(outputs.pooler_output), outputs

    def logits(self, features):
        return self.classifier(self.dropout(features))


class EncoderStackForMaskedLM(EncoderStackHead):
    _tied_weights_keys = {"lm_head.decoder.weight": "model.embeddings.word_embeddings.weight"}

    def __init__(self, config: EncoderStackConfig):
        super().__init__(config)
        self.lm_head = EncoderStackLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs) -> MaskedLMOutput:
        num_items = kwargs.get("num_items_in_batch")
        outputs, packing = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        logits, loss = per_token(self.lm_head, outputs.last_hidden_state, packing, labels, num_items)
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                              attentions=outputs.attentions)


class EncoderStackForPreTraining(EncoderStackHead):
    """Masked LM + next-sentence prediction, as BERT was pre-trained.

    The two losses count different items (masked tokens, sentence pairs), so Trainer's single `num_items_in_batch`
    cannot normalize both: this head returns per-batch means and lets Trainer divide by the accumulation steps.
    """

    uses_pooler = True
    accepts_loss_kwargs = False
    _tied_weights_keys = {"lm_head.decoder.weight": "model.embeddings.word_embeddings.weight"}

    def __init__(self, config: EncoderStackConfig):
        super().__init__(config)
        self.lm_head = EncoderStackLMHead(config)
        self.next_sentence = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, next_sentence_label=None, **kwargs) -> EncoderStackForPreTrainingOutput:
        outputs, packing = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        mlm_labels = labels if next_sentence_label is not None else None
        prediction_logits, loss = per_token(self.lm_head, outputs.last_hidden_state, packing, mlm_labels)
        seq_relationship_logits = self.next_sentence(outputs.pooler_output)
        if loss is not None:
            loss = loss + cross_entropy(seq_relationship_logits, next_sentence_label)
        return EncoderStackForPreTrainingOutput(
            loss=loss,
            prediction_logits=prediction_logits,
            seq_relationship_logits=seq_relationship_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class EncoderStackForSequenceClassification(EncoderStackClassifierHead):
    """Classification or regression on the pooled first token; the loss follows `config.problem_type` as in BERT."""

    uses_pooler = True

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs) -> SequenceClassifierOutput:
        num_items = kwargs.get("num_items_in_batch")
        logits, outputs = self.classify(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        loss = self.sequence_loss(logits, labels, num_items) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                        attentions=outputs.attentions)

    def sequence_loss(self, logits, labels, num_items):
        if self.config.problem_type is None:
            if self.config.num_labels == 1:
                self.config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                self.config.problem_type = "single_label_classification"
            else:
                self.config.problem_type = "multi_label_classification"
        labels = labels.to(logits.device)
        if self.config.problem_type == "single_label_classification":
            return cross_entropy(logits, labels, num_items)
        if self.config.problem_type == "regression":
            errors = (logits.float().reshape(labels.shape) - labels.float()) ** 2
            return mean_loss(errors, num_items)
        errors = nn.functional.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
        return mean_loss(errors, num_items)


class EncoderStackForTokenClassification(EncoderStackClassifierHead):
    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs) -> TokenClassifierOutput:
        num_items = kwargs.get("num_items_in_batch")
        outputs, packing = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        logits, loss = per_token(self.logits, outputs.last_hidden_state, packing, labels, num_items)
        return TokenClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                     attentions=outputs.attentions)


class EncoderStackForQuestionAnswering(EncoderStackClassifierHead):
    """Span start/end logits per token. Positions outside the sequence are ignored, as in BERT."""

    num_outputs = 2

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, start_positions=None, end_positions=None, **kwargs) -> QuestionAnsweringModelOutput:
        outputs, packing = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        logits, _ = per_token(self.logits, outputs.last_hidden_state, packing)
        start_logits, end_logits = (part.squeeze(-1).contiguous() for part in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            ignored = start_logits.shape[1]
            start = start_positions.reshape(-1).clamp(0, ignored)
            end = end_positions.reshape(-1).clamp(0, ignored)
            loss = (cross_entropy(start_logits, start, ignore_index=ignored)
                    + cross_entropy(end_logits, end, ignore_index=ignored)) / 2
        return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                                            hidden_states=outputs.hidden_states, attentions=outputs.attentions)


class EncoderStackForMultipleChoice(EncoderStackClassifierHead):
    """One score per choice from the pooled first token; inputs are (batch, num_choices, sequence)."""

    uses_pooler = True
    num_outputs = 1

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs) -> MultipleChoiceModelOutput:
        num_items = kwargs.get("num_items_in_batch")
        num_choices = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        flat = [None if x is None else x.flatten(0, 1) for x in
                (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)]
        logits, outputs = self.classify(*flat, **kwargs)
        logits = logits.view(-1, num_choices)
        loss = cross_entropy(logits, labels, num_items) if labels is not None else None
        return MultipleChoiceModelOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                         attentions=outputs.attentions)


# Written into every saved config.json, so that each Auto class loads the checkpoint with `trust_remote_code=True`
# where this package is not installed (transformers itself records only the class that was saved).
AUTO_MAP = {
    "AutoConfig": "configuration_encoderstack.EncoderStackConfig",
    "AutoModel": "modeling_encoderstack.EncoderStackModel",
    "AutoModelForMaskedLM": "modeling_encoderstack.EncoderStackForMaskedLM",
    "AutoModelForPreTraining": "modeling_encoderstack.EncoderStackForPreTraining",
    "AutoModelForSequenceClassification": "modeling_encoderstack.EncoderStackForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_encoderstack.EncoderStackForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_encoderstack.EncoderStackForQuestionAnswering",
    "AutoModelForMultipleChoice": "modeling_encoderstack.EncoderStackForMultipleChoice",
}

__all__ = [
    "AUTO_MAP",
    "EncoderStackPreTrainedModel",
    "EncoderStackModel",
    "EncoderStackForMaskedLM",
    "EncoderStackForPreTraining",
    "EncoderStackForSequenceClassification",
    "EncoderStackForTokenClassification",
    "EncoderStackForQuestionAnswering",
    "EncoderStackForMultipleChoice",
]
