"""EncoderStack: BERT's bidirectional encoder stack with the normalization placement as a config choice.

Read top to bottom: embeddings, attention (with `PackedSequences`, the one description of packed tokens, and
`ExecutionPlan`, the one decision of how a forward runs), feed-forward, the residual/normalization policy (the one
place that knows the placements), the layer, the stack, the pre-trained base with its initialization, then the task
heads.

Self-contained on purpose (imports torch, transformers and `.configuration_encoderstack` only): `save_pretrained`
copies this file next to the weights so that `trust_remote_code=True` works without the package.
"""

import copy
import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_bidirectional_sliding_window_mask,
    packed_sequence_mask_function,
)
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
from transformers.utils.generic import can_return_tuple, is_flash_attention_requested
from transformers.utils.output_capturing import capture_outputs

from .configuration_encoderstack import (  # noqa: F401 (Placement, PLACEMENTS, Heads: their old home, kept)
    GATED_ACTIVATIONS,
    HEADS,
    PLACEMENTS,
    EncoderStackConfig,
    Heads,
    Placement,
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
        self.project = nn.Linear(size, config.hidden_size) if size != config.hidden_size else nn.Identity()

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


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # transformers' names


class PackedSequences:
    """Sequences laid end to end in one row of real tokens, described the way transformers' flash-attention path
    describes them: cumulative lengths `cu_seq_lens` (0, l1, l1 + l2, ...) and the longest length.

    Built once per forward from whichever the caller gives: an attention mask with padding (each row's real tokens are
    one sequence, and `index` gathers them), `position_ids` that restart inside a row (`DataCollatorWithFlattening`),
    or explicit `cu_seq_lens_q/k`. Everything position-wise then runs on the packed row, and attention on each
    sequence alone, through the kwargs `cu_seq_lens_q/k` and `max_length_q/k` (see `ExecutionPlan`).
    """

    def __init__(self, lengths: list[int], shape: tuple[int, int], device, index=None):
        self.lengths = [length for length in lengths if length]  # a row of only padding holds no sequence
        self.shape = shape  # the input's (batch, seq)
        self.index = index  # the real tokens' flat positions in a padded input; None when the rows are the tokens
        self.lengths_tensor = torch.tensor(self.lengths, dtype=torch.long, device=device)
        self.cu_seq_lens = nn.functional.pad(self.lengths_tensor.cumsum(0), (1, 0)).int()
        self.max_length = max(self.lengths, default=0)

    @classmethod
    def from_attention_mask(cls, real: torch.Tensor, lengths: list[int]) -> "PackedSequences":
        """`real`: the boolean (batch, seq) mask of real tokens; `lengths`: its row sums."""
        index = real.flatten().nonzero_static(size=sum(lengths)).squeeze(-1)  # sized by `lengths`: no host sync
        return cls(lengths, tuple(real.shape), real.device, index)

    @classmethod
    def from_starts(cls, starts: torch.Tensor) -> "PackedSequences":
        """Flattened rows: `starts` marks the first token of every sequence (the first of each row among them)."""
        bounds = [*starts.flatten().nonzero().squeeze(-1).tolist(), starts.numel()]
        lengths = [end - start for start, end in zip(bounds, bounds[1:])]
        return cls(lengths, tuple(starts.shape), starts.device)

    @property
    def flattened(self) -> bool:
        """Whether rows hold several sequences (the input is already packed), rather than padding around one."""
        return self.index is None

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(batch, seq, ...) -> (1, tokens, ...)"""
        flat = padded.flatten(0, 1)
        return (flat if self.index is None else flat.index_select(0, self.index)).unsqueeze(0)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(1, tokens, ...) -> (batch, seq, ...), with zeros at the padding"""
        flat = packed.squeeze(0)
        if self.index is not None:
            flat = flat.new_zeros(self.shape[0] * self.shape[1], *flat.shape[1:]).index_copy_(0, self.index, flat)
        return flat.unflatten(0, self.shape)

    def attention_kwargs(self) -> dict:
        """transformers' varlen kwargs, and the lengths as Python ints (so that no layer syncs to read them)."""
        lengths = (self.cu_seq_lens, self.cu_seq_lens, self.max_length, self.max_length)
        return {**dict(zip(VARLEN_KWARGS, lengths)), "sequence_lengths": self.lengths}

    def sequence_ids(self) -> torch.Tensor:
        """(batch, seq): which sequence each token of flattened rows belongs to (for a block-diagonal mask)."""
        return self.packed_sequence_ids().view(self.shape)

    def packed_sequence_ids(self) -> torch.Tensor:
        """(1, tokens): which sequence each token of the packed row belongs to (sized by `lengths`: no host sync)."""
        sequences = torch.arange(len(self.lengths), device=self.lengths_tensor.device)
        return sequences.repeat_interleave(self.lengths_tensor, output_size=sum(self.lengths))[None]

    def position_ids(self) -> torch.Tensor:
        """(batch, seq) of flattened rows: each token's position within its own sequence."""
        starts = self.cu_seq_lens[:-1].long().repeat_interleave(self.lengths_tensor)
        return (torch.arange(starts.numel(), device=starts.device) - starts).view(self.shape)

    def first_tokens(self, packed: torch.Tensor) -> torch.Tensor:
        """(1, tokens, ...) -> (sequences, ...): the first token of every sequence."""
        return packed[0, self.cu_seq_lens[:-1].long()]

    def by_sequence(self, packed: torch.Tensor, fill=0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, tokens, ...) -> (sequences, max_length, ...) with `fill` past each end, and where the tokens are."""
        rows = nn.utils.rnn.pad_sequence(packed[0].split(self.lengths), batch_first=True, padding_value=fill)
        return rows, torch.arange(rows.shape[1], device=rows.device) < self.lengths_tensor[:, None]


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


class EncoderStackKwargs(TransformersKwargs, total=False):
    """transformers' forward kwargs, and ours: `padding_free` overrides `config.padding_free` for one call; `plan` is
    how a task head hands the encoder the `ExecutionPlan` it made (see `EncoderStackModel.execution_plan`)."""

    padding_free: bool | None
    plan: "ExecutionPlan | None"


def inspect_varlen_attn(kernel) -> tuple[Callable | None, bool]:
    """torch's `varlen_attn` and whether it takes `scale` (older releases do not; their fixed scale, head_dim^-0.5, is
    the one this model uses), checked once; (None, False) where its signature cannot be read."""
    try:
        return kernel, "scale" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return None, False


try:
    from torch.nn.attention.varlen import varlen_attn
except Exception:  # absent before torch 2.10; a build whose kernels fail to load raises other errors too
    varlen_attn = None
varlen_attn, VARLEN_TAKES_SCALE = inspect_varlen_attn(varlen_attn) if varlen_attn is not None else (None, False)
# sliding layers need its `window_size` (flash's inclusive (left, right)); where it has none, they run banded
VARLEN_TAKES_WINDOW = varlen_attn is not None and "window_size" in inspect.signature(varlen_attn).parameters
FLASH_TAKES_WINDOW = "window_size_left" in str(torch.ops.aten._flash_attention_forward.default._schema)


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


INPUT_KINDS = ("whole", "padded", "flattened")  # every row one sequence / a padded batch / several sequences a row
PLAN_KINDS = ("padded", "varlen", "per_sequence", "block_diagonal")
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PlanFacts:
    """Everything the execution plan depends on, read once per forward (see `EncoderStackModel.plan_facts`)."""

    inputs: str  # one of INPUT_KINDS
    backend: str  # config._attn_implementation
    device_type: str
    capability: tuple[int, int] | None  # CUDA compute capability; None off CUDA
    dtype: torch.dtype  # the compute dtype: autocast's where autocast is on, else the weights'
    head_dim: int
    attention_dropout: bool  # training with attention dropout > 0
    padding_free: bool  # asked for (config or argument)
    recording: bool  # hidden states or attention maps asked for: the hooks record the padded layout
    compiling: bool  # packed shapes change with every batch (a recompile each): compiled code stays padded
    varlen_kernel: bool  # torch's varlen_attn imported, with a signature this model can call
    sliding_window: int | None = None  # the sliding layers' radius; None when no layer slides
    longest: int = 0  # the longest sequence the layers see (the row's length where the lengths are not read)
    varlen_window: bool = True  # torch's varlen_attn takes `window_size`
    flash_window: bool = True  # torch's flash kernel takes `window_size_left/right`
    padded_tokens: int = 0  # batch x sequence length of the input


@dataclass(frozen=True)
class ExecutionPlan:
    """How one forward runs, decided once (`decide_plan`) and obeyed by every layer.

    kind: "padded" (the batch as BERT runs it, padding masked), "varlen" (real tokens packed into one row, one varlen
    kernel call per layer), "per_sequence" (packed, attention one sequence at a time: the CPU path) or
    "block_diagonal" (flattened rows with one dense mask: only where packing is off). `attention` is the name of the
    attention function in transformers' `AttentionInterface`; `packing` describes the packed or flattened sequences.

    Flattened rows without a flash kernel run one sequence at a time rather than through flex attention's document
    mask: on CPU flex has no backward, eager flex materializes every score (45-124x slower than per-sequence), and
    compiled flex was 4.5x slower where inductor could build it at all (docs/benchmarks/flex-document-mask-1thread.txt).
    On CUDA that comparison has not been measured (benchmarks/gpu_check.py runs it).

    Sliding layers are one more fact of the same plan: `sliding` names the attention function they run (None: they
    run as full layers, because no layer slides or the window covers every sequence), with the window as
    transformers' `sliding_window` kwarg (see `sliding_attention`).
    """

    kind: str
    attention: str
    reason: str
    facts: PlanFacts
    packing: "PackedSequences | None" = None
    sliding: str | None = None

    @property
    def packed(self) -> bool:
        """Whether the layers run on the packed row of real tokens (and attention reads `cu_seq_lens`)."""
        return self.kind in ("varlen", "per_sequence")

    def runs_as(self, layer_type: str) -> str:
        """The layer type a layer of `layer_type` runs as: a sliding layer whose window covers everything is full."""
        return "sliding_attention" if layer_type == "sliding_attention" and self.sliding else "full_attention"

    def layer_attention(self, layer_type: str) -> tuple[str, dict]:
        """The attention function a layer of `layer_type` calls, and what it adds to the call: the radius as
        transformers' `sliding_window` kwarg, radius + 1 (flash's window is inclusive; ModernBERT passes it so)."""
        if self.runs_as(layer_type) == "sliding_attention":
            return self.sliding, {"sliding_window": self.facts.sliding_window + 1}
        return self.attention, {}


def flash_missing(facts: PlanFacts) -> str | None:
    """Why no flash kernel (torch's `varlen_attn`, or its flash kernel called directly) can run here; None
    when one can."""
    checks = (
        (facts.backend == "sdpa", f"the {facts.backend} backend"),
        (facts.capability is not None, f"no CUDA device ({facts.device_type})"),
        (facts.capability is not None and facts.capability >= (8, 0), f"compute capability {facts.capability} < 8.0"),
        (facts.dtype in FLASH_DTYPES, f"{facts.dtype} (flash needs float16 or bfloat16)"),
        (
            facts.head_dim % 8 == 0 and facts.head_dim <= 256,
            f"head size {facts.head_dim} (flash: multiple of 8, <= 256)",
        ),
    )
    return next((why for holds, why in checks if not holds), None)


def decide_plan(facts: PlanFacts) -> ExecutionPlan:
    """The one decision of how a forward runs: a pure function of `facts`, so that every cell can be tested anywhere.
    The kind and the full layers' attention first, then how the sliding layers run on that kind."""
    plan = decide_kind(facts)
    if facts.sliding_window is None:
        return plan
    sliding, why = sliding_attention(facts, plan)
    return dataclasses.replace(plan, sliding=sliding, reason=f"{plan.reason}; sliding layers: {why}")


# Up to this many radii, a dense band mask beats banded attention: at radius 64 the dense mask was 1.19x faster on 512
# tokens (8 radii) and banded 1.41x faster on 1024 (docs/benchmarks/sliding-window-memory-1thread.txt).
DENSE_BAND_RADII = 8


def sliding_attention(facts: PlanFacts, plan: ExecutionPlan) -> tuple[str | None, str]:
    """How the sliding layers run on `plan`: a flash kernel's own window where one runs; a dense band mask where the
    forward is compiled or records attention maps (both run padded, and the maps are tokens x tokens anyway); flex
    attention's block-sparse band mask on CUDA; everywhere else `banded_attention`, O(tokens x window) (on CPU, flex
    attention outside torch.compile computes every score)."""
    radius = facts.sliding_window
    if not facts.compiling and radius >= facts.longest - 1:  # compiled code must not branch on the length
        return None, f"the window (radius {radius}) covers every sequence ({facts.longest} tokens): run as full"
    kernel_window = {VARLEN_ATTENTION: facts.varlen_window, FLASH_ATTENTION: facts.flash_window}
    if plan.attention in kernel_window:
        if kernel_window[plan.attention]:
            return plan.attention, f"the flash kernel's window ({radius}, {radius})"
        return BANDED_ATTENTION, "this torch's flash kernel takes no window: banded over the packed row"
    if is_flash_attention_requested(requested_attention_implementation=plan.attention):
        return plan.attention, f"flash's window ({radius}, {radius})"
    if facts.compiling or facts.recording:
        return plan.attention, "a dense (tokens x tokens) band mask"
    if facts.longest <= DENSE_BAND_RADII * radius and facts.backend != "flex_attention":
        if plan.attention == PER_SEQUENCE:
            return PER_SEQUENCE, f"sequences of at most {DENSE_BAND_RADII} radii: one at a time with a band mask"
        if not plan.packed:
            return plan.attention, f"rows of at most {DENSE_BAND_RADII} radii: a dense band mask"
    if facts.backend == "flex_attention" and facts.device_type == "cuda" and not plan.packed:
        return "flex_attention", "a block-sparse band mask"
    where = "the packed row" if plan.packed else "the rows"
    return BANDED_ATTENTION, f"banded over {where}, O(tokens x window)"


# Below this many tokens (batch x length) a GPU runs a padded batch at least as fast as its packed tokens: the step is
# bound by kernel launches, and packing adds some. Measured on an H200, bert-base, bf16, packed / padded
# (docs/benchmarks/gpu-h200-2026-12-04/): 3.5k tokens (32x108 text) 0.82-0.92 in training and 0.80 in inference, 4k
# (32x128, 8x512) 0.95-1.03, 14k (128x108 text) 1.45 in inference, 16k (32x512) 0.97-1.03 in training, 32k (64 rows of
# 64-512, a masked-LM step) 1.5, 64k (128x512) 1.67.
GPU_PACKING_MIN_TOKENS = 8192


def decide_kind(facts: PlanFacts) -> ExecutionPlan:
    def plan(kind, reason, attention=facts.backend):
        return ExecutionPlan(kind, attention, reason, facts)

    if facts.inputs == "whole":
        return plan("padded", "every row is one sequence: nothing to pack")
    if is_flash_attention_requested(requested_attention_implementation=facts.backend) and (
        facts.inputs == "flattened" or (facts.padding_free and not facts.recording)
    ):  # flash has no block-diagonal mask: flattened rows always go through its varlen path
        return plan("varlen", "transformers' flash path reads cu_seq_lens_q/k")
    off = [
        why
        for on, why in (
            (not facts.padding_free, "padding_free is off"),
            (facts.recording, "hidden states or attentions are recorded"),
            (facts.compiling, "torch.compile is tracing"),
        )
        if on
    ]
    if off:
        if facts.inputs == "padded":
            return plan("padded", f"{off[0]}: the padded batch")
        mask = "a block-sparse" if facts.backend == "flex_attention" else "a dense (tokens x tokens)"
        return plan("block_diagonal", f"{off[0]}: flattened rows get {mask} block-diagonal mask")
    missing = flash_missing(facts)
    if missing is None and facts.inputs == "padded" and facts.padded_tokens < GPU_PACKING_MIN_TOKENS:
        return plan("padded", f"{facts.padded_tokens} tokens: too few for packing to pay on a GPU (launch-bound)")
    if missing is None and facts.varlen_kernel and not facts.attention_dropout:
        return plan("varlen", "torch's varlen_attn: one call per layer", VARLEN_ATTENTION)
    if missing is None:  # the same flash kernel, called directly: it takes dropout_p
        why = "attention dropout in training" if facts.attention_dropout else "this torch has no usable varlen_attn"
        return plan("varlen", f"{why}: torch's flash kernel, dropout inside it, one call per layer", FLASH_ATTENTION)
    if facts.device_type == "cpu" or facts.inputs == "flattened":
        return plan("per_sequence", f"attention one sequence at a time (no varlen kernel: {missing})", PER_SEQUENCE)
    return plan("padded", f"no varlen kernel ({missing}): the padded batch beats one call per sequence")


def flattened_rows(position_ids, real, shape, device, kwargs) -> PackedSequences | None:
    """The sequences of flattened rows, from `cu_seq_lens_q/k` or from `position_ids` that restart (a new sequence
    starts wherever a position is not the previous one + 1, as in transformers' masks); None when every row is one
    sequence. Checks what it reads: a packing that does not fit the batch would silently mix sequences."""
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if cu_seq_lens is not None:
        packing = packing_from_cu_seq_lens(cu_seq_lens, kwargs, shape, device)
    elif position_ids is not None and shape[1] > 1:
        restarts = position_ids.expand(shape).diff(dim=-1) != 1
        if real is not None:  # only between two real tokens: positions at padding say nothing
            restarts &= real[:, 1:] & real[:, :-1]
        if not restarts.any():
            return None
        packing = PackedSequences.from_starts(nn.functional.pad(restarts, (1, 0), value=True))
    else:
        return None
    if real is not None and not real.all():
        raise ValueError(
            "Flattened rows (`position_ids` that restart inside a row, or `cu_seq_lens_q`) cannot also "
            "have padding in `attention_mask`: pass a padded batch or flattened rows, not both."
        )
    return packing


def packing_from_cu_seq_lens(cu_seq_lens, kwargs, shape, device) -> PackedSequences:
    cu_seq_lens_k = kwargs.get("cu_seq_lens_k")
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k.to(cu_seq_lens.device), cu_seq_lens):
        raise ValueError(
            "`cu_seq_lens_k` must equal `cu_seq_lens_q`: an encoder's queries and keys are the same tokens."
        )
    bounds = cu_seq_lens.tolist() if cu_seq_lens.dim() == 1 and not cu_seq_lens.is_floating_point() else None
    tokens = shape[0] * shape[1]
    if not bounds or bounds[0] != 0 or bounds[-1] != tokens or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"`cu_seq_lens_q` must be a 1-D integer tensor rising from 0 to the number of tokens "
            f"({tokens}), got {bounds if bounds else tuple(cu_seq_lens.shape)}."
        )
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    for name in ("max_length_q", "max_length_k"):
        given = kwargs.get(name)
        if given is not None and int(given) < max(lengths):
            raise ValueError(
                f"`{name}` is {int(given)}, but `cu_seq_lens_q` holds a sequence of {max(lengths)} tokens."
            )
    return PackedSequences(lengths, shape, device)


def per_sequence_attention(
    module, query, key, value, attention_mask, sequence_lengths=None, sliding_window=None, **kwargs
):
    """The configured backend run on each packed sequence alone, without a mask: the CPU path, where it measured
    fastest (1.4-1.7x over one masked call on a re-padded view), and flattened rows where no varlen kernel runs. In a
    sliding layer `attention_mask` holds one band mask per sequence (`band_masks`, built once per forward; None
    where the window covers the sequence); a caller from outside this model passes only `sliding_window`."""
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager_attention_forward)
    if sequence_lengths is None:  # called from outside this model: one host sync
        sequence_lengths = kwargs["cu_seq_lens_q"].diff().tolist()
    for name in VARLEN_KWARGS:
        kwargs.pop(name, None)
    bands = attention_mask
    if bands is None:
        radius = None if sliding_window is None else sliding_window - 1  # transformers' kwarg: the radius + 1
        bands = band_masks(sequence_lengths, radius, query.dtype, query.device)
    pieces = zip(*(x.split(sequence_lengths, dim=2) for x in (query, key, value)))
    contexts = [attention(module, q, k, v, band, **kwargs)[0] for (q, k, v), band in zip(pieces, bands) if q.shape[2]]
    return torch.cat(contexts, dim=1), None


def band_masks(lengths: list[int], radius: int | None, dtype, device) -> list[torch.Tensor | None]:
    """One additive (1, 1, length, length) band mask per sequence, |i - j| <= radius (one tensor per distinct length);
    None for a sequence the window covers, and for every sequence without a radius."""
    if radius is None:
        return [None] * len(lengths)
    bands = {length: band_mask(length, radius, dtype, device) for length in set(lengths) if length > radius + 1}
    return [bands.get(length) for length in lengths]


def band_mask(length: int, radius: int, dtype, device) -> torch.Tensor:
    """(1, 1, length, length), additive: 0 where |i - j| <= radius, the dtype's most negative value elsewhere."""
    positions = torch.arange(length, device=device)
    outside = (positions[:, None] - positions[None, :]).abs() > radius
    mask = torch.zeros(length, length, dtype=dtype, device=device).masked_fill(outside, torch.finfo(dtype).min)
    return mask[None, None]


def flash_layout(query, key, value) -> tuple[torch.Tensor, ...]:
    """(1, heads, tokens, head_dim) -> (tokens, heads, head_dim), the packed layout flash kernels take, in a dtype
    they take: under autocast a norm inside attention (HybridNorm's QKV norms) leaves float32 where the projections
    gave the autocast dtype."""
    dtype = query.dtype if query.dtype in FLASH_DTYPES else torch.get_autocast_dtype(query.device.type)
    return tuple(x.transpose(1, 2).squeeze(0).to(dtype) for x in (query, key, value))


def varlen_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs
):
    """torch's `varlen_attn` (flash, CUDA, half precision): every packed sequence in one call. It has no dropout
    argument: when attention dropout trains, the plan names `flash_attention` instead. `sliding_window` is
    transformers' kwarg (flash's inclusive window is `sliding_window - 1` keys either side, the radius)."""
    query, key, value = flash_layout(query, key, value)
    options = {"scale": scaling} if VARLEN_TAKES_SCALE else {}
    if sliding_window is not None:
        options["window_size"] = (sliding_window - 1, sliding_window - 1)
    context = varlen_attn(query, key, value, *(kwargs[name] for name in VARLEN_KWARGS), **options)
    return context.unsqueeze(0), None


def flash_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kw):
    """torch's flash kernel on the packed tokens (`aten._flash_attention_forward`, the kernel SDPA reaches): every
    sequence in one call per layer, with attention dropout inside the kernel. Its autograd formula hands the RNG
    state the forward returns to `_flash_attention_backward`, which replays the same dropout mask."""
    query, key, value = flash_layout(query, key, value)
    cu_seq_lens, longest = kw["cu_seq_lens_q"], kw["max_length_q"]
    radius = -1 if sliding_window is None else sliding_window - 1  # -1: no window
    window = {"window_size_left": radius, "window_size_right": radius} if FLASH_TAKES_WINDOW else {}
    context = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seq_lens, cu_seq_lens, longest, longest, dropout, False, False, scale=scaling, **window
    )[0]
    return context.unsqueeze(0), None


def band_block(radius: int) -> int:
    """Queries per block of `banded_attention`: the radius (rounded up to a power of two), 32 to 128. Each block
    computes block x (block + 2 radius) scores, so a small block wastes little on scores outside the band but makes
    more, smaller matmuls. Measured on this CPU, 1 thread, 4096 tokens, 4 heads of 64, two runs on a shared machine
    (docs/benchmarks/sliding-window-blocks-1thread.txt): this choice was the fastest or within 15% of it at radius 16,
    64 and 128, where blocks of 16 were up to 1.7x slower and 512 2-6x slower."""
    return min(max(32, 1 << (radius - 1).bit_length()), 128)


def band_blocks(radius: int, length: int) -> tuple[int, int, int, int]:
    """How `banded_attention` cuts a row of `length`: queries per block, blocks, keys per block (the block and the
    radius on each side) and the padding that completes the last block."""
    block = band_block(radius)
    blocks = -(-length // block)
    return block, blocks, block + 2 * radius, blocks * block - length


def band_layout(radius: int, length: int, sequence_ids: torch.Tensor | None, device) -> torch.Tensor:
    """Which of its keys each query of `banded_attention` sees, built once per forward: (batch or 1, 1, blocks,
    block, span), True within the band |i - j| <= radius, inside the row and, given `sequence_ids` ((batch, seq),
    padding -1), in the query's own sequence. Padded rows, packed real tokens and flattened rows all use it, with
    distances along the row equal to distances within a sequence."""
    block, blocks, span, tail = band_blocks(radius, length)
    starts = torch.arange(blocks, device=device)[:, None, None] * block
    query_at = starts + torch.arange(block, device=device)[:, None]  # (blocks, block, 1)
    key_at = starts - radius + torch.arange(span, device=device)  # (blocks, 1, span)
    allowed = ((query_at - key_at).abs() <= radius) & (key_at >= 0) & (key_at < length)
    if sequence_ids is None:
        return allowed[None, None]
    ids = sequence_ids.to(device)
    query_ids = nn.functional.pad(ids, (0, tail), value=-2).unflatten(1, (blocks, block))
    key_ids = nn.functional.pad(ids, (radius, radius + tail), value=-3).unfold(1, span, block)
    return (allowed & (query_ids[..., None] == key_ids[:, :, None, :])).unsqueeze(1)


def banded_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **_):
    """Sliding-window attention that costs O(tokens x window): the queries in blocks, each block against the keys
    within the radius of its first and last query (one batched matmul over all blocks, no loop), masked by
    `attention_mask`, the `band_layout` of this radius and row. No tokens x tokens tensor exists.
    `sliding_window` is transformers' kwarg (the radius + 1, as flash reads it)."""
    radius, length = sliding_window - 1, query.shape[2]
    block, blocks, span, tail = band_blocks(radius, length)

    def key_windows(x):  # (batch, heads, seq, dim) -> (batch, heads, blocks, span, dim): each block's keys, a view
        return nn.functional.pad(x, (0, 0, radius, radius + tail)).unfold(2, span, block).transpose(-1, -2)

    queries = nn.functional.pad(query, (0, 0, 0, tail)).unflatten(2, (blocks, block))
    scores = torch.matmul(queries, key_windows(key).transpose(-1, -2)) * scaling  # (batch, heads, blocks, block, span)
    # the most negative finite score, not -inf: a row with nothing allowed (padding past the end) stays finite
    scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    weights = nn.functional.softmax(scores, dim=-1)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    context = torch.matmul(weights, key_windows(value)).flatten(2, 3)[:, :, :length]
    return context.transpose(1, 2).contiguous(), None


VARLEN_ATTENTION, PER_SEQUENCE = "encoderstack_varlen", "encoderstack_per_sequence"
FLASH_ATTENTION, BANDED_ATTENTION = "encoderstack_flash", "encoderstack_banded"
AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
AttentionInterface.register(PER_SEQUENCE, per_sequence_attention)
AttentionInterface.register(FLASH_ATTENTION, flash_attention)
AttentionInterface.register(BANDED_ATTENTION, banded_attention)


class LayerProjection(nn.Linear):
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
        bias = config.attention_bias
        self.query = LayerProjection(config.hidden_size, config.hidden_size, bias=bias)
        self.key = LayerProjection(config.hidden_size, kv_size, bias=bias)
        self.value = BranchProjection(config.hidden_size, kv_size, bias=bias)
        self.output = BranchProjection(config.hidden_size, config.hidden_size, bias=bias)
        self.attention_dropout = config.attention_probs_dropout_prob
        # HybridNorm's QKV-norm: one norm over each head's features, shared by the heads, as its reference code
        norms = [make_norm(config, self.head_dim) if qkv_norm else nn.Identity() for _ in range(3)]
        self.query_norm, self.key_norm, self.value_norm = norms

    def forward(self, hidden_states, attention_mask, rotary=None, plan=None, **kwargs):
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

    def forward(self, hidden_states):
        if self.gated:
            gate, up = self.up(hidden_states).chunk(2, dim=-1)
            return self.down(self.act(gate) * up)
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
            self.dense = nn.Linear(config.hidden_size, size, bias=config.classifier_bias)
            self.norm = make_norm(config, size)
        elif heads.lm == "two_layer":
            inner = config.prediction_head_size or config.hidden_size
            self.dense = nn.Linear(config.hidden_size, inner, bias=config.classifier_bias)
            self.dense_out = nn.Linear(inner, size, bias=config.classifier_bias)
        self.decoder = nn.Linear(size, config.vocab_size, bias=config.decoder_bias)

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
        self.layers = nn.ModuleList(EncoderStackLayer(config, index) for index in range(config.num_hidden_layers))
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
        masks = self.attention_masks(plan, hidden_states, attention_mask)
        # in the compute dtype: under autocast, float32 tables would promote bfloat16 queries and keys back to float32
        rotary = self.rotary(position_ids, plan.facts.dtype) if self.rotary is not None else None
        dual = None
        for layer in self.layers:
            mask = masks[plan.runs_as(layer.layer_type)]
            hidden_states, dual = layer(hidden_states, dual, mask, rotary, plan=plan, **kwargs)
        hidden_states = self.final(hidden_states, dual)
        if plan.packed:  # scatter once, at the end
            hidden_states = packing.unpack(hidden_states)
        pooled = None
        if self.pooler is not None:
            pooled = self.pooler(first_tokens(hidden_states, attention_mask, packing))
        return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=pooled)

    def attention_masks(self, plan: ExecutionPlan, hidden_states, attention_mask) -> dict:
        """Each layer type's mask, built once and only for the types that run (as transformers' ModernBERT keeps them):
        none on packed rows (attention reads `cu_seq_lens`), the padding (and block-diagonal) mask of full layers,
        and for sliding layers what their attention function reads: `banded_attention`'s layout of the band, one band
        mask per sequence on the per-sequence path, else the band as a mask (dense, or flex's block-sparse one)."""
        packing, layer_types = plan.packing, {plan.runs_as(layer.layer_type) for layer in self.layers}
        masks = dict.fromkeys(layer_types)
        sequences = None
        if plan.kind == "block_diagonal":
            sequences = packed_sequence_mask_function(packing.sequence_ids())
        if "full_attention" in layer_types and not plan.packed:
            masks["full_attention"] = create_bidirectional_mask(
                self.config, hidden_states, attention_mask, and_mask_function=sequences
            )
        if "sliding_attention" not in layer_types:
            return masks
        radius = plan.facts.sliding_window
        if plan.sliding == BANDED_ATTENTION:
            ids = None
            if packing is not None:
                ids = packing.packed_sequence_ids() if plan.packed else packing.sequence_ids()
            elif attention_mask is not None:
                ids = attention_mask.long() - 1  # one sequence a row; padding -1
            masks["sliding_attention"] = band_layout(radius, hidden_states.shape[1], ids, hidden_states.device)
        elif plan.sliding == PER_SEQUENCE:
            # in the compute dtype, the queries' (under autocast the hidden states stay float32)
            masks["sliding_attention"] = band_masks(packing.lengths, radius, plan.facts.dtype, hidden_states.device)
        elif not plan.packed:
            masks["sliding_attention"] = create_bidirectional_sliding_window_mask(
                self.config, hidden_states, attention_mask, and_mask_function=sequences
            )
        return masks

    def execution_plan(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        padding_free=None,
        **kwargs,
    ) -> ExecutionPlan:
        """Checks the inputs, then decides how a forward on them runs (`decide_plan`), with the packing it runs on:
        what `forward` does first, and the way to ask from Python which plan given inputs get. Logged at debug level.

        Flattened rows (`position_ids` that restart inside a row, or `cu_seq_lens_q/k`: what
        `DataCollatorWithFlattening` gives) always get a packing, so that no sequence attends to its neighbours.
        """
        inputs = (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        if padding_free is None:
            padding_free = self.config.padding_free
        if not isinstance(padding_free, bool):
            raise ValueError(f"`padding_free` must be True, False or None, got {padding_free!r}.")
        real = attention_mask.bool() if attention_mask is not None and attention_mask.dim() == 2 else None
        # a padded batch's lengths are read in the input checks' one host sync (rows that turn out flattened
        # never use them)
        counted = real if padding_free and "cu_seq_lens_q" not in kwargs else None
        lengths = self._check_inputs(*inputs, lengths_of=counted)
        shape = tuple(input_ids.shape if input_ids is not None else inputs_embeds.shape[:2])
        device = input_ids.device if input_ids is not None else inputs_embeds.device
        packing = flattened_rows(position_ids, real, shape, device, kwargs)
        if position_ids is None:
            self._check_sequence_length(shape[1] if packing is None else packing.max_length)
        kind = "whole" if packing is None else "flattened"
        if packing is None and real is not None:
            kind = "padded"  # without padding_free, or compiled (which cannot branch on values), nothing packs
            if lengths is not None:
                kind = "padded" if any(lengths) and min(lengths) < shape[1] else "whole"
        else:
            lengths = None
        longest = max(lengths) if lengths else packing.max_length if packing is not None else shape[1]
        facts = self.plan_facts(kind, device, padding_free, kwargs, longest)
        plan = decide_plan(dataclasses.replace(facts, padded_tokens=shape[0] * shape[1]))
        if plan.sliding is not None and attention_mask is not None and attention_mask.dim() == 4:
            raise ValueError(
                "A prepared 4-D `attention_mask` cannot carry the sliding layers' window: pass the 2-D padding mask."
            )
        if plan.packed and packing is None:
            packing = PackedSequences.from_attention_mask(real, lengths)
        if not torch.compiler.is_compiling():  # a logging call would break the compiled graph
            logger.debug("EncoderStack execution plan: %s through %s: %s", plan.kind, plan.attention, plan.reason)
        return dataclasses.replace(plan, packing=packing)

    def plan_facts(self, inputs: str, device: torch.device, padding_free: bool, kwargs, longest: int = 0) -> PlanFacts:
        """What the plan depends on, read here and nowhere else: the compute dtype is autocast's where autocast is on
        (`Trainer(bf16=True)` keeps float32 weights), else the weights'."""
        config = self.config
        autocast = torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)
        recording = any(
            kwargs.get(f"output_{name}", getattr(config, f"output_{name}", False))
            for name in ("hidden_states", "attentions")
        )
        return PlanFacts(
            inputs=inputs,
            backend=config._attn_implementation,
            device_type=device.type,
            capability=cuda_capability(device),
            dtype=torch.get_autocast_dtype(device.type) if autocast else self.dtype,
            head_dim=config.hidden_size // config.num_attention_heads,
            attention_dropout=self.training and config.attention_probs_dropout_prob > 0,
            padding_free=padding_free,
            recording=bool(recording),
            compiling=torch.compiler.is_compiling(),
            varlen_kernel=varlen_attn is not None,
            sliding_window=config.sliding_window if "sliding_attention" in (config.layer_types or ()) else None,
            longest=longest,
            varlen_window=VARLEN_TAKES_WINDOW,
            flash_window=FLASH_TAKES_WINDOW,
        )

    def _check_sequence_length(self, longest: int) -> None:
        """The positions the model numbers itself must exist: each sequence's, not the length of a flattened row."""
        limit, offset = self.config.max_position_embeddings, self.config.position_offset or 0
        if self.config.position_embedding_type == "absolute" and longest + offset > limit:
            raise ValueError(
                f"Sequence length {longest} exceeds the {limit - offset} learned positions "
                f"(`max_position_embeddings` {limit}" + (f", counted from {offset})." if offset else ").")
            )

    def _check_inputs(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, lengths_of=None):
        """Turn the mistakes that would otherwise surface as an index error deep in a kernel into a clear message.
        Given `lengths_of` (the padded batch's real tokens), also returns its row lengths, read in the same host sync
        as the checked values (None when compiling: compiled code cannot branch on values)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
        hidden = self.config.embedding_size or self.config.hidden_size
        if inputs_embeds is not None and (
            not inputs_embeds.is_floating_point() or inputs_embeds.shape[-1:] != (hidden,)
        ):
            raise ValueError(
                f"`inputs_embeds` must be floating point of shape (batch, sequence, {hidden}), got "
                f"{tuple(inputs_embeds.shape)} of {inputs_embeds.dtype}."
            )
        shape = tuple(input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1])
        if len(shape) != 2 or 0 in shape:
            raise ValueError(f"Expected inputs of shape (batch, sequence), neither of them 0, got {shape}.")
        for name, ids in (("input_ids", input_ids), ("token_type_ids", token_type_ids), ("position_ids", position_ids)):
            if ids is not None and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
                raise TypeError(f"`{name}` must hold integer ids, got {ids.dtype}.")
        for name, value in (
            ("attention_mask", attention_mask),
            ("token_type_ids", token_type_ids),
            ("position_ids", position_ids),
        ):
            if value is None:
                continue
            if name == "attention_mask" and value.dim() == 4:  # a prepared mask, passed on as transformers does
                fits = value.shape[0] in (1, shape[0]) and tuple(value.shape[2:]) == (shape[1], shape[1])
            else:
                fits = tuple(value.shape) == shape or (
                    name != "attention_mask"
                    and value.shape[-1:] == shape[1:]
                    and value.dim() <= 2
                    and value.numel() == shape[1]
                )
            if not fits:
                raise ValueError(f"`{name}` has shape {tuple(value.shape)}, but the inputs have shape {shape}.")
        limit, offset = self.config.max_position_embeddings, self.config.position_offset or 0
        if torch.compiler.is_compiling():
            return None
        ranges = [("input_ids", input_ids, 0, self.config.vocab_size)]
        if self.config.type_vocab_size:  # a model without token types ignores them, as its families' classes do
            ranges.append(("token_type_ids", token_type_ids, 0, self.config.type_vocab_size))
        if self.config.position_embedding_type == "absolute":
            # positions below the offset are rows a RoBERTa-style model never trained (padding's, or none)
            ranges.append(("position_ids", position_ids, offset, limit))
        ranges = [(name, ids, *bounds) for name, ids, *bounds in ranges if ids is not None and ids.numel()]
        bounds = [torch.stack((ids.min(), ids.max())).long() for _, ids, _, _ in ranges]
        mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        if mask is not None:  # its values other than 0 and 1, counted, and read in the same sync as the ranges
            not_binary = ((mask != 0) & (mask != 1)).sum()
            bounds.append(torch.stack((not_binary, torch.zeros_like(not_binary))))
        if lengths_of is not None:
            bounds.append(lengths_of.sum(-1))
        if not bounds:
            return None
        device = bounds[0].device
        values = torch.cat([b.to(device, torch.long) for b in bounds]).tolist()  # one host sync for all of them
        read = [values[i : i + 2] for i in range(0, 2 * len(ranges) + 2 * (mask is not None), 2)]
        lengths = values[len(values) - lengths_of.shape[0] :] if lengths_of is not None else None
        if mask is not None and read[-1][0]:
            raise ValueError(
                f"`attention_mask` must hold 1 for real tokens and 0 for padding, got values "
                f"{sorted(set(mask.unique().tolist()))}."
            )
        for (name, _, first, size), (low, high) in zip(ranges, read):
            if low < first or high >= size:
                raise ValueError(f"`{name}` must lie in [{first}, {size - 1}], got values from {low} to {high}.")
        return lengths


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


def cross_entropy(logits, labels, num_items_in_batch=None, ignore_index=-100, known_range=None):
    """Mean cross-entropy over the labels that are not `ignore_index`, after checking their range: one host sync, or
    none where the caller read the counted labels' `known_range` (lowest, highest) already."""
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
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


@dataclass
class Encoded:
    """The encoder's outputs as a head sees them: with the packing it ran on, and the real tokens of a padded batch.

    One definition of the loss on every path: padded positions never enter it (labels there count for nothing, span
    logits there are masked), whether the batch ran padding-free, padded, compiled or recorded its hidden states.
    """

    outputs: BaseModelOutputWithPooling
    packing: PackedSequences | None
    real: torch.Tensor | None  # (batch, seq) bool; None when every token is real

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
        loss = cross_entropy(logits, labels, num_items_in_batch) if labels is not None else None
        return (self.packing.unpack(logits) if gathered else logits), loss

    def labelled_only(self, head, labels, num_items_in_batch):
        """Sparse prediction: the head, its logits (one row per labelled token) and the loss on labelled tokens."""
        hidden_states = self.outputs.last_hidden_state
        labels = labels.to(hidden_states.device)
        if self.real is not None:
            labels = labels.masked_fill(~self.real.to(labels.device), -100)
        labels = labels.reshape(-1)
        counts = labels != -100
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise TypeError(f"Class labels must be integers, got {labels.dtype}.")
        # one host sync: the number of labelled tokens, with their range for `cross_entropy`'s check
        known = labels.where(counts, 0)
        count, low, high = torch.stack((counts.sum(), known.min(), known.max())).tolist()
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
        self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, padding_free=None, **kwargs
    ) -> Encoded:
        """The encoder's outputs, and the packing it ran on for the token-level heads (planned once, here)."""
        kwargs.pop("num_items_in_batch", None)
        inputs = (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        plan = self.model.execution_plan(*inputs, padding_free=padding_free, **kwargs)
        outputs = self.model(*inputs, plan=plan, return_dict=True, **kwargs)
        real = attention_mask.bool() if attention_mask is not None and attention_mask.dim() == 2 else None
        return Encoded(outputs, plan.packing, real)

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
        encoded = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
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


class EncoderStackForPreTraining(EncoderStackHead):
    """Masked LM + next-sentence prediction, as BERT was pre-trained.

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
        self.next_sentence = nn.Linear(config.hidden_size, 2)
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
        encoded = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        mlm_labels = labels if next_sentence_label is not None else None
        sparse = self.training and self.config.sparse_prediction
        prediction_logits, loss = encoded.per_token(self.lm_head, mlm_labels, sparse=sparse)
        seq_relationship_logits = self.next_sentence(encoded.outputs.pooler_output)
        if loss is not None:
            check_shape("next_sentence_label", next_sentence_label, seq_relationship_logits.shape[:1], "the sequences")
            loss = loss + cross_entropy(seq_relationship_logits, next_sentence_label)
        return EncoderStackForPreTrainingOutput(
            loss=loss,
            prediction_logits=prediction_logits,
            seq_relationship_logits=seq_relationship_logits,
            **encoded.recorded,
        )


class EncoderStackForSequenceClassification(EncoderStackClassifierHead):
    """Classification or regression on the pooled first token; the loss follows `config.problem_type` as in BERT."""

    uses_pooler = True
    head_part = "sequence"

    def predict(self, encoded: Encoded, labels, num_items) -> SequenceClassifierOutput:
        logits = self.sequence_logits(encoded)
        loss = self.sequence_loss(logits, labels, num_items) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits, **encoded.recorded)

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
            check_shape("labels", labels.reshape(-1), logits.shape[:1], "the sequences")
            return cross_entropy(logits, labels, num_items)
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
        encoded = self.encode(*flat, **kwargs)
        if encoded.packing is not None and encoded.packing.flattened:
            raise ValueError(
                "Multiple choice scores whole rows: flattened sequences (`position_ids` that restart, or "
                "`cu_seq_lens_q`) are not supported; pass padded (batch, num_choices, sequence) inputs."
            )
        logits = self.sequence_logits(encoded).view(-1, num_choices)
        if labels is not None:
            check_shape("labels", labels, (batch_size,), "the questions")
        loss = cross_entropy(logits, labels, num_items) if labels is not None else None
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
