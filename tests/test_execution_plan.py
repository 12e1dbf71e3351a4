"""One execution plan per forward: the table of what runs where (a pure function of the facts, so CUDA cells are
asserted on CPU), the plan that `forward` obeys, and torch's real `varlen_attn` run on CPU through kernels
registered for its ops that check what the CUDA kernels check."""

import dataclasses
import itertools
import logging
from types import SimpleNamespace

import pytest
import torch
from conftest import build
from test_packed_sequences import attend_each, flattened, padded, sequences

import encoderstack
from encoderstack import EncoderStackModel, execution_encoderstack
from encoderstack.execution_encoderstack import (
    INPUT_KINDS,
    PackedSequences,
    PlanFacts,
    decide_plan,
    per_sequence_attention,
)

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16
CPU, H100, A100, T4 = ("cpu", None), ("cuda", (9, 0)), ("cuda", (8, 0)), ("cuda", (7, 5))
FLASH, PER_SEQUENCE, GEMM = "encoderstack_flash", "encoderstack_per_sequence", "encoderstack_gemm"
FUSED = "encoderstack_fused"
NATIVE_BF16, ONEDNN_FP32 = {"bf16_gemms": True, "onednn_graph": True}, {"onednn_graph": True, "cpu_kernels": "onednn"}


def facts(device=CPU, dtype=FP32, inputs="padded", backend="sdpa", **overrides):
    values = {
        "inputs": inputs,
        "backend": backend,
        "device_type": device[0],
        "capability": device[1],
        "dtype": dtype,
        "head_dim": 64,
        "attention_dropout": False,
        "padding_free": True,
        "recording": False,
        "compiling": False,
        "varlen_kernel": True,
        "padded_tokens": 1 << 16,
    }
    values.update(overrides)
    return PlanFacts(**values)


# (device, dtype, input, other facts) -> (kind, attention function)
PLAN_TABLE = [
    ((CPU, FP32, "whole", {}), ("padded", "sdpa")),
    ((CPU, FP32, "padded", {}), ("per_sequence", "encoderstack_per_sequence")),
    ((CPU, FP32, "flattened", {}), ("per_sequence", "encoderstack_per_sequence")),
    ((CPU, BF16, "padded", {}), ("per_sequence", "encoderstack_per_sequence")),
    ((CPU, BF16, "flattened", {"backend": "eager"}), ("per_sequence", "encoderstack_per_sequence")),
    ((CPU, FP32, "padded", {"padding_free": False}), ("padded", "sdpa")),
    ((CPU, FP32, "flattened", {"padding_free": False}), ("block_diagonal", "sdpa")),
    ((CPU, FP32, "flattened", {"recording": True}), ("block_diagonal", "sdpa")),
    ((CPU, FP32, "flattened", {"compiling": True}), ("block_diagonal", "sdpa")),
    ((H100, BF16, "whole", {}), ("padded", "sdpa")),
    ((H100, BF16, "padded", {}), ("varlen", "encoderstack_varlen")),
    ((H100, FP16, "flattened", {}), ("varlen", "encoderstack_varlen")),
    ((H100, FP32, "padded", {}), ("padded", "sdpa")),
    ((H100, FP32, "flattened", {}), ("per_sequence", "encoderstack_per_sequence")),
    ((CPU, FP32, "padded", {"attention_dropout": True}), ("per_sequence", "encoderstack_per_sequence")),
    ((CPU, BF16, "flattened", {"attention_dropout": True}), ("per_sequence", "encoderstack_per_sequence")),
    ((CPU, FP32, "flattened", {"attention_dropout": True, "padding_free": False}), ("block_diagonal", "sdpa")),
    ((H100, BF16, "padded", {"attention_dropout": True}), ("varlen", FLASH)),
    ((H100, FP16, "flattened", {"attention_dropout": True}), ("varlen", FLASH)),
    ((H100, FP32, "padded", {"attention_dropout": True}), ("padded", "sdpa")),
    ((H100, FP32, "flattened", {"attention_dropout": True}), ("per_sequence", "encoderstack_per_sequence")),
    ((H100, BF16, "padded", {"attention_dropout": True, "head_dim": 12}), ("padded", "sdpa")),
    ((H100, BF16, "whole", {"attention_dropout": True}), ("padded", "sdpa")),
    ((T4, FP16, "padded", {"attention_dropout": True}), ("padded", "sdpa")),
    ((T4, FP16, "flattened", {"attention_dropout": True}), ("per_sequence", "encoderstack_per_sequence")),
    (
        (H100, BF16, "padded", {"attention_dropout": True, "backend": "flash_attention_2"}),
        ("varlen", "flash_attention_2"),
    ),
    ((H100, BF16, "padded", {"head_dim": 12}), ("padded", "sdpa")),
    ((H100, BF16, "padded", {"head_dim": 512}), ("padded", "sdpa")),
    ((H100, BF16, "padded", {"varlen_kernel": False}), ("varlen", FLASH)),
    ((H100, BF16, "padded", {"varlen_kernel": False, "attention_dropout": True}), ("varlen", FLASH)),
    ((A100, BF16, "padded", {}), ("varlen", "encoderstack_varlen")),
    ((H100, BF16, "padded", {"padded_tokens": 8191}), ("padded", "sdpa")),
    ((H100, BF16, "padded", {"padded_tokens": 8192}), ("varlen", "encoderstack_varlen")),
    ((H100, BF16, "padded", {"padded_tokens": 4096, "attention_dropout": True}), ("padded", "sdpa")),
    ((H100, BF16, "flattened", {"padded_tokens": 4096, "attention_dropout": True}), ("varlen", FLASH)),
    ((CPU, FP32, "padded", {"padded_tokens": 64}), ("per_sequence", "encoderstack_per_sequence")),
    ((A100, FP16, "padded", {"attention_dropout": True}), ("varlen", FLASH)),
    ((A100, BF16, "flattened", {"attention_dropout": True}), ("varlen", FLASH)),
    ((A100, FP16, "flattened", {"varlen_kernel": False}), ("varlen", FLASH)),
    ((A100, FP32, "padded", {"attention_dropout": True}), ("padded", "sdpa")),
    ((H100, BF16, "padded", {"backend": "eager"}), ("padded", "eager")),
    ((H100, BF16, "padded", {"recording": True}), ("padded", "sdpa")),
    ((T4, FP16, "padded", {}), ("padded", "sdpa")),
    ((T4, FP16, "flattened", {}), ("per_sequence", "encoderstack_per_sequence")),
    ((H100, BF16, "padded", {"backend": "flash_attention_2"}), ("varlen", "flash_attention_2")),
    (
        (H100, BF16, "flattened", {"backend": "flash_attention_2", "padding_free": False}),
        ("varlen", "flash_attention_2"),
    ),
    ((H100, BF16, "padded", {"backend": "flash_attention_2", "padding_free": False}), ("padded", "flash_attention_2")),
    ((H100, BF16, "whole", {"backend": "flash_attention_2"}), ("padded", "flash_attention_2")),
    # bf16 on a CPU with native bf16 GEMMs, inference and training: attention as GEMMs (each sequence's when packed)
    ((CPU, BF16, "whole", {"bf16_gemms": True}), ("padded", GEMM)),
    ((CPU, BF16, "padded", {"bf16_gemms": True}), ("per_sequence", PER_SEQUENCE, GEMM)),
    ((CPU, BF16, "flattened", {"bf16_gemms": True, "padding_free": False}), ("block_diagonal", GEMM)),
    ((CPU, BF16, "whole", {"bf16_gemms": True, "attention_dropout": True}), ("padded", GEMM)),
    ((CPU, BF16, "whole", {"bf16_gemms": True, "recording": True}), ("padded", "sdpa")),
    ((CPU, BF16, "flattened", {"bf16_gemms": True, "compiling": True}), ("block_diagonal", "sdpa")),
    ((CPU, BF16, "whole", {"bf16_gemms": True, "backend": "eager"}), ("padded", "eager")),
    ((CPU, FP32, "whole", {"bf16_gemms": True}), ("padded", "sdpa")),
    ((CPU, BF16, "whole", {"bf16_gemms": False}), ("padded", "sdpa")),
    ((H100, BF16, "whole", {"bf16_gemms": True}), ("padded", "sdpa")),
    # ... in inference (nothing for autograd to record) one fused oneDNN Graph kernel, in bf16 and in float32 where
    # config.cpu_kernels is "onednn" or "onednn-prepacked"; where autograd may record, GEMMs in bf16 and SDPA in float32
    ((CPU, BF16, "whole", NATIVE_BF16), ("padded", FUSED)),
    ((CPU, BF16, "padded", NATIVE_BF16), ("per_sequence", PER_SEQUENCE, FUSED)),
    ((CPU, BF16, "whole", {**NATIVE_BF16, "autograd": True}), ("padded", GEMM)),
    ((CPU, BF16, "padded", {**NATIVE_BF16, "autograd": True}), ("per_sequence", PER_SEQUENCE, GEMM)),
    ((CPU, BF16, "whole", {**NATIVE_BF16, "attention_dropout": True}), ("padded", GEMM)),
    ((CPU, BF16, "whole", {**NATIVE_BF16, "recording": True}), ("padded", "sdpa")),
    ((CPU, BF16, "whole", {**NATIVE_BF16, "bf16_gemms": False}), ("padded", "sdpa")),
    ((CPU, FP32, "whole", {"onednn_graph": True}), ("padded", "sdpa")),
    ((CPU, FP32, "whole", ONEDNN_FP32), ("padded", FUSED)),
    ((CPU, FP32, "whole", {**ONEDNN_FP32, "cpu_kernels": "onednn-prepacked"}), ("padded", FUSED)),
    ((CPU, FP32, "padded", ONEDNN_FP32), ("per_sequence", PER_SEQUENCE, FUSED)),
    ((CPU, FP32, "flattened", {**ONEDNN_FP32, "padding_free": False}), ("block_diagonal", FUSED)),
    ((CPU, FP32, "whole", {**ONEDNN_FP32, "autograd": True}), ("padded", "sdpa")),
    ((CPU, FP32, "flattened", {**ONEDNN_FP32, "compiling": True}), ("block_diagonal", "sdpa")),
    ((CPU, FP32, "whole", {**ONEDNN_FP32, "backend": "eager"}), ("padded", "eager")),
    ((CPU, FP32, "whole", {"cpu_kernels": "onednn"}), ("padded", "sdpa")),
    ((H100, FP32, "whole", ONEDNN_FP32), ("padded", "sdpa")),
]


def cell_id(cell):
    (device, capability), dtype, inputs, other = cell
    where = device if capability is None else f"sm{capability[0]}{capability[1]}"
    return "-".join([where, str(dtype).removeprefix("torch."), inputs, *(f"{k}={v}" for k, v in other.items())])


@pytest.mark.parametrize(("cell", "expected"), PLAN_TABLE, ids=[cell_id(cell) for cell, _ in PLAN_TABLE])
def test_the_plan_for_every_cell_of_the_table(cell, expected):
    """(kind, attention function[, the kernel each sequence runs on the per-sequence path where not the backend])"""
    device, dtype, inputs, other = cell
    plan = decide_plan(facts(device, dtype, inputs, **other))
    assert (plan.kind, plan.attention) == expected[:2], plan.reason
    kernel = plan.layer_attention("full_attention")[1].get("sequence_attention")
    assert kernel == (expected[2] if len(expected) > 2 else None)


def test_attention_dropout_never_changes_the_kind_of_plan_and_says_so_where_it_changes_the_kernel():
    """No setting may switch to a slower plan silently: with dropout every cell keeps its kind, and where the
    attention function changes (varlen_attn has no dropout), the reason names the dropout."""
    grid = itertools.product(
        (CPU, H100, T4), (FP32, BF16, FP16), INPUT_KINDS, ("sdpa", "eager", "flash_attention_2"), (8, 12, 64)
    )
    for device, dtype, inputs, backend, head_dim in grid:
        cell = facts(device, dtype, inputs, backend, head_dim=head_dim)
        without, with_dropout = decide_plan(cell), decide_plan(dataclasses.replace(cell, attention_dropout=True))
        assert with_dropout.kind == without.kind, cell
        if with_dropout.attention != without.attention:
            assert "attention dropout" in with_dropout.reason, cell


def test_a_block_diagonal_mask_is_planned_only_for_flattened_rows_that_cannot_pack_and_says_if_it_is_dense():
    """Flattened rows get one mask only where no packed path may run (packing off, recorded outputs, compiling) and
    no flash path exists; the reason (logged for every forward) says when that mask is a dense tokens x tokens one."""
    flags = ("padding_free", "recording", "compiling", "attention_dropout")
    grid = itertools.product(
        (CPU, H100),
        (FP32, BF16),
        INPUT_KINDS,
        ("sdpa", "eager", "flex_attention", "flash_attention_2"),
        *[(False, True)] * 4,
    )
    for device, dtype, inputs, backend, *values in grid:
        plan = decide_plan(facts(device, dtype, inputs, backend, **dict(zip(flags, values))))
        padding_free, recording, compiling, _ = values
        cannot_pack = not padding_free or recording or compiling
        expected = inputs == "flattened" and cannot_pack and not backend.startswith("flash")
        assert (plan.kind == "block_diagonal") == expected, plan.facts
        if expected:
            assert ("dense (tokens x tokens)" in plan.reason) == (backend != "flex_attention"), plan.reason


# A relative-position score term (MPNet's bias): no flash kernel takes it, so where one would run, the plan runs a
# path that takes a mask (padded on a GPU, one sequence at a time for flattened rows) and says why.
RELATIVE_PLAN_TABLE = [
    ((H100, BF16, "padded", {}), ("padded", "sdpa")),
    ((H100, FP16, "flattened", {}), ("per_sequence", "encoderstack_per_sequence")),
    ((H100, BF16, "padded", {"attention_dropout": True}), ("padded", "sdpa")),
    ((H100, BF16, "flattened", {"attention_dropout": True, "varlen_kernel": False}), ("per_sequence", PER_SEQUENCE)),
    ((A100, BF16, "padded", {"backend": "eager"}), ("padded", "eager")),
    ((H100, BF16, "whole", {}), ("padded", "sdpa")),
    ((H100, BF16, "flattened", {"padding_free": False}), ("block_diagonal", "sdpa")),
    ((CPU, FP32, "padded", {}), ("per_sequence", PER_SEQUENCE)),
    ((CPU, FP32, "flattened", {}), ("per_sequence", PER_SEQUENCE)),
]


@pytest.mark.parametrize("term", ["bias", "disentangled"])  # MPNet's and DeBERTa's
@pytest.mark.parametrize(("cell", "expected"), RELATIVE_PLAN_TABLE, ids=[cell_id(c) for c, _ in RELATIVE_PLAN_TABLE])
def test_a_relative_position_term_is_planned_only_onto_paths_that_take_it_and_the_reason_says_so(cell, expected, term):
    device, dtype, inputs, other = cell
    without = decide_plan(facts(device, dtype, inputs, **other))
    plan = decide_plan(facts(device, dtype, inputs, relative_attention=term, **other))
    assert (plan.kind, plan.attention) == expected, plan.reason
    if (plan.kind, plan.attention) != (without.kind, without.attention):
        assert f"relative-position scores ({term})" in plan.reason, plan.reason


@pytest.mark.parametrize("term", ["bias", "disentangled"])
def test_no_cell_plans_a_flash_kernel_for_a_relative_position_term(term):
    grid = itertools.product(
        (CPU, H100, A100, T4), (FP32, BF16, FP16), INPUT_KINDS, ("sdpa", "eager"), *[(False, True)] * 3
    )
    for device, dtype, inputs, backend, padding_free, dropout, varlen in grid:
        cell = facts(
            device, dtype, inputs, backend, padding_free=padding_free, attention_dropout=dropout,
            varlen_kernel=varlen, relative_attention=term,
        )  # fmt: skip
        plan = decide_plan(cell)
        assert plan.kind != "varlen" and plan.attention in (backend, PER_SEQUENCE), cell


@pytest.mark.parametrize("term", ["bias", "disentangled"])
@pytest.mark.parametrize("backend", ["flash_attention_2", "flex_attention"])
def test_a_relative_position_term_on_a_backend_without_a_score_term_is_refused_by_name(backend, term):
    with pytest.raises(ValueError, match=f"relative_attention='{term}'.*the {backend} backend cannot take"):
        decide_plan(facts(H100, BF16, "padded", backend, relative_attention=term))


@pytest.fixture
def plan_log(caplog):
    """The model's debug log (transformers' loggers do not propagate below their own level)."""
    encoder_logger = logging.getLogger("encoderstack.modeling_encoderstack")
    encoder_logger.setLevel(logging.DEBUG)
    with caplog.at_level(logging.DEBUG, logger=encoder_logger.name):
        yield caplog
    encoder_logger.setLevel(logging.NOTSET)


def test_flattened_rows_that_cannot_pack_log_their_dense_mask(plan_log):
    model = build(EncoderStackModel, attn_implementation="sdpa")
    with torch.no_grad():
        model(**flattened(sequences()), padding_free=False)
    dense = "block_diagonal through sdpa: padding_free is off: flattened rows get a dense (tokens x tokens)"
    assert dense in plan_log.text


def attention_probabilities(query, key, lengths, scale):
    """(heads, n, n) softmax probabilities of each packed sequence alone."""
    bounds = [0, *itertools.accumulate(lengths)]
    return [
        torch.softmax(scale * query[0, :, a:b] @ key[0, :, a:b].transpose(-1, -2), dim=-1)
        for a, b in zip(bounds, bounds[1:])
    ]


@pytest.mark.parametrize("backend", ["eager", "sdpa", GEMM])
def test_the_per_sequence_path_drops_the_configured_share_of_attention_probabilities(backend, monkeypatch):
    """Each key's value is its one-hot position, so the output rows are the (dropped) probabilities themselves."""
    monkeypatch.setattr(execution_encoderstack, "GEMM_MIN_KEYS", 1)  # the GEMM kernel on these short sequences too
    lengths, heads, share = [12, 30, 7, 23], 4, 0.25
    width = max(lengths)
    torch.manual_seed(0)
    query, key = torch.randn(2, 1, heads, sum(lengths), width)
    value = torch.cat([torch.eye(width)[:n] for n in lengths]).expand(1, heads, -1, -1)
    module = SimpleNamespace(config=SimpleNamespace(_attn_implementation=backend), is_causal=False, training=True)
    kwargs = PackedSequences(lengths, (1, sum(lengths)), "cpu").attention_kwargs()
    scale = width**-0.5
    rows, _ = per_sequence_attention(module, query, key, value, None, scaling=scale, dropout=share, **kwargs)
    dropped = rows[0].transpose(0, 1).split(lengths, dim=1)  # (heads, n, width) each
    kept_count = total = 0
    for probabilities, got, n in zip(attention_probabilities(query, key, lengths, scale), dropped, lengths):
        assert not got[..., n:].any(), "no probability may reach another sequence"
        kept = got[..., :n] != 0
        torch.testing.assert_close(got[..., :n][kept], probabilities[kept] / (1 - share))
        kept_count, total = kept_count + int(kept.sum()), total + kept.numel()
    assert abs(1 - kept_count / total - share) < 0.02  # 6488 probabilities: 0.02 is about 4 standard deviations


def test_in_training_attention_dropout_changes_the_packed_outputs_and_nothing_else_does():
    seqs = sequences()
    inputs = padded(seqs)
    real = inputs["attention_mask"].bool()
    outputs = {}
    for share in (0.0, 0.3):
        model = build(EncoderStackModel, attention_probs_dropout_prob=share)
        with torch.no_grad():
            expected = model(**inputs).last_hidden_state[real]
            model.train()
            assert model.execution_plan(**inputs).kind == "per_sequence"
            outputs[share] = model(**inputs).last_hidden_state[real]
        if share == 0.0:
            torch.testing.assert_close(outputs[share], expected)
    assert not torch.allclose(outputs[0.3], expected, atol=1e-3)


def test_the_plan_counts_the_padded_batchs_tokens_and_says_why_a_small_one_stays_padded_on_a_gpu(monkeypatch):
    model = build(EncoderStackModel)
    inputs = padded(sequences())
    assert model.execution_plan(**inputs).facts.padded_tokens == inputs["input_ids"].numel()
    monkeypatch.setattr(execution_encoderstack, "cuda_capability", lambda device: (9, 0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = model.execution_plan(**inputs)
    assert plan.kind == "padded" and "too few for packing to pay on a GPU" in plan.reason


def test_a_plan_is_immutable_and_says_why():
    plan = decide_plan(facts(H100, FP32, "padded"))
    with pytest.raises(AttributeError):
        plan.kind = "varlen"
    assert "float32" in plan.reason and "padded batch" in plan.reason


def test_the_model_plans_with_autocasts_dtype_not_the_weights(monkeypatch):
    """Trainer(bf16=True) keeps float32 weights and runs under autocast: the compute dtype is bfloat16."""
    model = build(EncoderStackModel)
    inputs = padded(sequences())
    assert model.execution_plan(**inputs).facts.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.execution_plan(**inputs).facts.dtype == torch.bfloat16


def test_the_model_exposes_the_plan_its_forward_obeys_and_logs_it(plan_log, monkeypatch):
    model = build(EncoderStackModel, attn_implementation="sdpa")
    inputs = padded(sequences())
    plan = model.execution_plan(**inputs)
    assert plan.kind == "per_sequence" and plan.packing.lengths == [5, 9, 1, 7, 3]
    used = []
    original = execution_encoderstack.per_sequence_attention
    monkeypatch.setitem(
        execution_encoderstack.ALL_ATTENTION_FUNCTIONS._global_mapping,
        "encoderstack_per_sequence",
        lambda *args, **kwargs: used.append(1) or original(*args, **kwargs),
    )
    with torch.no_grad():
        model(**inputs)
    assert len(used) == model.config.num_hidden_layers
    assert "execution plan: per_sequence through encoderstack_per_sequence" in plan_log.text


def test_an_older_varlen_attn_without_scale_is_called_without_it():
    def older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        return query

    kernel, takes_scale = execution_encoderstack.inspect_varlen_attn(older)
    assert kernel is older and not takes_scale
    assert execution_encoderstack.inspect_varlen_attn(torch.nn.attention.varlen.varlen_attn)[1]


# torch's real varlen_attn, on CPU: kernels for its two ops that check the CUDA flash kernel's argument contract
# and compute the real result (each sequence alone, in float32).

KERNEL_CALLS = []


def check_flash_contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
    for x in (query, key, value):
        assert x.dim() == 3 and x.stride(-1) == 1, "q/k/v must be (tokens, heads, head_dim), last dim contiguous"
        assert x.dtype in (torch.float16, torch.bfloat16) and x.dtype == query.dtype, "flash takes fp16/bf16"
        assert x.shape[-1] % 8 == 0 and x.shape[-1] <= 256, "flash head sizes: multiples of 8 up to 256"
    for cu in (cu_seq_q, cu_seq_k):
        assert cu.dtype == torch.int32 and cu.dim() == 1, "cu_seq_lens must be 1-D int32"
        assert int(cu[-1]) == query.shape[0]
    assert type(max_q) is int and type(max_k) is int, "max lengths must be Python ints"
    assert max_q >= int(cu_seq_q.diff().max())


def varlen_forward_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, *rest):
    check_flash_contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    KERNEL_CALLS.append("forward")
    out = attend_each(query, key, value, cu_seq_q, scale).to(query.dtype)
    lse = torch.zeros(query.shape[1], query.shape[0], dtype=torch.float)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def varlen_backward_kernel(
    grad, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, causal, rng, scale=None, *rest
):
    check_flash_contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    KERNEL_CALLS.append("backward")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    bounds = cu_seq_q.tolist()
    grads = [
        attention_backward(grad[a:b], *(x[a:b] for x in (query, key, value)), scale) for a, b in zip(bounds, bounds[1:])
    ]
    return tuple(torch.cat(parts).to(query.dtype) for parts in zip(*grads))


def test_the_stand_in_backward_kernel_is_the_gradient_of_attention():
    q, k, v, g = torch.randn(4, 7, 2, 8, dtype=torch.float64).unbind(0)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(0, 1) for x in leaves), scale=0.3)
    expected = torch.autograd.grad(out.transpose(0, 1), leaves, g)
    for actual, wanted in zip(attention_backward(g, q, k, v, 0.3), expected):
        torch.testing.assert_close(actual, wanted.float())


def attention_backward(grad, query, key, value, scale):
    """softmax(scale q k^T) v differentiated by hand (kernels run below autograd); (tokens, heads, dim)."""
    q, k, v, g = (x.transpose(0, 1).float() for x in (query, key, value, grad))
    p = torch.softmax(scale * q @ k.transpose(1, 2), dim=-1)
    dp = g @ v.transpose(1, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    return tuple(x.transpose(0, 1) for x in (scale * ds @ k, scale * ds.transpose(1, 2) @ q, p.transpose(1, 2) @ g))


@pytest.fixture
def varlen_on_cpu(monkeypatch):
    """torch's varlen_attn runs here as on an sm90 device: its ops get the CPU kernels above."""
    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", varlen_forward_kernel)
    torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", varlen_backward_kernel)
    monkeypatch.setattr(execution_encoderstack, "cuda_capability", lambda device: (9, 0))
    monkeypatch.setattr(execution_encoderstack, "GPU_PACKING_MIN_TOKENS", 0)  # the tests' batches are tiny
    real_varlen_attn = execution_encoderstack.varlen_attn

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs):
        # the op's schema turns a 0-d tensor into an int (a device sync each layer): the documented type is int
        assert type(max_q) is int and type(max_k) is int, "varlen_attn takes Python-int max lengths"
        return real_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)

    monkeypatch.setattr(execution_encoderstack, "varlen_attn", varlen_attn)
    KERNEL_CALLS.clear()
    return KERNEL_CALLS


@pytest.mark.parametrize("route", ["padded", "flattened"])
def test_torchs_real_varlen_attn_runs_once_per_layer_under_bf16_autocast_forward_and_backward(route, varlen_on_cpu):
    model = build(encoderstack.EncoderStackForMaskedLM, position_embedding_type="rope").train()
    seqs = sequences()
    inputs = padded(seqs) if route == "padded" else flattened(seqs)
    labels = torch.where(torch.rand(inputs["input_ids"].shape) < 0.5, inputs["input_ids"], -100)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.model.execution_plan(**inputs).kind == "varlen"
        out = model(**inputs, labels=labels)
    assert_same_loss_and_gradients_as_the_padded_batch(model, inputs, labels, out)
    layers = model.config.num_hidden_layers
    assert varlen_on_cpu == ["forward"] * layers + ["backward"] * layers


def assert_same_loss_and_gradients_as_the_padded_batch(model, inputs, labels, out):
    """`out` (a bf16-autocast forward): its loss and gradients against the padded batch's, without dropout."""
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model.eval()  # the stand-in kernels drop nothing: the reference drops nothing either
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(**inputs, labels=labels, padding_free=False)
    expected.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss, atol=2e-2, rtol=0)
    for name, p in model.named_parameters():  # bfloat16 keeps 8 bits: 2% of the gradient's size
        assert (grads[name] - p.grad).norm() <= 0.02 * p.grad.norm() + 1e-6, name


# torch's flash kernel (`aten._flash_attention_forward` / `_flash_attention_backward`), on CPU: kernels that check
# its contract, drop attention probabilities with a mask that is a function of the RNG state alone (as flash's
# Philox counter is), and differentiate exactly, so that a backward given another call's RNG state gets wrong
# gradients.

FLASH_CALLS = []  # (direction, dropout_p, (left, right) window, seed of the RNG state)


def flash_reference(query, key, value, cu_seq_q, scale, window, dropout_p, seed, grad=None):
    """Windowed attention with dropout on packed (tokens, heads, dim), each sequence alone, in float32; with `grad`,
    the gradients of q, k and v instead (by hand: kernels run below autograd)."""
    left, right = window
    outputs = []
    for a, b in zip(cu_seq_q.tolist(), cu_seq_q.tolist()[1:]):
        q, k, v = (x[a:b].transpose(0, 1).float() for x in (query, key, value))
        distance = torch.arange(b - a)[:, None] - torch.arange(b - a)[None]
        allowed = (distance <= left if left >= 0 else True) & (-distance <= right if right >= 0 else True)
        p = (scale * q @ k.transpose(1, 2)).masked_fill(~torch.as_tensor(allowed), float("-inf")).softmax(-1)
        keep = torch.rand(p.shape, generator=torch.Generator().manual_seed(seed + a)) >= dropout_p
        dropped = p * keep / (1 - dropout_p)
        if grad is None:
            outputs.append([(dropped @ v).transpose(0, 1)])
            continue
        g = grad[a:b].transpose(0, 1).float()
        dp = (g @ v.transpose(1, 2)) * keep / (1 - dropout_p)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        outputs.append([x.transpose(0, 1) for x in (scale * ds @ k, scale * ds.transpose(1, 2) @ q, dropped.mT @ g)])
    return tuple(torch.cat(parts).to(query.dtype) for parts in zip(*outputs))


def flash_forward_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, dropout_p, causal, debug, **kwargs):
    check_flash_contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    assert torch.equal(cu_seq_q, cu_seq_k) and not causal and not debug, "an encoder: keys are the queries' tokens"
    window = (kwargs.get("window_size_left", -1), kwargs.get("window_size_right", -1))
    scale = query.shape[-1] ** -0.5 if kwargs.get("scale") is None else kwargs["scale"]
    seed = 1000 + len(FLASH_CALLS)  # every call draws a new mask
    FLASH_CALLS.append(("forward", dropout_p, window, seed))
    (out,) = flash_reference(query, key, value, cu_seq_q, scale, window, dropout_p, seed)
    lse = torch.zeros(query.shape[1], query.shape[0], dtype=torch.float)
    return out, lse, torch.tensor([seed, 0], dtype=torch.uint64), torch.empty(0), torch.empty(0)


def flash_backward_kernel(
    grad, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, p, causal, rng, *_, **kw
):  # noqa: E501  (the op's schema)
    check_flash_contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    window = (kw.get("window_size_left", -1), kw.get("window_size_right", -1))
    scale = query.shape[-1] ** -0.5 if kw.get("scale") is None else kw["scale"]
    seed = int(rng[0])
    FLASH_CALLS.append(("backward", p, window, seed))
    return flash_reference(query, key, value, cu_seq_q, scale, window, p, seed, grad=grad.contiguous())


@pytest.fixture
def flash_on_cpu(monkeypatch):
    """torch's flash kernel runs here as on an sm90 device, through the kernels above."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("_flash_attention_forward", flash_forward_kernel, "CPU")
    library.impl("_flash_attention_backward", flash_backward_kernel, "CPU")
    monkeypatch.setattr(execution_encoderstack, "cuda_capability", lambda device: (9, 0))
    monkeypatch.setattr(execution_encoderstack, "GPU_PACKING_MIN_TOKENS", 0)  # the tests' batches are tiny
    FLASH_CALLS.clear()
    yield FLASH_CALLS
    library._destroy()


def test_the_stand_in_flash_backward_is_the_gradient_of_its_forward_with_the_same_dropout_mask():
    q, k, v, g = torch.randn(4, 9, 2, 8, dtype=torch.float64).unbind(0)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = []
    for a, b in ((0, 4), (4, 9)):  # the same mask, drawn through autograd
        x = [t[a:b].transpose(0, 1) for t in leaves]
        p = torch.softmax(0.3 * x[0] @ x[1].mT, dim=-1)
        keep = torch.rand(p.shape, generator=torch.Generator().manual_seed(7 + a)) >= 0.25
        out.append(((p * keep / 0.75) @ x[2]).transpose(0, 1))
    expected = torch.autograd.grad(torch.cat(out), leaves, g)
    (forward,) = flash_reference(q, k, v, cu, 0.3, (-1, -1), 0.25, 7)
    torch.testing.assert_close(forward.float(), torch.cat(out).detach().float())  # the stand-in computes in float32
    for actual, wanted in zip(flash_reference(q, k, v, cu, 0.3, (-1, -1), 0.25, 7, grad=g), expected):
        torch.testing.assert_close(actual.float(), wanted.float())


def test_the_flash_function_drops_inside_the_kernel_and_each_backward_replays_its_own_forwards_mask(flash_on_cpu):
    generator = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)  # sequences of 5, 1 and 7 tokens
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 7, "max_length_k": 7}
    module = SimpleNamespace(training=True)
    calls = []
    for _ in range(2):  # two layers: two masks, each backward must get its own
        q, k, v = (torch.randn(1, 2, 13, 8, generator=generator).bfloat16().requires_grad_() for _ in range(3))
        out, _ = execution_encoderstack.flash_attention(module, q, k, v, None, scaling=0.3, dropout=0.25, **kwargs)
        assert out.shape == (1, 13, 2, 8)  # transformers' (batch, tokens, heads, dim)
        calls.append((q, k, v, out))
    grads = [torch.randn(1, 13, 2, 8, generator=generator).bfloat16() for _ in calls]
    torch.autograd.backward([out for *_, out in calls], grads)
    forwards, backwards = flash_on_cpu[:2], flash_on_cpu[2:]
    assert [call[:3] for call in flash_on_cpu] == [("forward", 0.25, (-1, -1))] * 2 + [("backward", 0.25, (-1, -1))] * 2
    assert sorted(seed for *_, seed in backwards) == [seed for *_, seed in forwards]
    for (q, k, v, out), grad, (*_, seed) in zip(calls, grads, forwards):
        packed = [x.detach()[0].transpose(0, 1) for x in (q, k, v)]
        (expected,) = flash_reference(*packed, cu, 0.3, (-1, -1), 0.25, seed)
        torch.testing.assert_close(out[0], expected)
        wanted = flash_reference(*packed, cu, 0.3, (-1, -1), 0.25, seed, grad=grad[0])
        for x, want in zip((q, k, v), wanted):
            torch.testing.assert_close(x.grad[0].transpose(0, 1), want)


@pytest.mark.parametrize("route", ["padded", "flattened"])
def test_attention_dropout_runs_one_flash_call_per_layer_forward_and_backward_without_a_host_sync(route, flash_on_cpu):
    model = build(encoderstack.EncoderStackForMaskedLM, attention_probs_dropout_prob=0.1).train()
    seqs = sequences()
    inputs = padded(seqs) if route == "padded" else flattened(seqs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = model.model.execution_plan(**inputs)
        assert (plan.kind, plan.attention) == ("varlen", FLASH), plan.reason
        with HostSyncs() as syncs:
            model.model(**inputs, plan=plan).last_hidden_state.float().pow(2).mean().backward()
    layers = model.config.num_hidden_layers
    assert [call[:3] for call in flash_on_cpu] == [("forward", 0.1, (-1, -1))] * layers + [
        ("backward", 0.1, (-1, -1))
    ] * layers
    assert [seed for *_, seed in flash_on_cpu[layers:]] == [seed for *_, seed in flash_on_cpu[:layers]][::-1]
    assert syncs.count == 0


@pytest.mark.parametrize("route", ["padded", "flattened"])
def test_without_varlen_attn_the_flash_kernel_gives_the_padded_batchs_loss_and_gradients(
    route, flash_on_cpu, monkeypatch
):
    monkeypatch.setattr(execution_encoderstack, "varlen_attn", None)
    model = build(encoderstack.EncoderStackForMaskedLM, position_embedding_type="rope").train()
    seqs = sequences()
    inputs = padded(seqs) if route == "padded" else flattened(seqs)
    labels = torch.where(torch.rand(inputs["input_ids"].shape) < 0.5, inputs["input_ids"], -100)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.model.execution_plan(**inputs).attention == FLASH
        out = model(**inputs, labels=labels)
    assert_same_loss_and_gradients_as_the_padded_batch(model, inputs, labels, out)
    layers = model.config.num_hidden_layers
    assert [call[:2] for call in flash_on_cpu] == [("forward", 0.0)] * layers + [("backward", 0.0)] * layers


class HostSyncs(torch.overrides.TorchFunctionMode):
    """Counts the calls that make a device wait for the host to read a value (on CPU they cost nothing, but each
    one is a sync on a GPU): reading values, truth tests, and shapes that depend on values."""

    READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__}
    READS |= {torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.nonzero, torch.nonzero}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        masked_index = func is torch.Tensor.__getitem__ and torch.is_tensor(args[1]) and args[1].dtype == torch.bool
        self.count += func in self.READS or masked_index
        return func(*args, **(kwargs or {}))


def test_a_padded_masked_lm_training_step_makes_one_host_sync():
    """The plan's one read: the inputs' checks (the mask's values, the ids' ranges), the padded rows' lengths, and the
    labels (how many are labelled, for sparse prediction, and their range); none per layer or loss term."""
    model = build(encoderstack.EncoderStackForMaskedLM, num_hidden_layers=4).train()
    inputs = padded(sequences())
    labels = torch.where(torch.rand(inputs["input_ids"].shape) < 0.3, inputs["input_ids"], -100)
    with HostSyncs() as syncs:
        model(**inputs, labels=labels).loss.backward()
    assert syncs.count == 1


@pytest.mark.parametrize(
    "model_class", [encoderstack.EncoderStackForSequenceClassification, encoderstack.EncoderStackForTokenClassification]
)
def test_a_padded_classification_training_step_makes_one_host_sync(model_class):
    """The plan's one read, the class labels' range included."""
    model = build(model_class, num_hidden_layers=4, num_labels=3).train()
    inputs = padded(sequences())
    shape = inputs["input_ids"].shape[:1] if model_class is encoderstack.EncoderStackForSequenceClassification else None
    labels = torch.arange(shape[0]) % 3 if shape else torch.randint(0, 3, inputs["input_ids"].shape)
    with HostSyncs() as syncs:
        model(**inputs, labels=labels).loss.backward()
    assert syncs.count == 1


@pytest.mark.parametrize("sparse", [True, False])
def test_labels_read_with_the_plan_still_refuse_a_class_outside_the_vocabulary(sparse):
    model = build(encoderstack.EncoderStackForMaskedLM, sparse_prediction=sparse).train()
    inputs = padded(sequences())
    labels = torch.full(inputs["input_ids"].shape, -100)
    labels[0, 1] = model.config.vocab_size  # one past the last class, at a real token
    with pytest.raises(ValueError, match=r"Class labels must lie in \[0, 98\].*from 99 to 99"):
        model(**inputs, labels=labels)
