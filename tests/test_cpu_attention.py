"""bf16 on a CPU with native bf16 GEMMs runs attention as two oneDNN GEMMs around a softmax (`gemm_attention`, the
plan's kernel there), in inference and in training: eager attention's numbers and gradients for every mask the layers
give it, each score rounded once, on the padded and the packed path of every kind of layer; float32 and other
CPUs keep the configured backend."""

from types import SimpleNamespace

import pytest
import torch
from conftest import batch, build
from test_family_mechanisms import DEBERTA_LIKE, MPNET_LIKE
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from encoderstack import EncoderStackForMaskedLM, EncoderStackModel, execution_encoderstack
from encoderstack.execution_encoderstack import GEMM_ATTENTION, gemm_attention

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


@pytest.fixture
def gemm_calls(monkeypatch):
    """The rows and length of every `gemm_attention` call, as if the CPU had native bf16 GEMMs (bf16 batched matmuls
    run everywhere, slowly where emulated) and on this file's short sequences too."""
    monkeypatch.setattr(execution_encoderstack, "BF16_GEMMS", True)
    monkeypatch.setattr(execution_encoderstack, "GEMM_MIN_KEYS", 1)
    calls = []

    def counted(module, query, *args, **kwargs):
        calls.append((query.shape[0], query.shape[2]))
        return gemm_attention(module, query, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, GEMM_ATTENTION, counted)
    return calls


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
def test_bf16_inference_runs_every_layer_as_gemms_with_the_numbers_of_sdpa(
    gemm_calls, config, padding_free, monkeypatch
):
    model = build(EncoderStackModel, **config).to(torch.bfloat16)
    inputs = batch()  # rows of 9, 5 and 7 real tokens, padded to 9
    with torch.no_grad():
        fast = model(**inputs, padding_free=padding_free).last_hidden_state
    layers = model.config.num_hidden_layers
    assert gemm_calls == ([(1, 9), (1, 5), (1, 7)] * layers if padding_free else [(3, 9)] * layers)
    monkeypatch.setattr(execution_encoderstack, "BF16_GEMMS", False)  # the plan keeps SDPA
    with torch.no_grad():
        sdpa = model(**inputs, padding_free=padding_free).last_hidden_state
    real = inputs["attention_mask"].bool()
    # bf16 keeps 8 bits: 2^-8 of hidden states of unit size, a few roundings apart
    torch.testing.assert_close(fast[real].float(), sdpa[real].float(), atol=3e-2, rtol=0)


def test_float32_keeps_the_configured_backend_in_inference_and_training(gemm_calls):
    model = build(EncoderStackModel)
    with torch.no_grad():
        model(**batch())
    model.train()(**batch())
    assert gemm_calls == []


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
def test_a_bf16_autocast_training_step_through_the_kernel_gives_sdpa_s_loss_and_gradients(
    gemm_calls, padding_free, monkeypatch
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
    layers = model.config.num_hidden_layers
    assert gemm_calls == ([(1, 9), (1, 5), (1, 7)] * layers if padding_free else [(3, 9)] * layers)
    (fast_loss, fast), (sdpa_loss, sdpa) = steps
    torch.testing.assert_close(fast_loss, sdpa_loss, atol=2e-2, rtol=0)
    for (
        name,
        grad,
    ) in sdpa.items():  # bfloat16 keeps 8 bits: 2% of the gradient's size (the key bias: ~0, exactly 0 in theory)
        assert (fast[name] - grad).norm() <= 0.02 * grad.norm() + 1e-6, name


def test_the_plan_names_the_kernel_only_where_the_cpu_has_native_bf16_gemms(monkeypatch):
    model = build(EncoderStackModel).to(torch.bfloat16)
    with torch.no_grad():
        plan = model.execution_plan(**batch(), padding_free=False)
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported() and execution_encoderstack.ONEDNN_LINEAR
    assert (plan.attention == GEMM_ATTENTION) == native, plan.reason
    assert ("attention as GEMMs" in plan.reason) == native
