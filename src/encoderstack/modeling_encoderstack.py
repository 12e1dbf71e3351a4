"""EncoderStack: BERT's bidirectional encoder stack with the normalization placement as a config choice.

Read top to bottom: embeddings, attention, feed-forward, the residual/normalization policy (the one place that knows
the placements), the layer, the stack, the pre-trained base with its initialization, then the task heads. How a forward
runs (`PackedSequences`, the input checks, `ExecutionPlan` with its masks, and the attention functions the plan names)
lives in `execution_encoderstack.py`.

Self-contained on purpose (imports torch, transformers, `.configuration_encoderstack` and `.execution_encoderstack`
only): `save_pretrained` copies this file and the two it imports next to the weights, so that
`trust_remote_code=True` works without the package.
"""

import copy
import math
from dataclasses import dataclass
from typing import get_args

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.processing_utils import Unpack
from transformers.utils import ModelOutput, TransformersKwargs, logging
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import capture_outputs

from .configuration_encoderstack import (  # noqa: F401 (Placement, PLACEMENTS, Heads: their old home, kept)
    CPU_KERNELS,
    GATED_ACTIVATIONS,
    HEADS,
    PLACEMENTS,
    AttentionProjection,
    EncoderStackConfig,
    Heads,
    Placement,
)
from .execution_encoderstack import (
    FUSED_ACTIVATIONS,
    VARLEN_KWARGS,
    ExecutionPlan,
    PackedSequences,
    attention_masks,
    counted_range,
    eager_attention_forward,
    execution_plan,
    holds_integers,
    linear,
    prepacked_weights,
    with_score_term,
)

logger = logging.get_logger(__name__)


class DynamicTanh(nn.Module):
    """DyT (Zhu et al. 2025), a normalization-free stand-in for a norm: weight * tanh(alpha * x) + bias, with alpha
    one learnable scalar."""

    def __init__(self, size: int, alpha_init: float):
        super().__init__()
        self.alpha_init = alpha_init
        self.alpha = nn.Parameter(torch.full((1,), float(alpha_init)))
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))

    def forward(self, x):
        return torch.tanh(self.alpha * x) * self.weight + self.bias


class DynamicErf(DynamicTanh):
    """Derf (arXiv 2512.10938): weight * erf(alpha * x + shift) + bias, alpha and shift learnable scalars."""

    def __init__(self, size: int, alpha_init: float):
        super().__init__(size, alpha_init)
        self.shift = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return torch.erf(self.alpha * x + self.shift) * self.weight + self.bias


def make_norm(config: EncoderStackConfig, size: int | None = None) -> nn.Module:
    """The configured norm over the last `size` features (default: the hidden size)."""
    size = size or config.hidden_size
    if config.norm_type == "dyt":
        return DynamicTanh(size, config.dyt_alpha_init)
    if config.norm_type == "derf":
        return DynamicErf(size, config.dyt_alpha_init)
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(size, eps=config.layer_norm_eps)
    return nn.LayerNorm(size, eps=config.layer_norm_eps, bias=config.norm_bias)


def sinusoidal_positions(position_ids: torch.Tensor, dim: int) -> torch.Tensor:
    """The 2017 Transformer's fixed table, PE[p, 2i] = sin(p / 10000^(2i/d)) and PE[p, 2i+1] = cos(...)."""
    inv_freq = torch.exp(torch.arange(0, dim, 2, device=position_ids.device) * (-math.log(10000.0) / dim))
    angles = position_ids.unsqueeze(-1).float() * inv_freq
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[..., :dim]


class EncoderStackEmbeddings(nn.Module):
    """Word (+ token-type) (+ learned or sinusoidal position) embeddings, optionally normalized, then dropout, at
    `embedding_size`; projected to the hidden size where the two differ (ELECTRA)."""

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        size = config.embedding_size or config.hidden_size
        self.position_embedding_type = config.position_embedding_type
        self.word_embeddings = nn.Embedding(config.vocab_size, size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, size) if config.type_vocab_size else None
        if config.position_embedding_type == "absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, size)
        self.norm = make_norm(config, size) if config.embedding_norm else nn.Identity()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.project = Linear(size, config.hidden_size) if size != config.hidden_size else nn.Identity()

    def forward(self, input_ids, token_type_ids, position_ids, inputs_embeds):
        embeddings = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if self.token_type_embeddings is not None:  # all type 0 without ids: one broadcast row instead of a gather
            types = self.token_type_embeddings
            embeddings = embeddings + (types.weight[0] if token_type_ids is None else types(token_type_ids))
        if self.position_embedding_type == "absolute":
            embeddings = embeddings + self.position_embeddings(position_ids)
        elif self.position_embedding_type == "sinusoidal":
            embeddings = embeddings + sinusoidal_positions(position_ids, embeddings.shape[-1]).to(embeddings.dtype)
        return self.project(self.dropout(self.norm(embeddings)))


def default_position_ids(config, input_ids, attention_mask, packing, seq_length, device) -> torch.Tensor:
    """Positions where the caller gives none. BERT's count along the row (0, 1, ...) whatever the padding; with
    `config.position_offset` (RoBERTa's pad_token_id + 1), each sequence's real tokens count from the offset, so that
    left and right padding, padding-free and flattened rows give every token the same position."""
    offset = config.position_offset
    if packing is not None and packing.flattened:
        return packing.position_ids() + (offset or 0)
    if offset is None:
        return torch.arange(seq_length, device=device)
    if attention_mask is not None and attention_mask.dim() == 2:
        real = attention_mask.to(device).bool()
    elif input_ids is not None and config.pad_token_id is not None:
        real = input_ids != config.pad_token_id  # RoBERTa's rule where no mask says which tokens are real
    else:
        return torch.arange(seq_length, device=device) + offset
    return (real.long().cumsum(-1) - 1).clamp(min=0) + offset  # padding reuses a real row: its output is ignored


def layer_type_of(config: EncoderStackConfig, layer_idx: int) -> str:
    return config.layer_types[layer_idx] if config.layer_types is not None else "full_attention"


class EncoderStackRotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embedding (RoFormer), one pair per layer type (each type its own base or
    scaling: `config.rope_parameters`), computed once per forward and shared by the layers of that type. Frequencies
    other than the default rotary's, and their dynamic updates, are transformers' own functions, as the families'
    classes call them (their attribute names follow ModernBERT's rotary embedding, which those functions read). With
    a `partial_rotary_factor`, the tables span that leading share of each head."""

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        parameters = config.rope_parameters_by_type()
        # transformers' functions read `config.rope_parameters[layer_type]`: they get the per-type form of a flat one
        self.config = copy.copy(config)
        self.config.rope_parameters = parameters
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.layer_types = sorted({layer_type_of(config, index) for index in range(config.num_hidden_layers)})
        self.rope_type = {layer_type: parameters[layer_type]["rope_type"] for layer_type in self.layer_types}
        self.theta = {layer_type: parameters[layer_type]["rope_theta"] for layer_type in self.layer_types}
        for layer_type in self.layer_types:
            inv_freq, scaling = self.compute_inv_freq(layer_type)
            setattr(self, f"{layer_type}_inv_freq", nn.Buffer(inv_freq, persistent=False))
            setattr(self, f"{layer_type}_original_inv_freq", nn.Buffer(inv_freq.clone(), persistent=False))
            setattr(self, f"{layer_type}_attention_scaling", scaling)

    def compute_inv_freq(self, layer_type: str) -> tuple[torch.Tensor, float]:
        if self.rope_type[layer_type] != "default":
            return ROPE_INIT_FUNCTIONS[self.rope_type[layer_type]](self.config, None, layer_type=layer_type)
        dim = int(self.head_dim * self.config.rope_parameters[layer_type].get("partial_rotary_factor", 1.0))
        exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
        return 1.0 / (self.theta[layer_type] ** exponents), 1.0

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{layer type: (cos, sin)}"""
        tables = {layer_type: self.tables(position_ids, position_ids, layer_type) for layer_type in self.layer_types}
        return {layer_type: (cos.to(dtype), sin.to(dtype)) for layer_type, (cos, sin) in tables.items()}

    @dynamic_rope_update  # `x` only gives the device, as in transformers' rotary embeddings
    def tables(self, x, position_ids, layer_type):
        angles = position_ids.unsqueeze(-1).float() * getattr(self, f"{layer_type}_inv_freq")
        # (..., 1, head_dim): broadcasts over the heads of (batch, seq, heads, head_dim) and packed (tokens, heads, ...)
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(-2)
        scaling = getattr(self, f"{layer_type}_attention_scaling")
        return angles.cos() * scaling, angles.sin() * scaling


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if cos.shape[-1] < x.shape[-1]:  # partial rotation: the rest of each head passes through
        rotated, rest = x.split((cos.shape[-1], x.shape[-1] - cos.shape[-1]), dim=-1)
        return torch.cat((apply_rotary(rotated, cos, sin), rest), dim=-1)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def relative_position_bucket(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bidirectional buckets of the key-minus-query `distance`, as MPNet computes them: half the buckets for keys
    before the query, half for keys after it; of each half, the nearer half counts distances exactly and the rest
    grow logarithmically up to `max_distance`, beyond which every key shares the last bucket."""
    half = num_buckets // 2
    exact = half // 2
    far = distance.abs()
    # the same float32 operations as MPNet's, so that a distance on a bucket's edge falls on the same side
    logarithmic = exact + (
        torch.log(far.clamp(min=exact).float() / exact) / math.log(max_distance / exact) * (half - exact)
    ).to(torch.long)
    return (distance > 0).long() * half + torch.where(far < exact, far, logarithmic.clamp(max=half - 1))


class RelativePositionBias(nn.Module):
    """`relative_attention="bias"` (MPNet's): one learned score bias per head and distance bucket, the same in every
    layer. Only the distance between two tokens of a sequence matters, so one (1, heads, length, length) table serves
    every sequence of up to `length` tokens, wherever the sequence starts in its row."""

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        self.bias = nn.Embedding(self.num_buckets, config.num_attention_heads)

    def forward(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        positions = torch.arange(length, device=self.bias.weight.device)
        buckets = relative_position_bucket(positions[None, :] - positions[:, None], self.num_buckets, self.max_distance)
        return self.bias(buckets).permute(2, 0, 1).unsqueeze(0).to(dtype)


def log_bucket_position(distance: torch.Tensor, buckets: int, max_position: int) -> torch.Tensor:
    """DeBERTa's log buckets of the query-minus-key `distance`: exact up to half the buckets, then logarithmic up to
    `max_position`, with the distance's sign (the same float32 operations as `make_log_bucket_position`, so that a
    distance on a bucket's edge falls on the same side)."""
    mid = buckets // 2
    far = torch.where((distance < mid) & (distance > -mid), mid - 1, distance.abs())
    steps = torch.log(far / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1)
    logarithmic = torch.ceil(steps) + mid
    return torch.where(far <= mid, distance.float(), logarithmic * distance.sign()).long()


@dataclass
class RelativePositions:
    """DeBERTa's relative positions for one forward: the (normalized) embeddings of the buckets a query-key pair of
    this forward can fall in, and, for each pair of a `length`-token stretch, the row of `embeddings` it reads."""

    embeddings: torch.Tensor  # (rows, hidden)
    index: torch.Tensor  # (length, length), query i and key j -> the row of i - j


class DisentangledPositions(nn.Module):
    """`relative_attention="disentangled"` (DeBERTa's): `2 * span` relative-position embeddings shared by the layers
    (normalized once per forward where `norm_rel_ebd="layer_norm"`), each for a bucket of the query-minus-key
    distance; every layer projects them with its own projections (see `EncoderStackAttention.position_terms`). Only
    distances matter, so one index table serves every sequence of up to `length` tokens, wherever it starts in its
    row."""

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        self.buckets = config.position_buckets
        self.max_position = config.max_relative_positions or config.max_position_embeddings
        self.span = self.buckets or self.max_position
        self.embeddings = nn.Embedding(2 * self.span, config.hidden_size)
        self.norm = make_norm(config) if config.norm_rel_ebd == "layer_norm" else nn.Identity()

    def row_of(self, distance: torch.Tensor) -> torch.Tensor:
        """The embedding row of each query-minus-key distance."""
        if self.buckets is not None:
            distance = log_bucket_position(distance, self.buckets, self.max_position)
        return (distance + self.span).clamp(0, 2 * self.span - 1)

    def forward(self, length: int, dtype: torch.dtype) -> RelativePositions:
        positions = torch.arange(length, device=self.embeddings.weight.device)
        index = self.row_of(positions[:, None] - positions[None, :])
        embeddings = self.embeddings.weight
        if not torch.compiler.is_compiling():  # only the rows this length reaches (the row grows with the distance)
            first, last = self.row_of(torch.tensor([1 - length, length - 1])).tolist()  # on the host: no sync
            embeddings, index = embeddings[first : last + 1], index - first
        return RelativePositions(self.norm(embeddings).to(dtype), index)


class EncoderStackKwargs(TransformersKwargs, total=False):
    """transformers' forward kwargs, and ours: `padding_free` overrides `config.padding_free` for one call; `plan` is
    how a task head hands the encoder the `ExecutionPlan` it made (see `EncoderStackModel.execution_plan`)."""

    padding_free: bool | None
    plan: "ExecutionPlan | None"


class Linear(nn.Linear):
    """`nn.Linear` whose forward is `execution_encoderstack.linear` (oneDNN on the CPU for bf16, and for float32
    where `config.cpu_kernels` says so), optionally followed by an activation it may fuse."""

    cpu_kernels = "torch"  # `config.cpu_kernels`, set by the model (`set_cpu_kernels`)

    def forward(self, x, activation: str | None = None):
        return linear(x, self.weight, self.bias, activation, self.cpu_kernels)

    def _apply(self, fn, recurse=True):
        prepacked_weights.pop(self.weight, None)  # `.to(...)` and the like give the weight new storage: drop the copy
        return super()._apply(fn, recurse)


class LayerProjection(Linear):
    """A projection inside a layer, whose init the placement may set (DeepScaleLM's normal(0, 1/fan_in))."""

    init_std: float | None = None  # set by the layer from its rows; None: BERT's init


class BranchProjection(LayerProjection):
    """A projection whose init the placement scales (DeepNet's beta): value, attention output and feed-forward."""


class EncoderStackAttention(nn.Module):
    """Bidirectional multi-head self-attention, dispatched through transformers' `AttentionInterface` to the function
    the forward's `ExecutionPlan` names (the configured backend where no plan is given)."""

    is_causal = False

    def __init__(self, config: EncoderStackConfig, qkv_norm: bool = False, layer_type: str = "full_attention"):
        super().__init__()
        self.config = config
        self.layer_type = layer_type
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        # grouped-query attention: each key/value head serves `groups` query heads
        kv_size = (config.num_key_value_heads or config.num_attention_heads) * self.head_dim
        self.groups = config.hidden_size // kv_size
        given = config.attention_bias  # all, none, or the names of those with a bias
        bias = {name: given if isinstance(given, bool) else name in given for name in get_args(AttentionProjection)}
        self.query = LayerProjection(config.hidden_size, config.hidden_size, bias=bias["query"])
        self.key = LayerProjection(config.hidden_size, kv_size, bias=bias["key"])
        self.value = BranchProjection(config.hidden_size, kv_size, bias=bias["value"])
        self.output = BranchProjection(config.hidden_size, config.hidden_size, bias=bias["output"])
        self.attention_dropout = config.attention_probs_dropout_prob
        # HybridNorm's QKV-norm: one norm over each head's features, shared by the heads, as its reference code
        norms = [make_norm(config, self.head_dim) if qkv_norm else nn.Identity() for _ in range(3)]
        self.query_norm, self.key_norm, self.value_norm = norms
        # DeBERTa's disentangled attention: the terms this layer adds to its scores, which scale with them
        self.pos_att_type = tuple(config.pos_att_type or ()) if config.relative_attention == "disentangled" else ()
        if self.pos_att_type:
            self.scaling = (self.head_dim * (1 + len(self.pos_att_type))) ** -0.5
            self.position_dropout = nn.Dropout(config.hidden_dropout_prob)
            self.share_att_key = config.share_att_key
            if not config.share_att_key:  # projections of the positions of their own, as DeBERTa v1's and v2's
                size, terms = config.hidden_size, self.pos_att_type
                self.position_key = LayerProjection(size, size, bias["position_key"]) if "c2p" in terms else None
                self.position_query = LayerProjection(size, size, bias["position_query"]) if "p2c" in terms else None

    def position_projections(self) -> dict:
        """Each term's projection of the relative positions: c2p reads them as keys, p2c as queries; the layer's own
        key and query projections where `share_att_key` (DeBERTa-v3)."""
        as_key, as_query = (self.key, self.query) if self.share_att_key else (self.position_key, self.position_query)
        return {term: {"c2p": as_key, "p2c": as_query}[term] for term in self.pos_att_type}

    def with_position_terms(self, query, key, positions, attention_mask, sequence_lengths=None):
        """The mask with this layer's disentangled terms added as scores: one (batch, heads, L, L) term for the rows,
        or, on the per-sequence path (`sequence_lengths`), one per sequence from its own queries and keys."""
        relative = self.position_dropout(positions.embeddings)
        projected = {
            term: projection(relative).view(relative.shape[0], -1, self.head_dim).transpose(0, 1)
            for term, projection in self.position_projections().items()
        }  # (heads, rows, head_dim)
        if sequence_lengths is None:
            return with_score_term(attention_mask, self.position_terms(query, key, projected, positions.index))
        pieces = zip(query.split(sequence_lengths, dim=2), key.split(sequence_lengths, dim=2))
        return [self.position_terms(q, k, projected, positions.index) for q, k in pieces]

    def position_terms(self, query, key, projected, index) -> torch.Tensor:
        """c2p[i, j] = q_i . r_k[row(i - j)], each query against the key's distance to it, and p2c[i, j] =
        k_j . r_q[row(i - j)], each key against the query's distance, scaled as the content scores are."""
        length = query.shape[2]
        index = index[:length, :length].expand(*query.shape[:2], length, length)
        terms = 0
        if "c2p" in projected:
            terms = terms + torch.matmul(query, projected["c2p"].transpose(-1, -2)).gather(-1, index)
        if "p2c" in projected:  # gathered per key (the index transposed), then transposed back to (query, key)
            by_key = torch.matmul(key, projected["p2c"].transpose(-1, -2)).gather(-1, index.transpose(-1, -2))
            terms = terms + by_key.transpose(-1, -2)
        return terms * self.scaling

    def forward(self, hidden_states, attention_mask, rotary=None, plan=None, positions=None, **kwargs):
        heads_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key, value = (
            norm(proj(hidden_states).view(heads_shape))
            for proj, norm in ((self.query, self.query_norm), (self.key, self.key_norm), (self.value, self.value_norm))
        )
        if rotary is not None:
            query, key = apply_rotary(query, *rotary), apply_rotary(key, *rotary)
        if self.groups > 1:
            key, value = (x.repeat_interleave(self.groups, dim=-2) for x in (key, value))
        query, key, value = (x.transpose(1, 2) for x in (query, key, value))
        if positions is not None:  # DeBERTa's: c2p and p2c from this layer's queries and keys, added to the scores
            attention_mask = self.with_position_terms(
                query, key, positions, attention_mask, kwargs.get("sequence_lengths")
            )
        name, window = (self.config._attn_implementation, {}) if plan is None else plan.layer_attention(self.layer_type)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_forward)
        context, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            scaling=self.scaling,
            dropout=self.attention_dropout if self.training else 0.0,
            **window,
            **kwargs,
        )
        return self.output(context.reshape(*hidden_states.shape[:-1], -1)), weights


class EncoderStackMLP(nn.Module):
    """Position-wise feed-forward network; `geglu`/`swiglu` gate the activation with a second projection."""

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        self.gated = config.hidden_act in GATED_ACTIVATIONS
        self.act = ACT2FN[GATED_ACTIVATIONS.get(config.hidden_act, config.hidden_act)]
        up_bias, down_bias = config.mlp_bias is True, config.mlp_bias in (True, "down")
        self.up = BranchProjection(config.hidden_size, config.intermediate_size * (2 if self.gated else 1), up_bias)
        self.down = BranchProjection(config.intermediate_size, config.hidden_size, down_bias)
        self.fused_act = config.hidden_act if config.hidden_act in FUSED_ACTIVATIONS else None  # in the up GEMM

    def forward(self, hidden_states):
        if self.gated:
            gate, up = self.up(hidden_states).chunk(2, dim=-1)
            return self.down(self.act(gate) * up)
        if self.fused_act:
            return self.down(self.up(hidden_states, self.fused_act))
        return self.down(self.act(self.up(hidden_states)))


class Residual(nn.Module):
    """One sublayer wrapped in its residual connection and norms, as the placement's row for this layer and sublayer
    says: the only code that applies a placement."""

    def __init__(self, config: EncoderStackConfig, placement: Placement, layer_idx: int):
        super().__init__()
        self.norm_in = make_norm(config) if placement.norm_in else nn.Identity()
        self.norm_branch = make_norm(config) if placement.norm_branch else nn.Identity()
        self.norm_out = make_norm(config) if placement.norm_out else nn.Identity()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.alpha = placement.alpha(config.num_hidden_layers)
        self.branch_scale = placement.branch_scale(config.num_hidden_layers)
        self.input_scale = placement.input_scale(layer_idx + 1)
        self.omega = nn.Parameter(torch.ones(config.hidden_size)) if placement.omega else None
        self.dual_scale = config.resi_dual_scale if placement.dual_stream else None

    def forward(self, stream, dual, sublayer):
        """`stream`: the hidden state the sublayers read; `dual`: ResiDual's un-normalized stream, which starts at the
        first sublayer's input and adds up every F (None for the other placements)."""
        inputs = self.norm_in(stream)
        if self.input_scale != 1.0:
            inputs = self.input_scale * inputs
        branch = self.dropout(self.norm_branch(sublayer(inputs)))
        if self.branch_scale != 1.0:
            branch = self.branch_scale * branch
        if self.dual_scale is not None:
            dual = (self.dual_scale * stream if dual is None else dual) + self.dual_scale * branch
        residual = stream if self.alpha == 1.0 else self.alpha * stream
        if self.omega is not None:
            residual = residual * self.omega
        return self.norm_out(residual + branch), dual


class EncoderStackLayer(GradientCheckpointingLayer):
    """Self-attention, then the feed-forward network, each inside its `Residual`."""

    def __init__(self, config: EncoderStackConfig, layer_idx: int):
        super().__init__()
        placement = PLACEMENTS[config.norm_placement]
        attention, mlp = (placement.at(config, layer_idx, sublayer) for sublayer in ("attention", "mlp"))
        self.layer_type = layer_type_of(config, layer_idx)
        self.attention = EncoderStackAttention(config, qkv_norm=attention.qkv_norm, layer_type=self.layer_type)
        self.attention_residual = Residual(config, attention, layer_idx)
        self.mlp = EncoderStackMLP(config)
        self.mlp_residual = Residual(config, mlp, layer_idx)
        for sublayer, row in ((self.attention, attention), (self.mlp, mlp)):
            for projection in sublayer.modules():
                if isinstance(projection, LayerProjection):
                    branch = isinstance(projection, BranchProjection)
                    projection.init_std = row.init_std(config, projection.in_features, branch)

    def forward(self, hidden_states, dual, attention_mask, rotary=None, **kwargs):
        """`rotary`: {layer type: (cos, sin)}, of which this layer takes its type's."""
        rotary = rotary[self.layer_type] if rotary is not None else None

        def attend(hidden_states):
            return self.attention(hidden_states, attention_mask, rotary, **kwargs)[0]

        hidden_states, dual = self.attention_residual(hidden_states, dual, attend)
        return self.mlp_residual(hidden_states, dual, self.mlp)


class EncoderStackFinal(nn.Module):
    """What follows the last layer: nothing (post, deepnorm, admin), LN(h) (the placements with a pre-LN layer), or
    a + LN(d) (ResiDual)."""

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        self.norm = make_norm(config) if PLACEMENTS[config.norm_placement].final_norm else nn.Identity()

    def forward(self, stream, dual):
        return self.norm(stream) if dual is None else stream + self.norm(dual)


class EncoderStackPooler(nn.Module):
    """BERT's pooler: tanh(dense(first token of each sequence))."""

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, first_tokens):
        return torch.tanh(self.dense(first_tokens))


class EncoderStackLMHead(nn.Module):
    """The masked-LM head, as the layout's `Heads.lm` says: BERT's dense, activation, norm, then the decoder tied to
    the word embeddings (at `embedding_size` where the embeddings are narrower than the hidden states, as ELECTRA's
    generator); the decoder alone; or two projections, each followed by the activation, then the decoder."""

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        size = config.embedding_size or config.hidden_size
        heads = HEADS[config.head_layout]
        act = heads.lm_act or config.hidden_act
        self.act = ACT2FN[GATED_ACTIVATIONS.get(act, act)]
        self.dense = self.dense_out = None
        self.norm = nn.Identity()
        if heads.lm == "transform":
            self.dense = Linear(config.hidden_size, size, bias=config.classifier_bias)
            self.norm = make_norm(config, size)
        elif heads.lm == "two_layer":
            inner = config.prediction_head_size or config.hidden_size
            self.dense = Linear(config.hidden_size, inner, bias=config.classifier_bias)
            self.dense_out = Linear(inner, size, bias=config.classifier_bias)
        self.decoder = Linear(size, config.vocab_size, bias=config.decoder_bias)

    def forward(self, hidden_states):
        if self.dense is not None:
            hidden_states = self.act(self.dense(hidden_states))
        if self.dense_out is not None:
            hidden_states = self.act(self.dense_out(hidden_states))
        return self.decoder(self.norm(hidden_states))


def has_shortcut_scales(encoder) -> bool:
    """Whether the encoder's residuals hold Admin's omegas, which profiling sets."""
    return any(layer.attention_residual.omega is not None for layer in encoder.layers)


class EncoderStackPreTrainedModel(PreTrainedModel):
    config: EncoderStackConfig
    config_class = EncoderStackConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["EncoderStackEmbeddings", "EncoderStackLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = True  # packed sequences reach it as cu_seq_lens_q/k (tested with a stand-in: no GPU here)
    _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": EncoderStackLayer, "attentions": EncoderStackAttention}

    # Installed by `encoderstack.register()` so that `from_pretrained` also converts BERT checkpoints on the fly;
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

    # Installed by `encoderstack.register()` so that `push_to_hub` checks what it sends and writes the package's
    # model card (transformers' own writes a generic template); a remote-code copy pushes the way transformers does.
    hub_publisher = None

    def push_to_hub(self, repo_id: str, **kwargs):
        """Save the model with its card and code files and push it to the Hub repository `repo_id` in one commit."""
        publisher = EncoderStackPreTrainedModel.hub_publisher
        return publisher(self, repo_id, **kwargs) if publisher else super().push_to_hub(repo_id, **kwargs)

    def post_init(self):
        super().post_init()
        self.set_cpu_kernels(self.config.cpu_kernels)

    def set_cpu_kernels(self, library: str) -> None:
        """Which library runs this model's float32 projections and attention on the CPU from now on, and whether
        inference reads oneDNN's prepacked weights (`config.cpu_kernels`, one of `CPU_KERNELS`), as
        `set_attn_implementation` does for attention. Leaving "onednn-prepacked" frees the packed copies."""
        if library not in CPU_KERNELS:
            raise ValueError(f"`cpu_kernels` must be one of {', '.join(map(repr, CPU_KERNELS))}, got {library!r}.")
        self.config.cpu_kernels = library
        for module in self.modules():
            if isinstance(module, Linear):
                module.cpu_kernels = library
                if library != "onednn-prepacked":
                    prepacked_weights.pop(module.weight, None)

    def _init_weights(self, module):
        """BERT's init (normal(0, initializer_range), zero biases, unit norms), then the placement's init gain, or
        DeepScaleLM's normal(0, 1/fan_in) for every projection of a layer; Admin's omega starts at 1 (see
        `profile_admin`), DyT/Derf at weight 1, bias 0, alpha `dyt_alpha_init`, shift 0."""
        super()._init_weights(module)
        if isinstance(module, LayerProjection) and module.init_std is not None:
            init.normal_(module.weight, mean=0.0, std=module.init_std)
        elif isinstance(module, Residual) and module.omega is not None:
            init.ones_(module.omega)
        elif isinstance(module, DynamicTanh):
            init.ones_(module.weight)
            init.zeros_(module.bias)
            init.constant_(module.alpha, module.alpha_init)
            if isinstance(module, DynamicErf):
                init.zeros_(module.shift)
        elif isinstance(module, EncoderStackRotaryEmbedding):
            for layer_type in module.layer_types:
                inv_freq, _ = module.compute_inv_freq(layer_type)
                init.copy_(getattr(module, f"{layer_type}_inv_freq"), inv_freq)
                init.copy_(getattr(module, f"{layer_type}_original_inv_freq"), inv_freq)

    def prepare_for_training(self, input_ids, attention_mask=None, token_type_ids=None) -> None:
        """What a fresh model does on a typical batch before its first training step, as its placement needs: Admin's
        shortcut scales profiled (`profile_admin`); nothing for the other placements."""
        if has_shortcut_scales(self.model if isinstance(self, EncoderStackHead) else self):
            self.profile_admin(input_ids, attention_mask, token_type_ids=token_type_ids)

    @torch.no_grad()
    def profile_admin(self, input_ids, attention_mask=None, token_type_ids=None) -> list[float]:
        """Admin (Liu et al. 2020): set every sublayer's shortcut scale omega from one forward pass on a batch, as its
        reference's profiling does: omega_1 = 1 and omega_{i+1} = sqrt(Var[omega_i x_{i-1}] + Var[f_i(x_{i-1})]) over
        the sublayers in order, variances over every feature of the real tokens. Call it once, before training, on a
        typical batch; returns the omegas. Only for `norm_placement="admin"`."""
        encoder = self.model if isinstance(self, EncoderStackHead) else self
        if not has_shortcut_scales(encoder):
            raise ValueError(f"profile_admin is for norm_placement='admin', not {self.config.norm_placement!r}.")
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        omegas, shortcut = [1.0], []

        def set_omega(residual, args):
            residual.omega.fill_(omegas[-1])
            shortcut.append(args[0][real].mul(omegas[-1]).var(correction=0).item())

        def next_omega(sublayer, args, output):
            branch = output[0] if isinstance(output, tuple) else output
            omegas.append(math.sqrt(shortcut[-1] + branch[real].var(correction=0).item()))

        hooks = []
        for layer in encoder.layers:
            for residual, sublayer in ((layer.attention_residual, layer.attention), (layer.mlp_residual, layer.mlp)):
                hooks += [residual.register_forward_pre_hook(set_omega), sublayer.register_forward_hook(next_omega)]
        training = encoder.training
        try:
            encoder.eval()
            # padded, so that every hook sees (batch, seq, hidden) and `real` picks its real tokens
            encoder(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, padding_free=False
            )
        finally:
            for hook in hooks:
                hook.remove()
            encoder.train(training)
        return omegas[:-1]


class EncoderStackModel(EncoderStackPreTrainedModel):
    """The bare encoder: embeddings, N layers, the placement's final step, and (optionally) BERT's pooler."""

    def __init__(self, config: EncoderStackConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = EncoderStackEmbeddings(config)
        self.rotary = EncoderStackRotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        relative = {"bias": RelativePositionBias, "disentangled": DisentangledPositions}.get(config.relative_attention)
        self.relative_attention = relative(config) if relative is not None else None
        # `layers` holds each stored layer once (built as its first use); `layer_order`, the stored layer each runs
        self.layer_order = config.stored_layer_of()
        self.layers = nn.ModuleList(
            EncoderStackLayer(config, self.layer_order.index(stored)) for stored in range(max(self.layer_order) + 1)
        )
        self.final = EncoderStackFinal(config)
        pooled = add_pooling_layer and HEADS[config.head_layout].pooler
        self.pooler = EncoderStackPooler(config) if pooled else None
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
        **kwargs: Unpack[EncoderStackKwargs],
    ) -> BaseModelOutputWithPooling:
        """`padding_free` overrides `config.padding_free` for this call, and flattened rows (`position_ids` that
        restart, or `cu_seq_lens_q/k`) never attend across sequences (see `execution_plan`). With flattened rows,
        `pooler_output` has one row per sequence."""
        inputs = (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        # A task head passes the plan it made: it runs its token-level work on the same tokens.
        plan = kwargs.pop("plan", None) or self.execution_plan(*inputs, padding_free=padding_free, **kwargs)
        packing = plan.packing
        for name in VARLEN_KWARGS:  # the plan describes the sequences from here on
            kwargs.pop(name, None)
        batch_size, seq_length = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        device = input_ids.device if input_ids is not None else inputs_embeds.device
        if position_ids is None:
            position_ids = default_position_ids(self.config, input_ids, attention_mask, packing, seq_length, device)
        position_ids = position_ids.expand(batch_size, seq_length)
        if plan.packed:  # gather the real tokens into one row once, before the embeddings
            input_ids, token_type_ids, position_ids, inputs_embeds = (
                None if x is None else packing.pack(x) for x in (input_ids, token_type_ids, position_ids, inputs_embeds)
            )

        hidden_states = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)
        if plan.packed:
            kwargs.update(packing.attention_kwargs())
        layer_types = [layer.layer_type for layer in self.layers]
        disentangled = self.config.relative_attention == "disentangled"
        bias = None if disentangled else self.relative_attention  # MPNet's: one score table, folded into the masks
        masks = attention_masks(self.config, plan, layer_types, hidden_states, attention_mask, bias)
        # DeBERTa's: the relative positions once per forward, which each layer reads with its own queries and keys
        positions = None
        if disentangled:
            positions = self.relative_attention(plan.attended_length(hidden_states), plan.facts.dtype)
        # in the compute dtype: under autocast, float32 tables would promote bfloat16 queries and keys back to float32
        rotary = self.rotary(position_ids, plan.facts.dtype) if self.rotary is not None else None
        dual = None
        for stored in self.layer_order:
            layer = self.layers[stored]
            mask = masks[plan.runs_as(layer.layer_type)]
            hidden_states, dual = layer(hidden_states, dual, mask, rotary, plan=plan, positions=positions, **kwargs)
        hidden_states = self.final(hidden_states, dual)
        if plan.packed:  # scatter once, at the end
            hidden_states = packing.unpack(hidden_states)
        pooled = None
        if self.pooler is not None:
            pooled = self.pooler(first_tokens(hidden_states, attention_mask, packing))
        return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=pooled)

    def execution_plan(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        padding_free=None,
        labels=None,
        **kwargs,
    ) -> ExecutionPlan:
        """How a forward on these inputs runs, with the packing it runs on (`execution_encoderstack.execution_plan`
        checks the inputs and decides; a task head passes its `labels`, read in the same host sync): what `forward`
        does first, and the way to ask from Python which plan given inputs get. Logged at debug level, under this
        module's logger."""
        inputs = (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        plan = execution_plan(self.config, inputs, padding_free, kwargs, self.dtype, self.training, labels)
        if not torch.compiler.is_compiling():  # a logging call would break the compiled graph
            logger.debug("EncoderStack execution plan: %s through %s: %s", plan.kind, plan.attention, plan.reason)
        return plan


@dataclass
class EncoderStackForPreTrainingOutput(ModelOutput):
    """Masked-LM and sentence-pair logits, next sentence (BERT's name) or sentence order (ALBERT's, `sop_logits`) as
    the layout's head predicts; `loss` is their sum when both label sets are given."""

    loss: torch.Tensor | None = None
    prediction_logits: torch.Tensor | None = None
    seq_relationship_logits: torch.Tensor | None = None
    sop_logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


def mean_loss(per_item: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Mean over this batch, or, under Trainer's gradient accumulation, the sum over the whole accumulated batch's
    item count, so that k accumulated steps give the same update as one step on the combined batch."""
    if num_items_in_batch is None:
        return per_item.mean()
    return per_item.sum() / num_items_in_batch


def cross_entropy(logits, labels, num_items_in_batch=None, ignore_index=-100, known_range=None):
    """Mean cross-entropy over the labels that are not `ignore_index`, after checking their range: one host sync, or
    none where the caller read the counted labels' `known_range` (lowest, highest) already."""
    if not holds_integers(labels):
        raise TypeError(f"Class labels must be integers, got {labels.dtype}.")
    labels = labels.to(logits.device).reshape(-1)
    classes = logits.shape[-1]
    counts = labels != ignore_index
    unchecked = known_range is None and not torch.compiler.is_compiling()
    if unchecked and (counts & ((labels < 0) | (labels >= classes))).any():  # one host sync
        known_range = labels[counts].min().item(), labels[counts].max().item()
    if known_range is not None and (known_range[0] < 0 or known_range[1] >= classes):
        raise ValueError(
            f"Class labels must lie in [0, {classes - 1}] (or be {ignore_index}, ignored), got values "
            f"from {known_range[0]} to {known_range[1]}."
        )
    loss = nn.functional.cross_entropy(
        logits.float().reshape(labels.numel(), -1), labels, reduction="none", ignore_index=ignore_index
    )
    if num_items_in_batch is None:
        return loss.sum() / counts.sum()
    return loss.sum() / num_items_in_batch


def check_shape(name: str, labels: torch.Tensor, expected: tuple, what: str) -> None:
    if tuple(labels.shape) != tuple(expected):
        raise ValueError(f"`{name}` has shape {tuple(labels.shape)}, but {what} need shape {tuple(expected)}.")


def span_loss(logits: torch.Tensor, real: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """BERT's span cross-entropy over each row's positions: a target outside the row (or at padding) is ignored,
    a negative one is clamped to 0, as in BERT."""
    check_shape("start_positions/end_positions", positions.reshape(-1), logits.shape[:1], "the sequences")
    ignored = logits.shape[1]
    positions = positions.reshape(-1).to(logits.device).clamp(0, ignored)
    at_real_token = real.gather(1, positions.clamp(max=ignored - 1)[:, None]).squeeze(1) & (positions < ignored)
    return cross_entropy(logits, positions.where(at_real_token, ignored), ignore_index=ignored)


def first_real_tokens(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(batch, seq, ...) -> (batch, ...): each row's first real token, what a first-token head pools. That is position
    0 under right padding, as in BERT; under left padding BERT would pool a padding token (and padding-free, which
    leaves zeros there, a constant), so the first token the mask marks real is taken on every path."""
    if attention_mask is None or attention_mask.dim() != 2:
        return hidden_states[:, 0]
    first = attention_mask.to(device=hidden_states.device, dtype=torch.int).argmax(-1)  # the first 1 of each row
    return hidden_states[torch.arange(first.numel(), device=first.device), first]


def first_tokens(hidden_states: torch.Tensor, attention_mask, packing: "PackedSequences | None") -> torch.Tensor:
    """(batch, seq, ...) -> (sequences, ...): the first real token of every sequence, rows or flattened."""
    if packing is not None and packing.flattened:
        return packing.first_tokens(packing.pack(hidden_states))
    return first_real_tokens(hidden_states, attention_mask)


def pool_tokens(encoded: "Encoded", tokens: torch.Tensor, pooling: str) -> torch.Tensor:
    """(batch, seq, ...) -> (sequences, ...): each sequence's first real token (`"first"`) or the mean of its real
    tokens (`"mean"`), in rows or flattened sequences."""
    packing = encoded.packing
    if pooling == "first":
        return first_tokens(tokens, encoded.real, packing)
    if packing is not None and packing.flattened:
        tokens, real = packing.by_sequence(packing.pack(tokens))
    else:
        real = encoded.real if encoded.real is not None else tokens.new_ones(tokens.shape[:2], dtype=torch.bool)
    real = real.to(device=tokens.device, dtype=tokens.dtype).unsqueeze(-1)
    return (tokens * real).sum(1) / real.sum(1)


@dataclass
class Encoded:
    """The encoder's outputs as a head sees them: with the packing it ran on, and the real tokens of a padded batch.

    One definition of the loss on every path: padded positions never enter it (labels there count for nothing, span
    logits there are masked), whether the batch ran padding-free, padded, compiled or recorded its hidden states.
    """

    outputs: BaseModelOutputWithPooling
    packing: PackedSequences | None
    real: torch.Tensor | None  # (batch, seq) bool; None when every token is real
    labels: tuple[int, int, int] | None = None  # read with the plan: labels counted, lowest, highest

    @property
    def label_range(self) -> tuple[int, int] | None:
        """The counted labels' lowest and highest, for `cross_entropy`'s check; None where none were read or counted."""
        return None if self.labels is None or not self.labels[0] else self.labels[1:]

    def per_token(self, head, labels=None, num_items_in_batch=None, sparse=False):
        """A token-level head's logits and, given `labels`, their cross-entropy. Padding-free, both run on the real
        tokens only, and the logits come back with zeros at the padding; `sparse`, on the labelled tokens only."""
        hidden_states = self.outputs.last_hidden_state
        if labels is not None:
            check_shape("labels", labels, hidden_states.shape[:2], "the inputs")
            if sparse:
                return self.labelled_only(head, labels, num_items_in_batch)
        gathered = self.packing is not None and not self.packing.flattened
        if gathered:
            hidden_states = self.packing.pack(hidden_states)
            labels = self.packing.pack(labels.to(hidden_states.device)) if labels is not None else None
        elif labels is not None and self.real is not None:
            labels = labels.masked_fill(~self.real.to(labels.device), -100)
        logits = head(hidden_states)
        loss = None
        if labels is not None:
            loss = cross_entropy(logits, labels, num_items_in_batch, known_range=self.label_range)
        return (self.packing.unpack(logits) if gathered else logits), loss

    def labelled_only(self, head, labels, num_items_in_batch):
        """Sparse prediction: the head, its logits (one row per labelled token) and the loss on labelled tokens."""
        hidden_states = self.outputs.last_hidden_state
        labels = labels.to(hidden_states.device)
        if self.real is not None:
            labels = labels.masked_fill(~self.real.to(labels.device), -100)
        labels = labels.reshape(-1)
        counts = labels != -100
        if not holds_integers(labels):
            raise TypeError(f"Class labels must be integers, got {labels.dtype}.")
        if self.labels is not None:  # read with the plan
            count, low, high = self.labels
        else:  # one host sync: the number of labelled tokens, with their range for `cross_entropy`'s check
            count, low, high = torch.stack((counts.sum(), *counted_range(labels, counts))).tolist()
        labelled = counts.nonzero_static(size=count).squeeze(-1)
        logits = head(hidden_states.reshape(-1, hidden_states.shape[-1]).index_select(0, labelled))
        loss = cross_entropy(logits, labels.index_select(0, labelled), num_items_in_batch, known_range=(low, high))
        return logits, loss

    @property
    def recorded(self) -> dict:
        """The hidden states and attention maps the caller asked for, as every output class names them."""
        return {"hidden_states": self.outputs.hidden_states, "attentions": self.outputs.attentions}

    def by_sequence(self, tokens: torch.Tensor, fill) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token values as one row per sequence, and where its real tokens are: the rows themselves, unless the
        rows are flattened sequences."""
        if self.packing is not None and self.packing.flattened:
            return self.packing.by_sequence(self.packing.pack(tokens), fill)
        real = self.real if self.real is not None else torch.ones(tokens.shape[:2], dtype=torch.bool)
        return tokens, real.to(tokens.device)


class EncoderStackHead(EncoderStackPreTrainedModel):
    """What the task heads share: the encoder (pooled or not), and the forward of those that take `labels`, which
    leaves the task to `predict`."""

    uses_pooler = False
    head_part = None  # "sequence" or "choice": the sequence-level head this is, in the layout's `HEADS` row

    def __init__(self, config: EncoderStackConfig):
        super().__init__(config)
        self.first_token_act = getattr(HEADS[config.head_layout], self.head_part) if self.head_part else None
        self.model = EncoderStackModel(config, add_pooling_layer=self.uses_pooler and self.first_token_act is None)

    def encode(
        self,
        input_ids,
        attention_mask,
        token_type_ids,
        position_ids,
        inputs_embeds,
        padding_free=None,
        labels=None,
        **kwargs,
    ) -> Encoded:
        """The encoder's outputs, and the packing it ran on for the token-level heads (planned once, here, together
        with a first read of the class `labels`)."""
        kwargs.pop("num_items_in_batch", None)
        inputs = (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        plan = self.model.execution_plan(*inputs, padding_free=padding_free, labels=labels, **kwargs)
        outputs = self.model(*inputs, plan=plan, return_dict=True, **kwargs)
        real = attention_mask.bool() if attention_mask is not None and attention_mask.dim() == 2 else None
        return Encoded(outputs, plan.packing, real, plan.labels)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Unpack[EncoderStackKwargs],
    ) -> ModelOutput:
        inputs = (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        encoded = self.encode(*inputs, labels=labels, **kwargs)
        return self.predict(encoded, labels, kwargs.get("num_items_in_batch"))


class EncoderStackClassifierHead(EncoderStackHead):
    """Dropout + one linear layer on the pooled output (sequence-level heads) or on every token, after the layout's
    dense layer, activation and norm where it has them."""

    num_outputs = None  # defaults to config.num_labels

    def __init__(self, config: EncoderStackConfig):
        super().__init__(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        if self.first_token_act is not None:  # the family's own transform in place of BERT's pooler
            self.pre_classifier = nn.Linear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
            self.pre_classifier_act = ACT2FN[self.first_token_act]
            self.pre_classifier_norm = make_norm(config) if HEADS[config.head_layout].transform_norm else nn.Identity()
        self.classifier = nn.Linear(config.hidden_size, self.num_outputs or config.num_labels)
        self.post_init()

    def transform(self, features):
        """The layout's dense, activation (and norm) before the classifier; nothing where it has none."""
        if self.first_token_act is None:
            return features
        return self.pre_classifier_norm(self.pre_classifier_act(self.pre_classifier(features)))

    def logits(self, features):
        return self.classifier(self.dropout(features))

    def token_logits(self, hidden_states):
        return self.logits(self.transform(hidden_states))

    def sequence_features(self, encoded: Encoded) -> torch.Tensor:
        """What a sequence-level head classifies: BERT's pooled output, or the layout's transform of each sequence's
        pooled tokens (`config.classifier_pooling`: its first real token or their mean)."""
        if self.model.pooler is not None:
            return encoded.outputs.pooler_output
        pooled = pool_tokens(encoded, encoded.outputs.last_hidden_state, self.config.classifier_pooling)
        return self.transform(self.dropout(pooled))

    def sequence_logits(self, encoded: Encoded) -> torch.Tensor:
        """One row of logits per sequence; `late` pooling (EuroBERT) averages the per-token logits instead."""
        if self.config.classifier_pooling == "late":
            return pool_tokens(encoded, self.token_logits(encoded.outputs.last_hidden_state), "mean")
        return self.logits(self.sequence_features(encoded))


class EncoderStackForMaskedLM(EncoderStackHead):
    """Masked-LM logits for every token (in training with labels, for the labelled ones: `config.sparse_prediction`);
    labels at padded positions count for nothing."""

    _tied_weights_keys = {"lm_head.decoder.weight": "model.embeddings.word_embeddings.weight"}

    def __init__(self, config: EncoderStackConfig):
        super().__init__(config)
        self.lm_head = EncoderStackLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    def predict(self, encoded: Encoded, labels, num_items) -> MaskedLMOutput:
        sparse = self.training and self.config.sparse_prediction
        logits, loss = encoded.per_token(self.lm_head, labels, num_items, sparse)
        return MaskedLMOutput(loss=loss, logits=logits, **encoded.recorded)


PAIR_LOGITS = {"next_sentence": "seq_relationship_logits", "sentence_order": "sop_logits"}  # the families' names


class EncoderStackForPreTraining(EncoderStackHead):
    """Masked LM + next-sentence prediction, as BERT was pre-trained; or + sentence-order prediction, ALBERT's, where
    the layout says so (`Heads.sentence_pair`): the same 2-way classifier on the pooled output (after the classifier
    dropout, as ALBERT's), whose labels say whether the two segments are swapped (`next_sentence_label`, or
    ALBERT's name for it, `sentence_order_label`).

    The two losses count different items (masked tokens, sentence pairs), so Trainer's single `num_items_in_batch`
    cannot normalize both: this head returns per-batch means and lets Trainer divide by the accumulation steps.
    """

    uses_pooler = True
    accepts_loss_kwargs = False
    _tied_weights_keys = {"lm_head.decoder.weight": "model.embeddings.word_embeddings.weight"}

    def __init__(self, config: EncoderStackConfig):
        if not HEADS[config.head_layout].pooler:
            raise ValueError(
                f"head_layout {config.head_layout!r} has no pooler for the next-sentence head; ELECTRA's pre-training "
                "head is EncoderStackForReplacedTokenDetection"
            )
        super().__init__(config)
        self.lm_head = EncoderStackLMHead(config)
        # the sentence-pair classifier is named for its task: `next_sentence` (BERT) or `sentence_order` (ALBERT)
        self.pair_task = HEADS[config.head_layout].sentence_pair
        setattr(self, self.pair_task, nn.Linear(config.hidden_size, 2))
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.pair_dropout = nn.Dropout(dropout if self.pair_task == "sentence_order" else 0.0)  # BERT's has none
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        next_sentence_label: torch.Tensor | None = None,
        **kwargs: Unpack[EncoderStackKwargs],
    ) -> EncoderStackForPreTrainingOutput:
        sentence_order_label = kwargs.pop("sentence_order_label", None)  # ALBERT's name for the same labels
        next_sentence_label = sentence_order_label if next_sentence_label is None else next_sentence_label
        mlm_labels = labels if next_sentence_label is not None else None
        inputs = (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        encoded = self.encode(*inputs, labels=mlm_labels, **kwargs)
        sparse = self.training and self.config.sparse_prediction
        prediction_logits, loss = encoded.per_token(self.lm_head, mlm_labels, sparse=sparse)
        pair_logits = getattr(self, self.pair_task)(self.pair_dropout(encoded.outputs.pooler_output))
        if loss is not None:
            check_shape("next_sentence_label", next_sentence_label, pair_logits.shape[:1], "the sequences")
            loss = loss + cross_entropy(pair_logits, next_sentence_label)
        name = PAIR_LOGITS[self.pair_task]
        return EncoderStackForPreTrainingOutput(
            loss=loss, prediction_logits=prediction_logits, **{name: pair_logits}, **encoded.recorded
        )


class EncoderStackForSequenceClassification(EncoderStackClassifierHead):
    """Classification or regression on the pooled first token; the loss follows `config.problem_type` as in BERT."""

    uses_pooler = True
    head_part = "sequence"

    def predict(self, encoded: Encoded, labels, num_items) -> SequenceClassifierOutput:
        logits = self.sequence_logits(encoded)
        loss = self.sequence_loss(logits, labels, num_items, encoded.label_range) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits, **encoded.recorded)

    def sequence_loss(self, logits, labels, num_items, known_range=None):
        if self.config.problem_type is None:
            if self.config.num_labels == 1:
                self.config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                self.config.problem_type = "single_label_classification"
            else:
                self.config.problem_type = "multi_label_classification"
        labels = labels.to(logits.device)
        if self.config.problem_type == "single_label_classification":
            check_shape("labels", labels.reshape(-1), logits.shape[:1], "the sequences")
            return cross_entropy(logits, labels, num_items, known_range=known_range)
        if self.config.problem_type == "regression":
            check_shape("labels", labels.reshape(-1), (logits.numel(),), "the sequences' regression targets")
            errors = (logits.float().reshape(labels.shape) - labels.float()) ** 2
            return mean_loss(errors, num_items)
        check_shape("labels", labels, logits.shape, "the sequences' multi-label targets")
        errors = nn.functional.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
        return mean_loss(errors, num_items)


class EncoderStackForTokenClassification(EncoderStackClassifierHead):
    """One label per token; labels at padded positions count for nothing."""

    head_part = "token"

    def predict(self, encoded: Encoded, labels, num_items) -> TokenClassifierOutput:
        logits, loss = encoded.per_token(self.token_logits, labels, num_items)
        return TokenClassifierOutput(loss=loss, logits=logits, **encoded.recorded)


class EncoderStackForQuestionAnswering(EncoderStackClassifierHead):
    """Span start/end logits per token, masked to the dtype's minimum at padding (a span never starts there).
    Positions outside the sequence are ignored, as in BERT; with flattened rows, one position per sequence, counted
    from that sequence's first token."""

    num_outputs = 2
    head_part = "token"

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
        **kwargs: Unpack[EncoderStackKwargs],
    ) -> QuestionAnsweringModelOutput:
        encoded = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        logits, _ = encoded.per_token(self.token_logits)
        if encoded.real is not None:
            logits = logits.masked_fill(~encoded.real[..., None].to(logits.device), torch.finfo(logits.dtype).min)
        start_logits, end_logits = (part.squeeze(-1).contiguous() for part in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            minimum = torch.finfo(logits.dtype).min
            starts, real = encoded.by_sequence(start_logits, minimum)
            ends, _ = encoded.by_sequence(end_logits, minimum)
            loss = (span_loss(starts, real, start_positions) + span_loss(ends, real, end_positions)) / 2
        return QuestionAnsweringModelOutput(
            loss=loss, start_logits=start_logits, end_logits=end_logits, **encoded.recorded
        )


class EncoderStackForMultipleChoice(EncoderStackClassifierHead):
    """One score per choice from the pooled first token; inputs are (batch, num_choices, sequence)."""

    uses_pooler = True
    head_part = "choice"
    num_outputs = 1

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs: Unpack[EncoderStackKwargs],
    ) -> MultipleChoiceModelOutput:
        num_items = kwargs.get("num_items_in_batch")
        choices = input_ids if input_ids is not None else inputs_embeds
        if choices is None or choices.dim() < 3:
            raise ValueError(
                "Multiple choice takes inputs of shape (batch, num_choices, sequence), got "
                f"{None if choices is None else tuple(choices.shape)}."
            )
        batch_size, num_choices = choices.shape[:2]
        flat = [
            None if x is None else x.flatten(0, 1)
            for x in (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        ]
        encoded = self.encode(*flat, labels=labels, **kwargs)
        if encoded.packing is not None and encoded.packing.flattened:
            raise ValueError(
                "Multiple choice scores whole rows: flattened sequences (`position_ids` that restart, or "
                "`cu_seq_lens_q`) are not supported; pass padded (batch, num_choices, sequence) inputs."
            )
        logits = self.sequence_logits(encoded).view(-1, num_choices)
        if labels is not None:
            check_shape("labels", labels, (batch_size,), "the questions")
        loss = cross_entropy(logits, labels, num_items, known_range=encoded.label_range) if labels is not None else None
        return MultipleChoiceModelOutput(loss=loss, logits=logits, **encoded.recorded)


class EncoderStackDiscriminator(nn.Module):
    """ELECTRA's replaced-token detector: dense, activation, one logit per token."""

    def __init__(self, config: EncoderStackConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[GATED_ACTIVATIONS.get(config.hidden_act, config.hidden_act)]
        self.prediction = nn.Linear(config.hidden_size, 1)

    def forward(self, hidden_states):
        return self.prediction(self.act(self.dense(hidden_states))).squeeze(-1)


class EncoderStackForReplacedTokenDetection(EncoderStackHead):
    """ELECTRA's pre-training discriminator: for every token, the logit that it was replaced; `labels` 1 (replaced) or
    0 give the binary cross-entropy over the real tokens, as ELECTRA's."""

    accepts_loss_kwargs = False  # a mean over this batch's real tokens, as ELECTRA's

    def __init__(self, config: EncoderStackConfig):
        super().__init__(config)
        self.discriminator = EncoderStackDiscriminator(config)
        self.post_init()

    def predict(self, encoded: Encoded, labels, num_items) -> TokenClassifierOutput:
        logits, _ = encoded.per_token(self.discriminator)
        loss = None
        if labels is not None:
            check_shape("labels", labels, logits.shape, "the inputs")
            real = encoded.real if encoded.real is not None else torch.ones_like(logits, dtype=torch.bool)
            real = real.to(logits.device)
            loss = nn.functional.binary_cross_entropy_with_logits(
                logits.float()[real], labels.to(logits.device).float()[real]
            )
        return TokenClassifierOutput(loss=loss, logits=logits, **encoded.recorded)


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
    "EncoderStackForReplacedTokenDetection",
]
