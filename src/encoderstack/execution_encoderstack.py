"""How an EncoderStack forward runs: everything `modeling_encoderstack.py` needs to execute a forward but not to read
it. `PackedSequences` (the one description of packed tokens), the input checks, `ExecutionPlan` (the one decision of
how a forward runs, `decide_plan`, with the facts it reads and the masks its kind needs) and the attention functions it
names, registered with transformers' `AttentionInterface`.

Travels with every checkpoint next to the model files (imports torch, transformers and `.configuration_encoderstack`
only): `save_pretrained` copies it, as the modeling file's relative import, for `trust_remote_code=True`.
"""

import dataclasses
import functools
import inspect
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_bidirectional_sliding_window_mask,
    packed_sequence_mask_function,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.generic import is_flash_attention_requested

from .configuration_encoderstack import EncoderStackConfig

ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
onednn_linear = torch.ops.mkldnn._linear_pointwise if ONEDNN_LINEAR else None
# bf16 where the CPU computes it natively (AVX-512 BF16, AMX); elsewhere oneDNN would emulate it
ONEDNN_DTYPES = (
    (torch.float32, torch.bfloat16)
    if ONEDNN_LINEAR and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    else (torch.float32,)
)
BF16_GEMMS = torch.bfloat16 in ONEDNN_DTYPES


class OneDNNLinear(torch.autograd.Function):
    """A linear whose three GEMMs (output, input gradient, weight gradient) all run in oneDNN."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_linear(x, weight, bias, "none", [], "")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rows, inputs = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_linear(rows, weight.t(), None, "none", [], "").reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_weight = onednn_linear(rows.t(), inputs.t(), None, "none", [], "")
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias


# activations oneDNN runs in its GEMM's epilogue, by the same name ("gelu": exact, erf), and torch's own of each
FUSED_ACTIVATIONS = {"gelu": nn.functional.gelu}


def linear(x, weight, bias, activation: str | None = None, kernels: str = "torch") -> torch.Tensor:
    """`F.linear` (then `activation`, a `FUSED_ACTIVATIONS` name), through oneDNN on the CPU: in bf16 where the CPU
    has it, in float32 where `kernels` (`config.cpu_kernels`) is not "torch". torch's float32 CPU linear is MKL's
    GEMM: 107 GFLOP/s on one AMD EPYC core (AVX-512) against oneDNN's 240 (docs/performance.md), but it is what the
    reference classes run, so float32 keeps it by default. In inference the activation runs in the GEMM's epilogue
    (exact GELU: the same numbers, one pass over the FFN's widest tensor less), and with "onednn-prepacked" the GEMM
    reads the weight in oneDNN's own layout (`prepacked`). Autocast, compilers and exporters keep `F.linear`: the op
    has no autocast rule, no meta kernel for tracing, no ONNX symbol."""
    if (
        ONEDNN_LINEAR
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.dtype in ONEDNN_DTYPES
        and (kernels != "torch" or x.dtype != torch.float32)
        and not torch.is_autocast_enabled("cpu")
        and not (torch.compiler.is_compiling() or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export())
    ):
        if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))):
            weight = prepacked(weight) if kernels == "onednn-prepacked" else weight
            return onednn_linear(x, weight, bias, activation or "none", [], "none")
        output = OneDNNLinear.apply(x, weight, bias)
    else:
        output = nn.functional.linear(x, weight, bias)
    return FUSED_ACTIVATIONS[activation](output) if activation else output


# weight -> (a weak reference to its storage, what it was when packed, the weight in oneDNN's layout): see `prepacked`
prepacked_weights = WeakIdKeyDictionary()


def prepacked(weight: torch.Tensor) -> torch.Tensor:
    """`weight` reordered into the blocked layout oneDNN's GEMM computes from, made on first use and kept while the
    weight is unchanged: the same storage (alive, so its address is not another's), place, shape, dtype and no
    in-place write since (an optimizer step, `load_state_dict`). From a plain weight oneDNN repacks blocks on every
    call: prepacked, all-MiniLM-L6-v2's projections ran 1.09-1.22x faster in bf16 and 1.07-1.15x in float32, with
    the same numbers (`benchmarks/prepacked.py`, docs/performance.md). The cost is a second copy of every weight."""
    storage, fingerprint, packed = prepacked_weights.get(weight, (None, None, None))
    now = (weight.data_ptr(), weight.shape, weight.stride(), weight.dtype, weight._version)
    holding = weight.untyped_storage()
    if storage is None or storage.expired() or storage.cdata != holding._cdata or fingerprint != now:
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor, whatever mode this forward runs in
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        prepacked_weights[weight] = StorageWeakRef(holding), now, packed
    return packed


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`mask` (transformers' boolean mask, True attends, or an additive one) as an additive mask in `dtype`, every
    dimension it only broadcasts (stride 0) narrowed to one: a padding mask stays (batch, 1, 1, keys)."""
    mask = mask[tuple(slice(0, 1) if not step else slice(None) for step in mask.stride())]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


# torch's bf16 softmax takes a slow path on rows whose length is not a multiple of 32 (3.5x slower on 80 keys than on
# 96): `gemm_attention` pads the keys to one. Below GEMM_MIN_KEYS keys SDPA's one call beats three oneDNN calls (1.9x
# faster on 32 keys, 0.9x on 64). GEMM_SCORES_BYTES: the scores of one GEMM, as many batch rows as fit (a row of 128
# tokens: rows of 8-16 are 1.3x faster than one row a GEMM, of 512: one row is fastest). All measured on
# all-MiniLM-L6-v2's shapes, 2 threads, AVX-512 BF16 (docs/performance.md).
GEMM_KEYS_MULTIPLE, GEMM_MIN_KEYS, GEMM_SCORES_BYTES = 32, 64, 4 << 20


def gemm_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
    """Attention as two batched GEMMs around a softmax, a few batch rows at a time, in the inputs' dtype: the plan's
    kernel for bf16 on CPUs with native bf16 GEMMs (see `attention_kernel`), where torch's SDPA kernel runs bf16
    through float32 GEMMs; this is 1.7-1.9x faster per layer. The scaling runs inside the first GEMM and the mask is
    added in its epilogue (`baddbmm`), so each score is rounded to bf16 once, as eager attention rounds it (SDPA keeps
    float32 scores). In inference the scores live in one buffer, reused (fresh multi-MB tensors cost page faults:
    8x512 ran 1.4x slower); where autograd records, every step makes its own tensor."""
    if key.shape[2] < GEMM_MIN_KEYS:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, is_causal=False
        )
    lowest = torch.finfo(query.dtype).min
    mask = query.new_zeros(()) if attention_mask is None else additive_mask(attention_mask, query.dtype)
    padding = -key.shape[2] % GEMM_KEYS_MULTIPLE
    if padding:  # zero keys and values, masked out
        key, value = (nn.functional.pad(x, (0, 0, 0, padding)) for x in (key, value))
        mask = nn.functional.pad(mask.expand(*mask.shape[:-1], key.shape[2] - padding), (0, padding), value=lowest)
    batch, heads, length, _ = query.shape
    rows = min(batch, max(1, GEMM_SCORES_BYTES // (heads * length * key.shape[2] * query.element_size())))
    shared = mask.dim() < 4 or mask.shape[0] * mask.shape[1] == 1  # one mask for every row and head: broadcast
    if mask.dim() == 4:
        mask = mask[0] if shared else mask.expand(batch, heads, *mask.shape[2:])
    # (batch x heads, tokens, dim): a copy unless the batch is one row
    query, key, value = (x.flatten(0, 1) for x in (query, key, value))
    context = query.new_empty(batch, length, heads, value.shape[-1])
    scores = None if torch.is_grad_enabled() else query.new_empty(rows * heads, length, key.shape[1])
    for start in range(0, batch, rows):
        block = slice(start * heads, min(start + rows, batch) * heads)
        out = None if scores is None else scores[: block.stop - block.start]
        bias = mask if shared else mask[start : start + rows].flatten(0, 1)  # a copy of these rows' mask
        beta = 1 if bias.dim() else 0  # a 0-d bias is no mask: not adding it made the GEMM 1.2x faster on 512 keys
        weights = torch.baddbmm(bias, query[block], key[block].transpose(1, 2), beta=beta, alpha=scaling, out=out)
        weights = torch.softmax(weights, dim=-1, out=out)
        weights = nn.functional.dropout(weights, p=dropout) if dropout else weights
        context[start : start + rows] = torch.bmm(weights, value[block]).unflatten(0, (-1, heads)).transpose(1, 2)
    return context, None


# TorchScript's oneDNN Graph fuser compiles softmax(q k^T * scaling + mask) v into oneDNN's fused attention kernel
# (the kind OpenVINO's CPU plugin runs): torch's only route to it. TorchScript is deprecated; where a torch has dropped
# the fuser, ONEDNN_GRAPH is False and the plan keeps the kernels above. A graph is compiled per shape (8-50 ms) and
# holds ~2 MB: one per length would hold ~0.9 GB for the lengths 65-512, so lengths are padded to
# FUSED_LENGTH_MULTIPLE (the padded keys masked) and FUSED_GRAPHS_KEPT bound what is kept. The padding costs short
# sequences what they gain: one sequence of 12 heads of 32 ran 0.84-0.87x SDPA on 80 tokens (padded to 96),
# 1.09-1.11x on 112 (padded to 128), 1.4x on 96 and 1.7-1.85x on 128 (no padding), 0.93-1.15x on 64
# (docs/benchmarks/cpu-attention-layer-2threads.txt). Hence FUSED_MIN_KEYS, and FUSED_MIN_PADDED_KEYS where the
# length needs padding.
ONEDNN_GRAPH = ONEDNN_LINEAR and hasattr(torch.jit, "enable_onednn_fusion")
FUSED_MIN_KEYS, FUSED_MIN_PADDED_KEYS, FUSED_LENGTH_MULTIPLE, FUSED_GRAPHS_KEPT = 64, 96, 32, 64


class ScaledDotProduct(nn.Module):
    """softmax(q k^T * scaling + mask) v, written as the pattern oneDNN Graph fuses."""

    def __init__(self, scaling: float):
        super().__init__()
        self.scaling = scaling

    def forward(self, query, key, value, *mask):
        scores = torch.matmul(query, key.transpose(-1, -2)) * self.scaling
        if mask:
            scores = scores + mask[0]
        return torch.matmul(torch.softmax(scores, dim=-1), value)


fused_graphs: OrderedDict = OrderedDict()  # (scaling, each input's shape, strides and dtype) -> graph or None
compile_lock = threading.Lock()  # the fuser's switch is global: one graph compiles at a time


def fused_graph(inputs: tuple, scaling: float):
    """The compiled `ScaledDotProduct` for inputs of these shapes, strides and dtypes (the fuser specializes on all
    three), compiled on first use; None where oneDNN Graph fused nothing (TorchScript's unfused graph would run, slower
    than SDPA)."""
    key = (scaling, *((x.shape, x.stride(), x.dtype) for x in inputs))
    if key not in fused_graphs:
        with compile_lock:
            if key not in fused_graphs:
                fused_graphs[key] = compile_fused_graph(inputs, scaling)
                if len(fused_graphs) > FUSED_GRAPHS_KEPT:
                    fused_graphs.popitem(last=False)
    fused_graphs.move_to_end(key)
    return fused_graphs[key]


def compile_fused_graph(inputs: tuple, scaling: float):
    """`ScaledDotProduct` traced, frozen and run until TorchScript has optimized it; None if nothing fused."""
    enabled = torch.jit.onednn_fusion_enabled()
    torch.jit.enable_onednn_fusion(True)  # on only while this graph is traced and optimized
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript's; see ONEDNN_GRAPH
            graph = torch.jit.freeze(torch.jit.trace(ScaledDotProduct(scaling).eval(), inputs, check_trace=False))
        for _ in range(3):  # a profiling run, then the optimized graph
            graph(*inputs)
            if "prim::oneDNNFusionGroup" in str(torch.jit.last_executed_optimized_graph()):
                return graph
        return None
    finally:
        torch.jit.enable_onednn_fusion(enabled)


def fused_mask(mask: torch.Tensor | None, length: int, padding: int, dtype: torch.dtype) -> torch.Tensor:
    """`mask` (see `additive_mask`; None: nothing masked) as a dense additive mask in `dtype` over `padding` more keys,
    which it masks, and as many more queries (rows that are dropped)."""
    if mask is None:
        return key_padding_mask(length, padding, dtype)
    mask = additive_mask(mask, dtype)
    if padding:
        mask = nn.functional.pad(mask, (0, padding), value=torch.finfo(dtype).min)
        if mask.shape[-2] > 1:  # one row per query
            mask = nn.functional.pad(mask, (0, 0, 0, padding))
    return mask.contiguous()


@functools.lru_cache(maxsize=FUSED_GRAPHS_KEPT)
def key_padding_mask(length: int, padding: int, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, 1, length + padding): the padded keys masked; one per padded length, not one per layer and sequence."""
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, whatever mode the first forward ran in
        return nn.functional.pad(torch.zeros(1, 1, 1, length, dtype=dtype), (0, padding), value=torch.finfo(dtype).min)


def unambiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` with each size-one dimension's stride set to the tensor's span. oneDNN Graph gave wrong numbers for a layout
    in which a size-one dimension's stride equalled another dimension's (a packed sequence of 9 tokens, 4 heads of 8:
    batch stride 32 = token stride), and reused that kernel for the shape whatever the size-one strides were after."""
    span = 1 + sum((size - 1) * step for size, step in zip(x.shape, x.stride()))
    return x.as_strided(x.shape, [span if size == 1 else step for size, step in zip(x.shape, x.stride())])


def fused_runs(query, key, value, attention_mask, dropout) -> bool:
    """Whether oneDNN Graph's kernel can compute this call: on the CPU, nothing for autograd to record (the graph has
    no backward), no dropout, no tracer or compiler."""
    return not (
        dropout
        or query.device.type != "cpu"
        or (
            torch.is_grad_enabled()
            and any(x.requires_grad for x in (query, key, value, attention_mask) if x is not None)
        )
        or torch.jit.is_tracing()
        or torch.compiler.is_compiling()
    )


def fused_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention as one oneDNN Graph kernel (see `ONEDNN_GRAPH`), in inference: per layer 1.7-2.0x SDPA in float32 and
    1.3-1.5x `gemm_attention` in bf16 on all-MiniLM-L6-v2's shapes, with `gemm_attention`'s numbers in bf16 (each score
    rounded to bf16 once). The plan's kernel where nothing is recorded for autograd (`attention_kernel`). Where autograd
    records, with dropout, on short sequences (FUSED_MIN_KEYS), under a tracer and where nothing fused, the kernel the
    plan would name without it runs: `gemm_attention` in bf16 on a CPU with native bf16 GEMMs (a padded batch of 95
    tokens: 1.26x SDPA), else SDPA."""
    scaling, length = query.shape[-1] ** -0.5 if scaling is None else scaling, key.shape[2]
    padding = -length % FUSED_LENGTH_MULTIPLE
    if length >= (FUSED_MIN_PADDED_KEYS if padding else FUSED_MIN_KEYS) and fused_runs(
        query, key, value, attention_mask, dropout
    ):
        inputs = (query, key, value)
        if padding:
            inputs = tuple(nn.functional.pad(x, (0, 0, 0, padding)) for x in inputs)
        if padding or attention_mask is not None:
            inputs += (fused_mask(attention_mask, length, padding, query.dtype),)
        inputs = tuple(unambiguous(x) for x in inputs)
        with torch.autocast("cpu", enabled=False):  # the projections gave bf16 already; TorchScript traces no autocast
            graph = fused_graph(inputs, scaling)
            if graph is not None:
                return graph(*inputs)[:, :, :length].transpose(1, 2), None
    if query.dtype == torch.bfloat16 and BF16_GEMMS and not (torch.jit.is_tracing() or torch.compiler.is_compiling()):
        return gemm_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout)
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, is_causal=False
    )


# FUSED_GROUPS = False: one `fused_attention` call per sequence, as before `grouped_fused_attention`. Groups hold at
# most FUSED_GROUP_MOST sequences: five counts (1 to 16) by 16 padded lengths up to 512 tokens, at most 80 shapes per
# dtype, of which FUSED_GRAPHS_KEPT stay compiled
FUSED_GROUPS, FUSED_GROUP_MOST = True, 16


@functools.lru_cache(maxsize=8)
def fused_groups(
    lengths: tuple[int, ...], dtype: torch.dtype, smallest: int
) -> list[tuple[list, torch.Tensor | None, ...]]:
    """Packed sequences as `grouped_fused_attention` runs them: grouped by their length padded to
    FUSED_LENGTH_MULTIPLE, each group cut into power-of-two counts up to FUSED_GROUP_MOST, so that a graph serves a
    count and a padded length whatever the batch; padded to fewer than `smallest` keys (FUSED_MIN_KEYS), one sequence
    a group. Per group: its sequences' (start, length) in the packed row, and for two or more the index that gathers
    their tokens padded (with each sequence's first token: a masked key, a dropped query) and the additive mask of the
    padded keys, (count, 1, 1, padded length). Built once per forward: the layers share it."""
    by_padded, start = {}, 0
    for length in lengths:
        if length:  # an empty sequence (a caller's cu_seq_lens may hold one) attends to nothing
            by_padded.setdefault(length + -length % FUSED_LENGTH_MULTIPLE, []).append((start, length))
        start += length
    groups, lowest = [], torch.finfo(dtype).min
    with torch.inference_mode(False), torch.no_grad():  # plain tensors, whatever mode the first forward ran in
        for padded, members in sorted(by_padded.items()):
            while members:
                count = min(1 << (len(members).bit_length() - 1), FUSED_GROUP_MOST) if padded >= smallest else 1
                chunk, members = members[:count], members[count:]
                if count == 1:
                    groups.append((chunk, None, None))
                    continue
                rows = [[*range(start, start + length), *[start] * (padded - length)] for start, length in chunk]
                masked = [[0.0] * length + [lowest] * (padded - length) for _, length in chunk]
                groups.append((chunk, torch.tensor(rows).flatten(), torch.tensor(masked, dtype=dtype)[:, None, None]))
    return groups


def grouped_fused_attention(module, query, key, value, sequence_lengths, scaling=None):
    """`per_sequence_attention` in `fused_attention`'s kernel, the sequences of one padded length in one call
    (`fused_groups`): a call per sequence costs more than its kernel (all-MiniLM-L6-v2, lengths uniform in 16-128:
    forwards 1.08x faster in bf16, 1.09x in float32; docs/performance.md). Sequences padded to fewer than
    FUSED_MIN_KEYS keys, and a sequence alone, go to `fused_attention` one by one, which keeps its thresholds: grouped,
    text's short sequences (mostly 7-23 tokens, padded to 32) ran 0.93-1.02x in bf16 and 0.95x in float32."""
    scaling, heads, dim = query.shape[-1] ** -0.5 if scaling is None else scaling, query.shape[1], query.shape[-1]
    tokens = [x[0].transpose(0, 1) for x in (query, key, value)]  # (tokens, heads, dim)
    context = query.new_empty(query.shape[2], heads, dim)

    def one_by_one(members):
        for start, length in members:
            pieces = (x[:, :, start : start + length] for x in (query, key, value))
            context[start : start + length] = fused_attention(module, *pieces, None, scaling=scaling)[0][0]

    for members, index, mask in fused_groups(tuple(sequence_lengths), query.dtype, FUSED_MIN_KEYS):
        graph = None
        if index is not None:
            count, padded = mask.shape[0], mask.shape[-1]
            inputs = [x.index_select(0, index).view(count, padded, heads, dim).transpose(1, 2) for x in tokens]
            inputs = tuple(unambiguous(x) for x in (*inputs, mask))
            with torch.autocast("cpu", enabled=False):
                graph = fused_graph(inputs, scaling)
                out = graph(*inputs) if graph is not None else None
        if graph is None:
            one_by_one(members)
            continue
        for row, (start, length) in enumerate(members):
            context[start : start + length] = out[row, :, :length].transpose(0, 1)
    return context.unsqueeze(0), None


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
    """Everything the execution plan depends on, read once per forward (see `plan_facts`)."""

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
    relative_attention: str | None = None  # config.relative_attention: a term added to the scores; None: none
    bf16_gemms: bool = False  # oneDNN runs bf16 GEMMs natively on this CPU (AVX-512 BF16, AMX)
    onednn_graph: bool = False  # this torch fuses attention with oneDNN Graph (ONEDNN_GRAPH)
    cpu_kernels: str = "torch"  # config.cpu_kernels: the library of float32 on the CPU
    autograd: bool = False  # grad mode is on: autograd may record the forward


def transformers_window(radius: int) -> int:
    """The radius (keys seen on each side) as transformers' `sliding_window` kwarg, which counts the query too (flash's
    window is inclusive; ModernBERT passes it so). The attention functions read it back with `window_radius`."""
    return radius + 1


def window_radius(sliding_window: int | None) -> int | None:
    """transformers' `sliding_window` kwarg as the radius (see `transformers_window`)."""
    return None if sliding_window is None else sliding_window - 1


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
    labels: tuple[int, int, int] | None = None  # the labels counted (not -100, at real tokens), lowest, highest

    @property
    def kernel(self) -> str:
        """The function that computes attention on the rows or sequences this plan gives it (`attention_kernel`):
        `attention` itself on the padded and block-diagonal kinds; the per-sequence path runs it on each sequence."""
        return attention_kernel(self.facts)

    @property
    def packed(self) -> bool:
        """Whether the layers run on the packed row of real tokens (and attention reads `cu_seq_lens`)."""
        return self.kind in ("varlen", "per_sequence")

    def attended_length(self, hidden_states: torch.Tensor) -> int:
        """The longest stretch of tokens attention sees: the packed row's longest sequence, else the row."""
        return self.packing.max_length if self.packed else hidden_states.shape[1]

    def runs_as(self, layer_type: str) -> str:
        """The layer type a layer of `layer_type` runs as: a sliding layer whose window covers everything is full."""
        return "sliding_attention" if layer_type == "sliding_attention" and self.sliding else "full_attention"

    def layer_attention(self, layer_type: str) -> tuple[str, dict]:
        """The attention function a layer of `layer_type` calls, and what it adds to the call: the radius as
        transformers' `sliding_window` kwarg, radius + 1 (flash's window is inclusive; ModernBERT passes it so), and
        on the per-sequence path the kernel each sequence runs where it is not the configured backend."""
        name, extra = self.attention, {}
        if self.runs_as(layer_type) == "sliding_attention":
            name, extra = self.sliding, {"sliding_window": transformers_window(self.facts.sliding_window)}
        if name == PER_SEQUENCE and self.kernel != self.facts.backend:
            extra["sequence_attention"] = self.kernel
        return name, extra


def flash_missing(facts: PlanFacts) -> str | None:
    """Why no flash kernel (torch's `varlen_attn`, or its flash kernel called directly) can run here; None
    when one can."""
    checks = (
        (facts.relative_attention is None, f"the relative-position scores ({facts.relative_attention}) need a mask"),
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


def attention_kernel(facts: PlanFacts) -> str:
    """The function that computes attention for the configured backend, on whatever rows the plan gives it. For SDPA
    on the CPU, in a precision oneDNN runs natively (bf16 where the CPU has native bf16 GEMMs, float32 where
    `config.cpu_kernels` is not "torch"): `fused_attention` in inference (oneDNN Graph's kernel), `gemm_attention` in
    bf16 where autograd may record (torch's SDPA kernel runs bf16 through float32 GEMMs there), else the backend."""
    if facts.backend != "sdpa" or facts.device_type != "cpu" or facts.recording or facts.compiling:
        return facts.backend
    native = {torch.float32: facts.cpu_kernels != "torch", torch.bfloat16: facts.bf16_gemms}.get(facts.dtype, False)
    if native and facts.onednn_graph and not (facts.autograd or facts.attention_dropout):
        return FUSED_ATTENTION
    if facts.dtype == torch.bfloat16 and facts.bf16_gemms:
        return GEMM_ATTENTION
    return facts.backend


SCORE_TERM_BACKENDS = ("eager", "sdpa")  # the backends that add an additive float mask to the scores


def decide_plan(facts: PlanFacts) -> ExecutionPlan:
    """The one decision of how a forward runs: a pure function of `facts`, so that every cell can be tested anywhere.
    The kind and the full layers' attention first, then how the sliding layers run on that kind."""
    if facts.relative_attention is not None and facts.backend not in SCORE_TERM_BACKENDS:
        raise ValueError(
            f"relative_attention={facts.relative_attention!r} adds a term to the attention scores, which the "
            f"{facts.backend} backend cannot take: use one of {', '.join(SCORE_TERM_BACKENDS)}."
        )
    plan = decide_kind(facts)
    if plan.kernel in KERNEL_REASONS:
        plan = dataclasses.replace(plan, reason=f"{plan.reason}; {KERNEL_REASONS[plan.kernel]}")
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
    def plan(kind, reason, attention=attention_kernel(facts)):
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
    module,
    query,
    key,
    value,
    attention_mask,
    sequence_lengths=None,
    sliding_window=None,
    sequence_attention=None,
    **kwargs,
):
    """The plan's kernel (`sequence_attention`; the configured backend for a caller from outside this model) run on
    each packed sequence alone, without a mask: the CPU path, where it measured fastest (1.4-1.7x over one masked call
    on a re-padded view), and flattened rows where no varlen kernel runs. In a sliding layer `attention_mask` holds
    one band mask per sequence (`band_masks`, built once per forward; None where the window covers the sequence); a
    caller from outside this model passes only `sliding_window`."""
    kernel = sequence_attention or module.config._attn_implementation
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(kernel, eager_attention_forward)
    if sequence_lengths is None:  # called from outside this model: one host sync
        sequence_lengths = kwargs["cu_seq_lens_q"].diff().tolist()
    for name in VARLEN_KWARGS:
        kwargs.pop(name, None)
    grouped = FUSED_GROUPS and kernel == FUSED_ATTENTION and attention_mask is None and sliding_window is None
    if grouped and query.shape[0] == 1 and fused_runs(query, key, value, None, kwargs.get("dropout")):
        return grouped_fused_attention(module, query, key, value, sequence_lengths, kwargs.get("scaling"))
    bands = attention_mask
    if bands is None:
        radius = window_radius(sliding_window)
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
        options["window_size"] = (window_radius(sliding_window),) * 2
    context = varlen_attn(query, key, value, *(kwargs[name] for name in VARLEN_KWARGS), **options)
    return context.unsqueeze(0), None


def flash_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kw):
    """torch's flash kernel on the packed tokens (`aten._flash_attention_forward`, the kernel SDPA reaches): every
    sequence in one call per layer, with attention dropout inside the kernel. Its autograd formula hands the RNG
    state the forward returns to `_flash_attention_backward`, which replays the same dropout mask."""
    query, key, value = flash_layout(query, key, value)
    cu_seq_lens, longest = kw["cu_seq_lens_q"], kw["max_length_q"]
    radius = -1 if sliding_window is None else window_radius(sliding_window)  # -1: no window
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
    radius, length = window_radius(sliding_window), query.shape[2]
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
GEMM_ATTENTION, FUSED_ATTENTION = "encoderstack_gemm", "encoderstack_fused"
AttentionInterface.register(GEMM_ATTENTION, gemm_attention)
AttentionInterface.register(FUSED_ATTENTION, fused_attention)
AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
AttentionInterface.register(PER_SEQUENCE, per_sequence_attention)
AttentionInterface.register(FLASH_ATTENTION, flash_attention)
AttentionInterface.register(BANDED_ATTENTION, banded_attention)
# what the plan's reason adds where its kernel is not the backend
KERNEL_REASONS = {
    GEMM_ATTENTION: "bf16 on this CPU: attention as GEMMs",
    FUSED_ATTENTION: "attention fused by oneDNN Graph",
}


def execution_plan(
    config: EncoderStackConfig, inputs: tuple, padding_free, kwargs, dtype, training, labels=None
) -> ExecutionPlan:
    """Checks the inputs (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds), then decides how a
    forward on them runs (`decide_plan`), with the packing it runs on, for a model of `config` whose weights are in
    `dtype` (see `EncoderStackModel.execution_plan`). Integer `labels` are counted and their range read in the same
    host sync as the checks (`ExecutionPlan.labels`), so that the loss needs none of its own.

    Flattened rows (`position_ids` that restart inside a row, or `cu_seq_lens_q/k`: what
    `DataCollatorWithFlattening` gives) always get a packing, so that no sequence attends to its neighbours.
    """
    input_ids, attention_mask, _, position_ids, inputs_embeds = inputs
    if padding_free is None:
        padding_free = config.padding_free
    if not isinstance(padding_free, bool):
        raise ValueError(f"`padding_free` must be True, False or None, got {padding_free!r}.")
    real = attention_mask.bool() if attention_mask is not None and attention_mask.dim() == 2 else None
    # a padded batch's lengths are read in the input checks' one host sync (rows that turn out flattened
    # never use them)
    counted = real if padding_free and "cu_seq_lens_q" not in kwargs else None
    lengths, labels = check_inputs(config, *inputs, lengths_of=counted, labels=labels)
    shape = tuple(input_ids.shape if input_ids is not None else inputs_embeds.shape[:2])
    device = input_ids.device if input_ids is not None else inputs_embeds.device
    packing = flattened_rows(position_ids, real, shape, device, kwargs)
    if position_ids is None:
        check_sequence_length(config, shape[1] if packing is None else packing.max_length)
    kind = "whole" if packing is None else "flattened"
    if packing is None and real is not None:
        kind = "padded"  # without padding_free, or compiled (which cannot branch on values), nothing packs
        if lengths is not None:
            kind = "padded" if any(lengths) and min(lengths) < shape[1] else "whole"
    else:
        lengths = None
    longest = max(lengths) if lengths else packing.max_length if packing is not None else shape[1]
    facts = plan_facts(config, kind, device, padding_free, kwargs, longest, dtype, training)
    plan = decide_plan(dataclasses.replace(facts, padded_tokens=shape[0] * shape[1]))
    if plan.sliding is not None and attention_mask is not None and attention_mask.dim() == 4:
        raise ValueError(
            "A prepared 4-D `attention_mask` cannot carry the sliding layers' window: pass the 2-D padding mask."
        )
    if plan.packed and packing is None:
        packing = PackedSequences.from_attention_mask(real, lengths)
    return dataclasses.replace(plan, packing=packing, labels=labels)


def plan_facts(
    config: EncoderStackConfig, inputs: str, device: torch.device, padding_free: bool, kwargs, longest, dtype, training
) -> PlanFacts:
    """What the plan depends on, read here and nowhere else: the compute dtype is autocast's where autocast is on
    (`Trainer(bf16=True)` keeps float32 weights), else the weights' (`dtype`)."""
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
        dtype=torch.get_autocast_dtype(device.type) if autocast else dtype,
        head_dim=config.hidden_size // config.num_attention_heads,
        attention_dropout=training and config.attention_probs_dropout_prob > 0,
        padding_free=padding_free,
        recording=bool(recording),
        compiling=torch.compiler.is_compiling(),
        varlen_kernel=varlen_attn is not None,
        sliding_window=config.sliding_window if "sliding_attention" in (config.layer_types or ()) else None,
        longest=longest,
        varlen_window=VARLEN_TAKES_WINDOW,
        flash_window=FLASH_TAKES_WINDOW,
        relative_attention=config.relative_attention,
        bf16_gemms=BF16_GEMMS,
        onednn_graph=ONEDNN_GRAPH,
        cpu_kernels=config.cpu_kernels,
        autograd=torch.is_grad_enabled(),
    )


def attention_masks(
    config: EncoderStackConfig, plan: ExecutionPlan, layer_types, hidden_states, attention_mask, relative=None
) -> dict:
    """Each layer type's mask, built once and only for the types that run (`layer_types`: the model's layers'), as
    transformers' ModernBERT keeps them: none on packed rows (attention reads `cu_seq_lens`), the padding (and
    block-diagonal) mask of full layers, and for sliding layers what their attention function reads:
    `banded_attention`'s layout of the band, one band mask per sequence on the per-sequence path, else the band as a
    mask (dense, or flex's block-sparse one).

    `relative`: the model's relative-position term (`config.relative_attention`), called once here for the longest
    stretch of tokens attention sees, and added to the full layers' mask: the padded or block-diagonal mask of the
    rows, or one slice per sequence on the per-sequence path (the plan runs no kernel that cannot take it)."""
    packing, layer_types = plan.packing, {plan.runs_as(layer_type) for layer_type in layer_types}
    masks = dict.fromkeys(layer_types)
    sequences = None
    if plan.kind == "block_diagonal":
        sequences = packed_sequence_mask_function(packing.sequence_ids())
    if "full_attention" in layer_types and not plan.packed:
        masks["full_attention"] = create_bidirectional_mask(
            config, hidden_states, attention_mask, and_mask_function=sequences
        )
    if relative is not None:
        # every sequence's tokens stand side by side, so distances along the row are distances within a sequence
        scores = relative(plan.attended_length(hidden_states), plan.facts.dtype)
        if plan.packed:
            masks["full_attention"] = [scores[..., :length, :length] for length in packing.lengths]
        else:
            masks["full_attention"] = with_score_term(masks["full_attention"], scores)
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
            config, hidden_states, attention_mask, and_mask_function=sequences
        )
    return masks


def with_score_term(mask: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
    """An additive float mask: `scores` (1, heads, q, k) where `mask` (transformers' boolean or additive mask, or
    None: nothing masked) lets a key through, the dtype's most negative value where it masks it."""
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return scores + mask


def check_sequence_length(config: EncoderStackConfig, longest: int) -> None:
    """The positions the model numbers itself must exist: each sequence's, not the length of a flattened row."""
    limit, offset = config.max_position_embeddings, config.position_offset or 0
    if config.position_embedding_type == "absolute" and longest + offset > limit:
        raise ValueError(
            f"Sequence length {longest} exceeds the {limit - offset} learned positions "
            f"(`max_position_embeddings` {limit}" + (f", counted from {offset})." if offset else ").")
        )


def holds_integers(x: torch.Tensor) -> bool:
    """Whether `x` holds integer ids or class labels (not floats, complex numbers or booleans)."""
    return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


def counted_range(labels: torch.Tensor, counted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lowest and highest of the `counted` labels, as 0-d int64 tensors (no host sync)."""
    limits = torch.iinfo(labels.dtype)
    return labels.where(counted, limits.max).min().long(), labels.where(counted, limits.min).max().long()


def check_inputs(
    config: EncoderStackConfig,
    input_ids,
    attention_mask,
    token_type_ids,
    position_ids,
    inputs_embeds,
    lengths_of=None,
    labels=None,
):
    """Turn the mistakes that would otherwise surface as an index error deep in a kernel into a clear message.
    Returns what else it read in the same host sync as the checked values (None when compiling: compiled code cannot
    branch on values): the row lengths of `lengths_of` (the padded batch's real tokens), and of integer `labels` the
    count of those that are not -100 (at real tokens, for per-token labels), their lowest and their highest."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
    hidden = config.embedding_size or config.hidden_size
    if inputs_embeds is not None and (not inputs_embeds.is_floating_point() or inputs_embeds.shape[-1:] != (hidden,)):
        raise ValueError(
            f"`inputs_embeds` must be floating point of shape (batch, sequence, {hidden}), got "
            f"{tuple(inputs_embeds.shape)} of {inputs_embeds.dtype}."
        )
    shape = tuple(input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1])
    if len(shape) != 2 or 0 in shape:
        raise ValueError(f"Expected inputs of shape (batch, sequence), neither of them 0, got {shape}.")
    for name, ids in (("input_ids", input_ids), ("token_type_ids", token_type_ids), ("position_ids", position_ids)):
        if ids is not None and not holds_integers(ids):
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
    limit, offset = config.max_position_embeddings, config.position_offset or 0
    if torch.compiler.is_compiling():
        return None, None
    ranges = [("input_ids", input_ids, 0, config.vocab_size)]
    if config.type_vocab_size:  # a model without token types ignores them, as its families' classes do
        ranges.append(("token_type_ids", token_type_ids, 0, config.type_vocab_size))
    if config.position_embedding_type == "absolute":
        # positions below the offset are rows a RoBERTa-style model never trained (padding's, or none)
        ranges.append(("position_ids", position_ids, offset, limit))
    ranges = [(name, ids, *bounds) for name, ids, *bounds in ranges if ids is not None and ids.numel()]
    bounds = [torch.stack((ids.min(), ids.max())).long() for _, ids, _, _ in ranges]
    mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    if mask is not None:  # its values other than 0 and 1, counted, and read in the same sync as the ranges
        not_binary = ((mask != 0) & (mask != 1)).sum()
        # with a relative-position term: rows whose real tokens do not stand side by side (padding between them)
        runs = ((mask[:, 1:] != 0) & (mask[:, :-1] == 0)).sum(-1) + (mask[:, 0] != 0)
        gapped = (runs > 1).sum() if config.relative_attention is not None else torch.zeros_like(not_binary)
        bounds.append(torch.stack((not_binary, gapped)))
    read_labels = labels is not None and labels.numel() > 0 and holds_integers(labels)
    if read_labels:
        counted = labels != -100
        if mask is not None and tuple(labels.shape) == tuple(mask.shape):  # padding's labels count for nothing
            counted &= mask.to(labels.device).bool()
        bounds.append(torch.stack((counted.sum(), *counted_range(labels, counted))))
    if lengths_of is not None:
        bounds.append(lengths_of.sum(-1))
    if not bounds:
        return None, None
    device = bounds[0].device
    values = torch.cat([b.to(device, torch.long) for b in bounds]).tolist()  # one host sync for all of them
    checked = 2 * len(ranges) + 2 * (mask is not None)
    read = [values[i : i + 2] for i in range(0, checked, 2)]
    label_read = tuple(values[checked : checked + 3]) if read_labels else None
    lengths = values[len(values) - lengths_of.shape[0] :] if lengths_of is not None else None
    if mask is not None and read[-1][0]:
        raise ValueError(
            f"`attention_mask` must hold 1 for real tokens and 0 for padding, got values "
            f"{sorted(set(mask.unique().tolist()))}."
        )
    if mask is not None and read[-1][1]:
        raise ValueError(
            f"`attention_mask` has {read[-1][1]} row(s) with padding between real tokens: relative_attention="
            f"{config.relative_attention!r} counts distances within a sequence, so pad on one side only (or flatten)."
        )
    for (name, _, first, size), (low, high) in zip(ranges, read):
        if low < first or high >= size:
            raise ValueError(f"`{name}` must lie in [{first}, {size - 1}], got values from {low} to {high}.")
    return lengths, label_read
