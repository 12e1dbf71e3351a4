"""On the CPU, attention in a precision oneDNN runs natively (bf16 where the CPU has native bf16 GEMMs, float32 with
`cpu_kernels="onednn"`) runs in oneDNN's kernels: in inference as one fused oneDNN Graph kernel (`fused_attention`),
where autograd may record in bf16 as two oneDNN GEMMs around a softmax (`gemm_attention`). Each gives eager attention's
numbers (and gradients) for every mask the layers give it, each score rounded once, on the padded and the packed path
of every kind of layer; float32 by default and other CPUs keep the configured backend."""

import itertools
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import batch, build
from test_family_mechanisms import DEBERTA_LIKE, MPNET_LIKE
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from encoderstack import EncoderStackForMaskedLM, EncoderStackModel, execution_encoderstack
from encoderstack.execution_encoderstack import FUSED_ATTENTION, GEMM_ATTENTION, fused_attention, gemm_attention

ENCODER = SimpleNamespace(is_causal=False, training=False)  # what the kernels read of the calling module
HEADS, HEAD_DIM = 4, 8


def eager(query, key, value, mask):
    """Softmax attention in float64, the mask boolean (True attends) or additive; (batch, tokens, heads, dim)."""
    query, key, value = (x.double() for x in (query, key, value))
    scores = query @ key.transpose(-1, -2) * HEAD_DIM**-0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return (scores.softmax(-1) @ value).transpose(1, 2)


def qkv(rows, length, dtype, seed=0):
    """Queries, keys and values as a layer makes them: (rows, heads, length, dim) views of (rows, length, 3, heads,
    dim)."""
    generator = torch.Generator().manual_seed(seed)
    packed = torch.randn(rows, length, 3, HEADS, HEAD_DIM, generator=generator).to(dtype)
    return tuple(packed[:, :, i].transpose(1, 2) for i in range(3))


def mask_of(kind, rows, length, dtype):
    """Each mask the layers pass: transformers' boolean padding mask, MPNet's bias (one per head), DeBERTa's terms
    (per row and head), a band mask (shared), and an additive padding mask (per row)."""
    generator = torch.Generator().manual_seed(1)
    if kind == "none":
        return None
    if kind == "padding":
        lengths = torch.tensor([length, length // 2, 3])[:rows]
        return (torch.arange(length) < lengths[:, None])[:, None, None, :].expand(rows, 1, length, length)
    shapes = {"per head": (1, HEADS), "per row and head": (rows, HEADS), "shared": (1, 1), "per row": (rows, 1)}
    return torch.randn(*shapes[kind], length, length, generator=generator).to(dtype)


MASKS = ("none", "padding", "per head", "per row and head", "shared", "per row")
# below GEMM_MIN_KEYS (SDPA runs), keys padded to GEMM_KEYS_MULTIPLE, a multiple of it, padded again
LENGTHS = (17, 70, 96, 130)


@pytest.mark.parametrize("rows_per_gemm", [1, 2, None], ids=["one-row-a-gemm", "two-rows-a-gemm", "all-rows"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("length", LENGTHS)
def test_gemm_attention_gives_eager_attention_s_numbers_in_float32_for_every_mask(
    length, mask, rows_per_gemm, monkeypatch
):
    query, key, value = qkv(3, length, torch.float32)
    if rows_per_gemm:  # the scores of so many rows fill the budget
        monkeypatch.setattr(execution_encoderstack, "GEMM_SCORES_BYTES", rows_per_gemm * HEADS * length**2 * 4)
    attention_mask = mask_of(mask, 3, length, torch.float32)
    context, weights = gemm_attention(ENCODER, query, key, value, attention_mask, scaling=HEAD_DIM**-0.5)
    assert weights is None and context.shape == (3, length, HEADS, HEAD_DIM)
    torch.testing.assert_close(context.double(), eager(query, key, value, attention_mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("length", LENGTHS[1:])
def test_in_bf16_each_score_is_rounded_once_so_the_error_is_no_larger_than_eager_bf16_attention_s(length):
    """Eager attention in bf16 rounds the scores after the GEMM, again after the scaling and after the mask; the
    kernel once, after all three (in `baddbmm`'s epilogue)."""
    query, key, value = qkv(8, length, torch.bfloat16)
    mask = mask_of("per head", 8, length, torch.bfloat16)
    exact = eager(query, key, value, mask)
    fast = gemm_attention(ENCODER, query, key, value, mask, scaling=HEAD_DIM**-0.5)[0]
    rounded_thrice = execution_encoderstack.eager_attention_forward(
        ENCODER, query, key, value, mask, scaling=HEAD_DIM**-0.5
    )[0]
    error = {
        name: (out.double() - exact).abs().mean().item() for name, out in (("fast", fast), ("eager", rounded_thrice))
    }
    assert error["fast"] <= error["eager"], error


def recording(function, calls, entry):
    """`function`, appending `entry(*args)` to `calls` before each call."""

    def recorded(*args, **kwargs):
        calls.append(entry(*args))
        return function(*args, **kwargs)

    return recorded


@pytest.fixture
def kernel_calls(monkeypatch):
    """The kernel, rows and length of every `gemm_attention` and `fused_attention` call, as if the CPU had native bf16
    GEMMs (bf16 batched matmuls run everywhere, slowly where emulated) and on this file's short sequences too."""
    monkeypatch.setattr(execution_encoderstack, "BF16_GEMMS", True)
    monkeypatch.setattr(execution_encoderstack, "GEMM_MIN_KEYS", 1)
    monkeypatch.setattr(execution_encoderstack, "FUSED_MIN_KEYS", 1)
    monkeypatch.setattr(execution_encoderstack, "FUSED_MIN_PADDED_KEYS", 1)
    calls = []
    for name, kernel in ((GEMM_ATTENTION, gemm_attention), (FUSED_ATTENTION, fused_attention)):
        counted = recording(kernel, calls, lambda module, query, *_, name=name: (name, query.shape[0], query.shape[2]))
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, name, counted)
    grouped = execution_encoderstack.grouped_fused_attention  # the packed sequences of a layer, in one call

    def sequences(module, query, key, value, lengths, *_):
        return GROUPED, tuple(lengths)

    monkeypatch.setattr(execution_encoderstack, "grouped_fused_attention", recording(grouped, calls, sequences))
    return calls


GROUPED = "grouped_fused_attention"


def expected_calls(kernel, padding_free, model):
    """What `kernel_calls` holds after a forward of `batch()`: rows of 9, 5 and 7 real tokens padded to 9. Packed, the
    fused kernel takes a layer's sequences in one call where it adds nothing to the scores (no band mask, no relative
    term), else one at a time."""
    if not padding_free:
        return [(kernel, 3, 9)] * model.config.num_hidden_layers
    one_by_one = [(kernel, 1, 9), (kernel, 1, 5), (kernel, 1, 7)]
    if kernel != FUSED_ATTENTION:
        return one_by_one * model.config.num_hidden_layers
    plain = [layer.layer_type == "full_attention" and not model.config.relative_attention for layer in model.layers]
    return [call for grouped in plain for call in ([(GROUPED, (9, 5, 7))] if grouped else one_by_one)]


MODELS = {
    "post-LN": {},
    "grouped-query": {"num_key_value_heads": 2},
    "sliding window": {
        "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        "sliding_window": 2,
        "position_embedding_type": "rope",
    },
    "MPNet's relative bias": MPNET_LIKE,
    "DeBERTa's disentangled terms": DEBERTA_LIKE,
}


@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("config", MODELS.values(), ids=MODELS)
@pytest.mark.parametrize("kernel", [FUSED_ATTENTION, GEMM_ATTENTION], ids=["fused", "without oneDNN Graph: GEMMs"])
def test_bf16_inference_runs_every_layer_in_the_kernel_with_the_numbers_of_sdpa(
    kernel_calls, kernel, config, padding_free, monkeypatch
):
    monkeypatch.setattr(execution_encoderstack, "ONEDNN_GRAPH", kernel == FUSED_ATTENTION)
    model = build(EncoderStackModel, **config).to(torch.bfloat16)
    inputs = batch()
    with torch.no_grad():
        fast = model(**inputs, padding_free=padding_free).last_hidden_state
    assert kernel_calls == expected_calls(kernel, padding_free, model)
    monkeypatch.setattr(execution_encoderstack, "BF16_GEMMS", False)  # the plan keeps SDPA
    with torch.no_grad():
        sdpa = model(**inputs, padding_free=padding_free).last_hidden_state
    real = inputs["attention_mask"].bool()
    # bf16 keeps 8 bits: 2^-8 of hidden states of unit size, a few roundings apart
    torch.testing.assert_close(fast[real].float(), sdpa[real].float(), atol=3e-2, rtol=0)


@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("config", MODELS.values(), ids=MODELS)
def test_float32_inference_with_onednn_kernels_runs_every_layer_fused_with_the_numbers_of_sdpa(
    kernel_calls, config, padding_free
):
    model = build(EncoderStackModel, **config, cpu_kernels="onednn")
    inputs = batch()
    with torch.no_grad():
        fused = model(**inputs, padding_free=padding_free).last_hidden_state
        assert kernel_calls == expected_calls(FUSED_ATTENTION, padding_free, model)
        model.set_cpu_kernels("torch")
        reference = model(**inputs, padding_free=padding_free).last_hidden_state
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(fused[real], reference[real], atol=1e-5, rtol=0)


def test_float32_keeps_the_configured_backend_by_default_and_in_training_with_onednn_kernels(kernel_calls):
    model = build(EncoderStackModel)
    with torch.no_grad():
        model(**batch())
    model.train()(**batch())
    model.set_cpu_kernels("onednn")
    model(**batch())  # autograd records
    assert kernel_calls == []


@pytest.mark.parametrize("mask", ["none", "per head", "per row and head"])
def test_gradients_through_gemm_attention_are_eager_attention_s_in_float32(mask):
    """Where autograd records, every step makes its own tensor; gradients reach the queries, keys, values and an
    additive mask (DeBERTa's terms are computed from the queries and keys)."""
    query, key, value = (x.detach().requires_grad_() for x in qkv(3, 70, torch.float32))
    attention_mask = mask_of(mask, 3, 70, torch.float32)
    leaves = [query, key, value]
    if attention_mask is not None:
        leaves.append(attention_mask.requires_grad_())
    upstream = torch.randn(3, 70, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    grads = []
    for attention in (gemm_attention, lambda _, *args, **kw: (eager(*args[:4]).float(), None)):
        (attention(ENCODER, query, key, value, attention_mask, scaling=HEAD_DIM**-0.5)[0] * upstream).sum().backward()
        grads.append([leaf.grad.clone() for leaf in leaves])
        for leaf in leaves:
            leaf.grad = None
    for fast, exact in zip(*grads):
        torch.testing.assert_close(fast, exact, atol=1e-5, rtol=0)


@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
def test_a_bf16_autocast_training_step_through_the_gemms_gives_sdpa_s_loss_and_gradients(
    kernel_calls, padding_free, monkeypatch
):
    """Trainer(bf16=True) on the CPU: float32 weights under bf16 autocast."""
    model = build(EncoderStackForMaskedLM).train()
    inputs = batch()
    inputs["labels"] = inputs["input_ids"].masked_fill(~inputs["attention_mask"].bool(), -100)
    steps = []
    for native in (True, False):  # False: the plan keeps SDPA
        monkeypatch.setattr(execution_encoderstack, "BF16_GEMMS", native)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**inputs, padding_free=padding_free).loss
        loss.backward()
        steps.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
        model.zero_grad()
    assert kernel_calls == expected_calls(GEMM_ATTENTION, padding_free, model.model)
    (fast_loss, fast), (sdpa_loss, sdpa) = steps
    torch.testing.assert_close(fast_loss, sdpa_loss, atol=2e-2, rtol=0)
    for (
        name,
        grad,
    ) in sdpa.items():  # bfloat16 keeps 8 bits: 2% of the gradient's size (the key bias: ~0, exactly 0 in theory)
        assert (fast[name] - grad).norm() <= 0.02 * grad.norm() + 1e-6, name


def test_the_plan_names_the_kernels_only_where_the_cpu_has_native_bf16_gemms():
    model = build(EncoderStackModel).to(torch.bfloat16)
    with torch.no_grad():
        inference = model.execution_plan(**batch(), padding_free=False)
    training = model.execution_plan(**batch(), padding_free=False)  # grad mode on: autograd may record
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported() and execution_encoderstack.ONEDNN_LINEAR
    fused = native and execution_encoderstack.ONEDNN_GRAPH
    assert (inference.attention == FUSED_ATTENTION) == fused, inference.reason
    assert ("attention fused by oneDNN Graph" in inference.reason) == fused
    assert (training.attention == GEMM_ATTENTION) == native, training.reason
    assert ("attention as GEMMs" in training.reason) == native


@pytest.fixture
def fused_only(monkeypatch):
    """`fused_attention` on every length, and SDPA (its fallback) counted: the calls that fell back."""
    monkeypatch.setattr(execution_encoderstack, "FUSED_MIN_KEYS", 1)
    monkeypatch.setattr(execution_encoderstack, "FUSED_MIN_PADDED_KEYS", 1)
    fallbacks = []
    counted = recording(sdpa_attention_forward, fallbacks, lambda module, query, *_: query.shape)
    monkeypatch.setattr(execution_encoderstack, "sdpa_attention_forward", counted)
    return fallbacks


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("length", LENGTHS)
def test_fused_attention_gives_eager_attention_s_numbers_in_float32_for_every_mask(length, mask, fused_only):
    query, key, value = qkv(3, length, torch.float32)
    attention_mask = mask_of(mask, 3, length, torch.float32)
    with torch.no_grad():
        context, weights = fused_attention(ENCODER, query, key, value, attention_mask, scaling=HEAD_DIM**-0.5)
    assert fused_only == [] and weights is None and context.shape == (3, length, HEADS, HEAD_DIM)
    torch.testing.assert_close(context.double(), eager(query, key, value, attention_mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("length", LENGTHS[1:])
def test_fused_bf16_attention_s_error_is_no_larger_than_eager_bf16_attention_s(length, fused_only):
    query, key, value = qkv(8, length, torch.bfloat16)
    mask = mask_of("per head", 8, length, torch.bfloat16)
    with torch.no_grad():
        fast = fused_attention(ENCODER, query, key, value, mask, scaling=HEAD_DIM**-0.5)[0]
        rounded_thrice = execution_encoderstack.eager_attention_forward(
            ENCODER, query, key, value, mask, scaling=HEAD_DIM**-0.5
        )[0]
    exact = eager(query, key, value, mask)
    error = {
        name: (out.double() - exact).abs().mean().item() for name, out in (("fused", fast), ("eager", rounded_thrice))
    }
    assert fused_only == [] and error["fused"] <= error["eager"], error


def test_fused_attention_leaves_to_sdpa_what_it_cannot_compute_or_would_not_gain_on(fused_only, monkeypatch):
    """Autograd (the fused graph has no backward), dropout, and short sequences: under FUSED_MIN_KEYS keys, or under
    FUSED_MIN_PADDED_KEYS where the length needs padding to a multiple of 32 (SDPA is as fast or faster there)."""
    query, key, value = qkv(2, 70, torch.float32)
    training = SimpleNamespace(is_causal=False, training=True)
    fused_attention(training, query, key, value, None, scaling=1.0, dropout=0.1)
    leaf = query.detach().requires_grad_()
    fused_attention(ENCODER, leaf, key, value, None, scaling=1.0)[0].sum().backward()
    assert leaf.grad is not None
    monkeypatch.setattr(execution_encoderstack, "FUSED_MIN_KEYS", 65)
    monkeypatch.setattr(execution_encoderstack, "FUSED_MIN_PADDED_KEYS", 71)
    with torch.no_grad():
        fused_attention(ENCODER, query, key, value, None, scaling=1.0)  # 70: padded to 96, under 71
        fused_attention(ENCODER, *(x[:, :, :64] for x in (query, key, value)), None, scaling=1.0)  # 64: under 65
        fused_attention(ENCODER, *(x[:, :, :96] for x in qkv(2, 96, torch.float32)), None, scaling=1.0)  # fused
    assert fused_only == [query.shape] * 3 + [query[:, :, :64].shape]


@pytest.mark.parametrize("native", [True, False], ids=["native bf16 GEMMs", "no native bf16 GEMMs"])
def test_in_bf16_what_the_fused_kernel_leaves_runs_as_gemms_where_the_cpu_has_them(native, monkeypatch):
    monkeypatch.setattr(execution_encoderstack, "BF16_GEMMS", native)
    calls = []
    for name, kernel in (("gemm_attention", gemm_attention), ("sdpa_attention_forward", sdpa_attention_forward)):
        monkeypatch.setattr(execution_encoderstack, name, recording(kernel, calls, lambda *_, name=name: name))
    query, key, value = qkv(2, 70, torch.bfloat16)  # padded to 96, under FUSED_MIN_PADDED_KEYS
    with torch.no_grad():
        context = fused_attention(ENCODER, query, key, value, None, scaling=HEAD_DIM**-0.5)[0]
    assert calls[0] == ("gemm_attention" if native else "sdpa_attention_forward")
    torch.testing.assert_close(context.double(), eager(query, key, value, None), atol=3e-2, rtol=0)


def test_a_graph_compiles_once_per_32_tokens_of_length_serves_every_sequence_there_and_few_are_kept(
    fused_only, monkeypatch
):
    monkeypatch.setattr(execution_encoderstack, "fused_graphs", type(execution_encoderstack.fused_graphs)())
    monkeypatch.setattr(execution_encoderstack, "FUSED_GRAPHS_KEPT", 2)
    traced = []
    # each trace's padded length, and whether it is masked
    counted = recording(torch.jit.trace, traced, lambda module, inputs: (inputs[0].shape[2], len(inputs) == 4))
    monkeypatch.setattr(torch.jit, "trace", counted)
    query, key, value = qkv(1, 250, torch.float32)  # a packed row
    start = 0
    with torch.no_grad():
        for length in (30, 30, 10, 40, 64, 30):
            piece = slice(start, start + length)
            fused_attention(ENCODER, query[:, :, piece], key[:, :, piece], value[:, :, piece], None, scaling=1.0)
            start += length
    # 30 and 10 share the masked 32; 40 pads to 64 (masked), 64 needs no mask; keeping two, 30's was dropped
    assert traced == [(32, True), (64, True), (64, False), (32, True)]
    assert len(execution_encoderstack.fused_graphs) == 2 and fused_only == []


def layouts(rows, heads, length, dtype, generator):
    """Queries, keys and values in each layout attention meets: a layer's own ((rows, length, heads, dim) viewed as
    (rows, heads, length, dim)), contiguous, one of three projections in one tensor, a sequence of a packed row, and a
    one-row batch whose row stride equals its token stride (a layout oneDNN Graph misread)."""

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    dim = HEAD_DIM
    interleaved = draw(rows, length, 3, heads, dim)
    packed = [draw(1, 2 * length + 5, heads, dim).transpose(1, 2)[:, :, length + 3 : 2 * length + 3] for _ in range(3)]
    own = [draw(rows, length, heads, dim).transpose(1, 2) for _ in range(3)]
    return {
        "a layer's": own,
        "contiguous": [draw(rows, heads, length, dim) for _ in range(3)],
        "interleaved": [interleaved[:, :, i].transpose(1, 2) for i in range(3)],
        "packed": packed,
        "row stride = token stride": [
            x[:1].as_strided((1, heads, length, dim), (heads * dim, dim, heads * dim, 1)) for x in own
        ],
    }


def test_fused_attention_gives_eager_attention_s_numbers_for_every_layout_in_any_order(fused_only):
    """oneDNN Graph keeps the first kernel it compiles for a shape whatever the size-one strides of later inputs: one
    wrong layout first would make every later one wrong, so the cases run shuffled, in one process."""
    generator = torch.Generator().manual_seed(3)
    cases = []
    for dtype, rows, heads, length in itertools.product((torch.float32, torch.bfloat16), (1, 3), (1, 4), (9, 64)):
        for layout, (query, key, value) in layouts(rows, heads, length, dtype, generator).items():
            count = query.shape[0]
            masks = {
                "none": None,
                "per row": torch.randn(count, 1, 1, length, generator=generator).to(dtype),
                "per head": torch.randn(1, heads, length, length, generator=generator).to(dtype),
                "boolean": (torch.rand(count, 1, 1, length, generator=generator) > 0.3)
                .index_fill(-1, torch.tensor(0), True)
                .expand(count, 1, length, length),
            }
            cases += [(dtype, layout, query, key, value, mask) for mask in masks.values()]
    random.Random(0).shuffle(cases)
    for dtype, layout, query, key, value, mask in cases:
        exact = eager(query, key, value, mask)
        with torch.no_grad():
            context = fused_attention(ENCODER, query, key, value, mask, scaling=HEAD_DIM**-0.5)[0]
        # bf16: each probability rounded to 8 bits, then summed over up to 64 values of unit size
        tolerance = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(context.double(), exact, atol=tolerance, rtol=0, msg=f"{dtype}, {layout}")
    assert fused_only == []


@pytest.mark.parametrize("enabled", [False, True])
def test_compiling_leaves_torchscript_s_onednn_fusion_switch_as_it_was(enabled, fused_only, monkeypatch):
    monkeypatch.setattr(execution_encoderstack, "fused_graphs", type(execution_encoderstack.fused_graphs)())
    before = torch.jit.onednn_fusion_enabled()
    torch.jit.enable_onednn_fusion(enabled)
    try:
        with torch.no_grad():
            fused_attention(ENCODER, *qkv(1, 70, torch.float32), None, scaling=1.0)
        assert torch.jit.onednn_fusion_enabled() == enabled
    finally:
        torch.jit.enable_onednn_fusion(before)
    assert fused_only == []


def packed_row(lengths, dtype, seed=0):
    """Queries, keys and values of sequences packed in one row, as the per-sequence path holds them: (1, heads,
    tokens, dim) views of (1, tokens, heads, dim)."""
    generator = torch.Generator().manual_seed(seed)
    row = torch.randn(1, sum(lengths), 3, HEADS, HEAD_DIM, generator=generator).to(dtype)
    return tuple(row[:, :, i].transpose(1, 2) for i in range(3))


def each_sequence_eager(query, key, value, lengths):
    pieces = zip(*(x.split(lengths, dim=2) for x in (query, key, value)))
    return torch.cat([eager(q, k, v, None) for q, k, v in pieces], dim=1)


# padded to 32: seven sequences (4 + 2 + 1), to 64: five (4 + 1; two exact), to 96: two; and an empty one
GROUPED_LENGTHS = (40, 3, 64, 9, 33, 70, 32, 0, 50, 17, 20, 64, 30, 90, 1)


def test_fused_groups_cut_each_padded_length_into_power_of_two_counts_each_sequence_once():
    groups = execution_encoderstack.fused_groups(GROUPED_LENGTHS, torch.float32, 32)
    starts = [sum(GROUPED_LENGTHS[:i]) for i in range(len(GROUPED_LENGTHS))]
    members = sorted(member for chunk, _, _ in groups for member in chunk)
    assert members == sorted((start, length) for start, length in zip(starts, GROUPED_LENGTHS) if length)
    for chunk, index, mask in groups:
        padded = {length + -length % 32 for _, length in chunk}
        assert len(padded) == 1 and len(chunk) in (1, 2, 4, 8)
        if len(chunk) == 1:
            assert index is None and mask is None
            continue
        assert mask.shape == (len(chunk), 1, 1, *padded) and index.shape == (len(chunk) * padded.pop(),)
        for row, (start, length) in enumerate(chunk):
            assert mask[row, 0, 0, :length].eq(0).all() and mask[row, 0, 0, length:].eq(torch.finfo().min).all()
            tokens = index.view(len(chunk), -1)[row]
            assert tokens[:length].tolist() == list(range(start, start + length)) and tokens[length:].eq(start).all()
    assert [len(chunk) for chunk, _, _ in groups] == [4, 2, 1, 4, 1, 2]


def test_a_group_holds_at_most_sixteen_sequences():
    groups = execution_encoderstack.fused_groups((20,) * 43, torch.float32, 32)
    assert [len(chunk) for chunk, _, _ in groups] == [16, 16, 8, 2, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_sequences_get_each_sequence_s_own_attention(dtype, fused_only):
    query, key, value = packed_row(GROUPED_LENGTHS, dtype)
    with torch.no_grad():
        context, weights = execution_encoderstack.grouped_fused_attention(
            ENCODER, query, key, value, list(GROUPED_LENGTHS), HEAD_DIM**-0.5
        )
    assert fused_only == [] and weights is None and context.shape == (1, sum(GROUPED_LENGTHS), HEADS, HEAD_DIM)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: as in the layouts test above
    expected = each_sequence_eager(query, key, value, list(GROUPED_LENGTHS))
    torch.testing.assert_close(context.double(), expected, atol=tolerance, rtol=0)


def test_sequences_padded_to_fewer_than_64_keys_go_one_by_one_to_the_per_sequence_kernel(monkeypatch):
    calls = []
    alone = recording(fused_attention, calls, lambda module, query, *_: query.shape[2])
    monkeypatch.setattr(execution_encoderstack, "fused_attention", alone)
    lengths = [20, 70, 10, 80]
    query, key, value = packed_row(lengths, torch.float32)
    with torch.no_grad():
        context = execution_encoderstack.grouped_fused_attention(ENCODER, query, key, value, lengths, HEAD_DIM**-0.5)
    assert calls == [20, 10]  # 70 and 80 (padded to 96) in one call
    torch.testing.assert_close(context[0].double(), each_sequence_eager(query, key, value, lengths), atol=1e-5, rtol=0)


def test_a_graph_serves_a_count_and_padded_length_whatever_the_batch(fused_only, monkeypatch):
    monkeypatch.setattr(execution_encoderstack, "fused_graphs", type(execution_encoderstack.fused_graphs)())
    traced = []
    counted = recording(torch.jit.trace, traced, lambda module, inputs: tuple(inputs[0].shape[::2]))
    monkeypatch.setattr(torch.jit, "trace", counted)
    with torch.no_grad():
        # each: two sequences padded to 32, two to 64, and one alone padded to 64 (another length each time)
        for lengths in ((40, 3, 64, 9, 33), (10, 50, 64, 60, 20)):
            query, key, value = packed_row(lengths, torch.float32)
            execution_encoderstack.grouped_fused_attention(ENCODER, query, key, value, list(lengths), 1.0)
    assert traced == [(2, 32), (2, 64), (1, 64)]  # (count, padded length): the second batch compiled nothing


def test_autograd_dropout_and_rows_of_several_leave_grouping_to_the_per_sequence_calls(kernel_calls):
    query, key, value = packed_row((40, 3, 64), torch.float32)
    training = SimpleNamespace(is_causal=False, training=True)
    options = {"sequence_lengths": [40, 3, 64], "sequence_attention": FUSED_ATTENTION}
    run = execution_encoderstack.per_sequence_attention
    run(ENCODER, query.detach().requires_grad_(), key, value, None, **options)
    with torch.no_grad():
        run(training, query, key, value, None, **options, dropout=0.1)
        run(ENCODER, *(x.expand(2, -1, -1, -1) for x in (query, key, value)), None, **options)
        run(ENCODER, query, key, value, None, **options)
    one_by_one = [(FUSED_ATTENTION, rows, length) for rows in (1, 1, 2) for length in (40, 3, 64)]
    assert kernel_calls == one_by_one + [(GROUPED, (40, 3, 64))]
