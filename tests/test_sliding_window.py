"""Sliding-window attention (query i sees key j of its own sequence iff |i - j| <= sliding_window) as one more fact
of the execution plan: every path agrees with a dense band-masked softmax run on each sequence alone, outputs and
gradients; the window is exact (one more or one less fails); sliding layers never hold a tokens x tokens tensor;
a model whose layers are all full behaves as before; the CUDA routes get the window their kernels expect."""

import collections
import contextlib
import dataclasses

import pytest
import torch
from conftest import build
from test_execution_plan import facts, flash_on_cpu  # noqa: F401  (a fixture)
from test_packed_sequences import flattened, sequences
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface

from encoderstack import EncoderStackModel, execution_encoderstack
from encoderstack.execution_encoderstack import ExecutionPlan, decide_plan

LENGTHS = (5, 23, 1, 17, 30)
SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]
BACKENDS = ("eager", "sdpa")


@pytest.fixture(autouse=True)
def banded_at_these_lengths(monkeypatch):
    """The sequences here are a few radii long, where the plan would take a dense band mask (test_dense_band.py):
    every test in this file runs the banded path."""
    monkeypatch.setattr(execution_encoderstack, "DENSE_BAND_RADII", 0)


def windowed(window, layer_types=SLIDING, **overrides):
    return build(
        EncoderStackModel,
        layer_types=layer_types,
        sliding_window=window,
        position_embedding_type="rope",
        max_position_embeddings=64,
        **overrides,
    )


def dense_band_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain softmax attention over one whole sequence (batch of one, no padding), the band built densely (a sliding
    layer is handed the band as the plan would run it, and ignores it)."""
    assert query.shape[0] == 1 and (attention_mask is None or module.layer_type == "sliding_attention")
    scores = query @ key.transpose(-1, -2) * scaling
    if module.layer_type == "sliding_attention":
        at = torch.arange(query.shape[2])
        scores = scores.masked_fill((at[:, None] - at[None]).abs() > module.config.sliding_window, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2), None


AttentionInterface.register("dense_band_reference", dense_band_reference)


@contextlib.contextmanager
def every_layer_dense(monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(ExecutionPlan, "layer_attention", lambda self, layer_type: ("dense_band_reference", {}))
        yield


def padded(seqs, side="right"):
    width = max(len(s["input_ids"]) for s in seqs)
    batch = {name: torch.zeros(len(seqs), width, dtype=torch.long) for name in ("input_ids", "attention_mask")}
    for row, s in enumerate(seqs):
        n = len(s["input_ids"])
        where = slice(0, n) if side == "right" else slice(width - n, width)
        batch["input_ids"][row, where], batch["attention_mask"][row, where] = s["input_ids"], 1
    return batch


def real_rows(hidden, inputs):
    """(batch, seq, hidden) -> (tokens, hidden): the real tokens, sequence after sequence."""
    mask = inputs.get("attention_mask")
    return hidden.flatten(0, 1) if mask is None else hidden[mask.bool()]


def reference_states(model, seqs, monkeypatch):
    backend = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"  # whose mask of one whole sequence is None
    try:
        with every_layer_dense(monkeypatch):
            return torch.cat([model(input_ids=s["input_ids"][None]).last_hidden_state[0] for s in seqs])
    finally:
        model.config._attn_implementation = backend


ROUTES = {
    "right-padded, padding-free": lambda seqs: (padded(seqs), {}),
    "left-padded, padding-free": lambda seqs: (padded(seqs, "left"), {}),
    "right-padded, padded batch": lambda seqs: (padded(seqs), {"padding_free": False}),
    "left-padded, padded batch": lambda seqs: (padded(seqs, "left"), {"padding_free": False}),
    "flattened rows, packed": lambda seqs: (flattened(seqs), {}),
    "flattened rows, one row": lambda seqs: (flattened(seqs), {"padding_free": False}),
    "one sequence": lambda seqs: ({"input_ids": seqs[0]["input_ids"][None]}, {}),
}


def route_sequences(route):
    seqs = [
        {"input_ids": s["input_ids"], "token_type_ids": torch.zeros_like(s["input_ids"])} for s in sequences(LENGTHS)
    ]
    return seqs[1:2] if route == "one sequence" else seqs


@pytest.mark.parametrize("window", [1, 7, 28, 29])  # the longest sequence: 30 tokens
@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex_attention"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_every_path_gives_the_dense_band_masked_softmax_on_real_tokens(route, backend, window, monkeypatch):
    model = windowed(window, attn_implementation=backend)
    seqs = route_sequences(route)
    inputs, options = ROUTES[route](seqs)
    with torch.no_grad():
        expected = reference_states(model, seqs, monkeypatch)
        actual = real_rows(model(**inputs, **options).last_hidden_state, inputs)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("route", ["right-padded, padding-free", "left-padded, padded batch", "flattened rows, packed"])
def test_training_gradients_agree_with_the_dense_band_masked_softmax(route, monkeypatch):
    """Training mode, no dropout: the same weighted sum of real-token states differentiates to the same gradients.
    In float64: a shared embedding's gradient sums every token's in an order each path chooses, and in float32 that
    rounding (2 ulps of 1e3 on AVX-512 kernels) exceeds the tolerance; a wrong mask is off by orders more."""
    model = windowed(4, attn_implementation="sdpa").double().train()
    seqs = route_sequences(route)
    inputs, options = ROUTES[route](seqs)
    generator = torch.Generator().manual_seed(7)
    weights = torch.randn(sum(LENGTHS), model.config.hidden_size, generator=generator, dtype=torch.float64)

    def gradients(states):
        model.zero_grad()
        (states * weights).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    expected = gradients(reference_states(model, seqs, monkeypatch))
    actual = gradients(real_rows(model(**inputs, **options).last_hidden_state, inputs))
    assert expected.keys() == actual.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("off_by", [-1, 1])
@pytest.mark.parametrize("route", ["right-padded, padding-free", "left-padded, padded batch", "flattened rows, packed"])
def test_a_window_off_by_one_is_caught(route, off_by, monkeypatch):
    """The agreement above is exact enough to see one key more or one key less on each side: the radius every path
    reads (the plan's, from the config) moved by one after the reference ran."""
    model = windowed(7)
    seqs = route_sequences(route)
    inputs, options = ROUTES[route](seqs)
    with torch.no_grad():
        expected = reference_states(model, seqs, monkeypatch)
        model.config.sliding_window += off_by
        actual = real_rows(model(**inputs, **options).last_hidden_state, inputs)
    assert (actual - expected).abs().max() > 1e-3


class CreatedTensors(TorchDispatchMode):
    """The element count of every tensor any operation creates (views included)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sizes += [x.numel() for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        return out


MEMORY_ROUTES = {
    "one sequence": lambda ids: ({"input_ids": ids[:1]}, {}),
    "padded batch": lambda ids: ({"input_ids": ids, "attention_mask": padding_mask(ids)}, {"padding_free": False}),
    "padding-free": lambda ids: ({"input_ids": ids, "attention_mask": padding_mask(ids)}, {}),
}


def padding_mask(ids):
    return (torch.arange(ids.shape[1]) < torch.tensor([[ids.shape[1]], [ids.shape[1] - 100]])).long()


@pytest.mark.parametrize("route", list(MEMORY_ROUTES))
def test_no_tensor_of_a_sliding_layer_holds_sequence_squared_elements(route, monkeypatch):
    """S = 2048 tokens a row, radius 16, two heads, every layer sliding: the largest tensor any operation of the
    forward creates holds fewer than S * S elements (one head's score matrix of one row), where the same model with a
    dense band mask creates one of at least S * S elements (which shows the count can fail)."""
    S = 2048
    model = windowed(16, layer_types=["sliding_attention"] * 2, num_hidden_layers=2, num_attention_heads=2)
    model.config.max_position_embeddings = S
    inputs, options = MEMORY_ROUTES[route](torch.randint(1, 99, (2, S), generator=torch.Generator().manual_seed(0)))
    with torch.no_grad(), CreatedTensors() as banded:
        model(**inputs, **options)
    assert max(banded.sizes) < S * S
    assert model.execution_plan(**inputs, **options).sliding == "encoderstack_banded"
    monkeypatch.setattr(execution_encoderstack, "sliding_attention", lambda facts, plan: ("sdpa", "dense"))
    with torch.no_grad(), CreatedTensors() as dense:
        model(**inputs, padding_free=False)
    assert max(dense.sizes) >= S * S


BF16, FP32 = torch.bfloat16, torch.float32
CPU, H100 = ("cpu", None), ("cuda", (9, 0))
BANDED, VARLEN, FLASH = "encoderstack_banded", "encoderstack_varlen", "encoderstack_flash"
# (device, dtype, input, other facts) -> (kind, full layers' attention, sliding layers' attention); radius 4, the
# longest sequence 30 tokens unless said
SLIDING_PLAN_TABLE = [
    ((CPU, FP32, "whole", {}), ("padded", "sdpa", BANDED)),
    ((CPU, FP32, "padded", {}), ("per_sequence", "encoderstack_per_sequence", BANDED)),
    ((CPU, FP32, "flattened", {}), ("per_sequence", "encoderstack_per_sequence", BANDED)),
    ((CPU, FP32, "padded", {"padding_free": False}), ("padded", "sdpa", BANDED)),
    ((CPU, FP32, "flattened", {"padding_free": False}), ("block_diagonal", "sdpa", BANDED)),
    ((CPU, FP32, "padded", {"backend": "eager", "padding_free": False}), ("padded", "eager", BANDED)),
    ((CPU, FP32, "padded", {"backend": "flex_attention", "padding_free": False}), ("padded", "flex_attention", BANDED)),
    ((CPU, FP32, "padded", {"compiling": True}), ("padded", "sdpa", "sdpa")),
    ((CPU, FP32, "flattened", {"compiling": True}), ("block_diagonal", "sdpa", "sdpa")),
    ((CPU, FP32, "whole", {"recording": True, "backend": "eager"}), ("padded", "eager", "eager")),
    ((CPU, FP32, "padded", {"longest": 5}), ("per_sequence", "encoderstack_per_sequence", None)),
    ((CPU, FP32, "padded", {"longest": 6}), ("per_sequence", "encoderstack_per_sequence", BANDED)),
    ((H100, BF16, "padded", {}), ("varlen", VARLEN, VARLEN)),
    ((H100, BF16, "flattened", {}), ("varlen", VARLEN, VARLEN)),
    ((H100, BF16, "padded", {"varlen_window": False}), ("varlen", VARLEN, BANDED)),
    ((H100, BF16, "padded", {"attention_dropout": True}), ("varlen", FLASH, FLASH)),
    ((H100, BF16, "flattened", {"attention_dropout": True}), ("varlen", FLASH, FLASH)),
    ((H100, BF16, "padded", {"attention_dropout": True, "flash_window": False}), ("varlen", FLASH, BANDED)),
    ((H100, BF16, "padded", {"varlen_kernel": False}), ("varlen", FLASH, FLASH)),
    ((H100, BF16, "padded", {"attention_dropout": True, "longest": 5}), ("varlen", FLASH, None)),
    ((H100, BF16, "padded", {"backend": "flash_attention_2"}), ("varlen", "flash_attention_2", "flash_attention_2")),
    (
        (H100, BF16, "padded", {"backend": "flash_attention_2", "padding_free": False}),
        ("padded", "flash_attention_2", "flash_attention_2"),
    ),
    ((H100, FP32, "padded", {}), ("padded", "sdpa", BANDED)),
    ((H100, BF16, "padded", {"backend": "flex_attention"}), ("padded", "flex_attention", "flex_attention")),
    (
        (H100, BF16, "padded", {"backend": "flex_attention", "compiling": True}),
        ("padded", "flex_attention", "flex_attention"),
    ),
]


@pytest.mark.parametrize(("cell", "expected"), SLIDING_PLAN_TABLE, ids=[str(i) for i in range(len(SLIDING_PLAN_TABLE))])
def test_the_plan_says_how_sliding_layers_run_in_every_cell(cell, expected):
    device, dtype, inputs, other = cell
    plan = decide_plan(facts(device, dtype, inputs, **{"sliding_window": 4, "longest": 30, **other}))
    assert (plan.kind, plan.attention, plan.sliding) == expected, plan.reason
    assert "sliding layers: " in plan.reason
    name, window = plan.layer_attention("sliding_attention")
    assert (name, window) == ((expected[2], {"sliding_window": 5}) if expected[2] else (expected[1], {}))
    assert plan.layer_attention("full_attention") == (expected[1], {})


def test_without_sliding_layers_the_plan_is_the_one_it_was():
    for device, dtype, inputs in ((CPU, FP32, "padded"), (H100, BF16, "flattened"), (CPU, BF16, "whole")):
        cell = facts(device, dtype, inputs, longest=30)
        assert decide_plan(cell) == dataclasses.replace(decide_plan(cell), sliding=None)
        assert "sliding" not in decide_plan(cell).reason


@pytest.mark.parametrize("route", ["right-padded, padding-free", "flattened rows, one row", "one sequence"])
def test_layer_types_that_are_all_full_change_nothing(route):
    seqs = route_sequences(route)
    inputs, options = ROUTES[route](seqs)
    plain = build(EncoderStackModel, position_embedding_type="rope")
    full = build(
        EncoderStackModel, position_embedding_type="rope", layer_types=["full_attention"] * 3, sliding_window=2
    )
    with torch.no_grad():
        expected, actual = plain(**inputs, **options), full(**inputs, **options)
    torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, atol=0, rtol=0)
    assert full.execution_plan(**inputs, **options).reason == plain.execution_plan(**inputs, **options).reason


def test_a_prepared_4d_mask_with_sliding_layers_is_refused_in_one_line():
    model = windowed(2)
    ids = torch.randint(1, 99, (1, 9))
    with pytest.raises(ValueError, match="4-D `attention_mask` cannot carry the sliding layers' window"):
        model(input_ids=ids, attention_mask=torch.ones(1, 1, 9, 9, dtype=torch.bool))


# The CUDA routes, on CPU: torch's real varlen_attn with kernels for its ops that implement flash's window exactly
# (key j is seen by query i iff i - left <= j <= i + right, -1 meaning no limit) and assert what the model must give
# them; transformers' own translation of the `sliding_window` kwarg for its flash path.

WINDOWS = []


def flash_allowed(length, window_size, is_causal):
    assert type(window_size) is list and len(window_size) == 2, "window_size reaches the op as [left, right]"
    assert all(type(side) is int and side >= -1 for side in window_size), window_size
    left, right = window_size
    assert not is_causal and left == right, "an encoder's window is bidirectional: (w, w), not causal"
    WINDOWS.append(left)
    at = torch.arange(length)
    distance = at[:, None] - at[None]
    return torch.ones(length, length, dtype=torch.bool) if left == -1 else (distance <= left) & (-distance <= right)


def windowed_probabilities(q, k, scale, allowed):
    """(heads, n, n) of one sequence; q, k (n, heads, dim)."""
    scores = scale * q.transpose(0, 1).float() @ k.transpose(0, 1).float().transpose(1, 2)
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1)


def each_sequence(cu_seq_q, *tensors):
    bounds = cu_seq_q.tolist()
    return [[x[a:b] for x in tensors] for a, b in zip(bounds, bounds[1:])]


def attend_windowed(query, key, value, cu_seq_q, scale, window, is_causal=False):
    """Packed (tokens, heads, dim): each sequence alone, under flash's window."""
    out = [
        (windowed_probabilities(q, k, scale, flash_allowed(len(q), window, is_causal)) @ v.transpose(0, 1).float())
        for q, k, v in each_sequence(cu_seq_q, query, key, value)
    ]
    return torch.cat([o.transpose(0, 1) for o in out]).to(query.dtype)


def varlen_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window=None, *_):
    from test_execution_plan import check_flash_contract

    check_flash_contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = attend_windowed(query, key, value, cu_seq_q, scale, window, is_causal)
    return out, torch.zeros(query.shape[1], query.shape[0]), torch.zeros(2, dtype=torch.uint64)


def varlen_backward(grad, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, causal, rng, scale, window):
    from test_execution_plan import check_flash_contract

    check_flash_contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    grads = []
    for g, q, k, v in each_sequence(cu_seq_q, grad, query, key, value):
        p = windowed_probabilities(q, k, scale, flash_allowed(len(q), window, causal))
        g, q, k, v = (x.transpose(0, 1).float() for x in (g, q, k, v))
        dp = g @ v.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        grads.append(
            [x.transpose(0, 1) for x in (scale * ds @ k, scale * ds.transpose(1, 2) @ q, p.transpose(1, 2) @ g)]
        )
    return tuple(torch.cat(parts).to(query.dtype) for parts in zip(*grads))


@pytest.fixture
def windowed_varlen_on_cpu(monkeypatch):
    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", varlen_forward)
    torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", varlen_backward)
    monkeypatch.setattr(execution_encoderstack, "cuda_capability", lambda device: (9, 0))
    monkeypatch.setattr(execution_encoderstack, "GPU_PACKING_MIN_TOKENS", 0)  # the tests' batches are tiny
    WINDOWS.clear()
    return WINDOWS


@pytest.mark.parametrize("route", ["right-padded, padding-free", "flattened rows, packed"])
def test_torchs_varlen_attn_gets_the_window_as_w_w_and_agrees_with_the_banded_path_forward_and_backward(
    route, windowed_varlen_on_cpu
):
    model = windowed(4, hidden_size=64).train()  # head size 16: a flash head size
    seqs = route_sequences(route)
    inputs, options = ROUTES[route](seqs)
    weights = torch.randn(sum(LENGTHS), model.config.hidden_size, generator=torch.Generator().manual_seed(7))
    results = []
    for padding_free in (True, False):  # varlen_attn, then the banded padded batch
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plan = model.execution_plan(**inputs, padding_free=padding_free)
            states = real_rows(model(**inputs, padding_free=padding_free).last_hidden_state, inputs)
        (states.float() * weights).sum().backward()
        results.append(
            (plan, states.float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
    (varlen, states, grads), (banded, expected, expected_grads) = results
    assert (varlen.attention, varlen.sliding, banded.sliding) == (VARLEN, VARLEN, BANDED)
    n = len(seqs)  # one window per sequence and layer, forward then backward
    assert windowed_varlen_on_cpu == ([4] * n + [-1] * n + [4] * n) * 2
    assert (states - expected).abs().max() <= 0.03 * expected.abs().max()  # bfloat16 keeps 8 bits
    for name, grad in expected_grads.items():
        assert (grads[name] - grad).norm() <= 0.03 * grad.norm() + 1e-6, name


def test_transformers_flash_path_gets_ModernBERTs_sliding_window_kwarg_which_it_turns_into_w_w(monkeypatch):
    """transformers' flash path turns `sliding_window` into flash's `window_size` with its own function; the stand-in
    runs that function and attends with the window it gives, per sequence."""
    from transformers.modeling_flash_attention_utils import _process_flash_attention_kwargs

    given = []

    def flash_stand_in(module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kwargs):
        assert attention_mask is None and not module.is_causal
        q, k, v = (x.transpose(1, 2).squeeze(0) for x in (query, key, value))
        flash = _process_flash_attention_kwargs(
            q.shape[0],
            k.shape[0],
            False,
            softmax_scale=scaling,
            sliding_window=sliding_window,
            supports_mapping=collections.defaultdict(bool, window_size=True),  # flash-attn 2 has it
        )
        given.append(flash.get("window_size"))
        window = list(flash.get("window_size", (-1, -1)))
        out = attend_windowed(q, k, v, kwargs["cu_seq_lens_q"], scaling, window)
        return out[None], None

    monkeypatch.setitem(
        execution_encoderstack.ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", flash_stand_in
    )
    model = windowed(4, hidden_size=64)
    seqs = route_sequences("flattened rows, packed")
    with torch.no_grad():
        expected = reference_states(model, seqs, monkeypatch)
        model.config._attn_implementation = "flash_attention_2"
        actual = model(**flattened(seqs)).last_hidden_state[0]
    assert given == [(4, 4), None, (4, 4)]
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_attention_dropout_on_cuda_runs_sliding_layers_in_the_flash_kernels_window(flash_on_cpu):  # noqa: F811  (the fixture)
    model = windowed(4, hidden_size=64, attention_probs_dropout_prob=0.1).train()
    inputs, _ = ROUTES["right-padded, padding-free"](route_sequences("right-padded, padding-free"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = model.execution_plan(**inputs)
        model(**inputs).last_hidden_state.sum().backward()
    assert (plan.attention, plan.sliding) == (FLASH, FLASH), plan.reason
    windows = [call[2] for call in flash_on_cpu]  # layers: sliding, full, sliding; backward in reverse
    assert windows == [(4, 4), (-1, -1), (4, 4)] * 2
    assert {call[1] for call in flash_on_cpu} == {0.1}


def test_an_exported_sliding_window_model_keeps_parity_with_pytorch_on_inputs_longer_than_the_window(tmp_path):
    """The export traces the padded batch with a dense band mask: the window survives in the ONNX graph."""
    from test_exporters import matches_pytorch_on_real_tokens

    from encoderstack import export_onnx

    model = windowed(2, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    folder = export_onnx(model, tmp_path / "onnx")
    inputs = {"input_ids": torch.randint(1, 99, (2, 13)), "token_type_ids": torch.zeros(2, 13, dtype=torch.long)}
    inputs["attention_mask"] = (torch.arange(13) < torch.tensor([[13], [8]])).long()
    exported = matches_pytorch_on_real_tokens(model, folder, inputs)["last_hidden_state"]
    full = windowed(2, num_hidden_layers=2, layer_types=["full_attention"] * 2)  # the same weights, no window
    with torch.no_grad():
        unwindowed = full(**inputs).last_hidden_state
    real = inputs["attention_mask"].bool()
    assert (unwindowed[real] - torch.as_tensor(exported)[real]).abs().max() > 1e-3


def test_sliding_layers_add_no_host_sync_to_a_padded_masked_lm_training_step():
    from test_execution_plan import HostSyncs

    from encoderstack import EncoderStackForMaskedLM

    inputs, _ = ROUTES["right-padded, padding-free"](route_sequences("right-padded, padding-free"))
    labels = torch.where(torch.rand(inputs["input_ids"].shape) < 0.3, inputs["input_ids"], -100)
    counts = []
    for layer_types, window in ((None, None), (SLIDING, 4)):
        model = build(EncoderStackForMaskedLM, layer_types=layer_types, sliding_window=window).train()
        with HostSyncs() as syncs:
            model(**inputs, labels=labels).loss.backward()
        counts.append(syncs.count)
    assert counts[0] == counts[1] == 1  # the plan's one read (test_execution_plan.py)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["modernbert", "ultrabert"])
def test_a_converted_modern_family_matches_its_class_on_inputs_longer_than_its_window(family, backend, tmp_path):
    """Radius 4 (ModernBERT: local_attention=8), 40 tokens, one row padded: the window is the family's on every
    path."""
    import transformers
    from test_convert_modern import FAMILIES, family_folder

    folder = family_folder(tmp_path, family, "Model", radius=4)
    reference = getattr(transformers, FAMILIES[family][0] + "Model").from_pretrained(folder).eval()
    model = EncoderStackModel.from_pretrained(folder).eval()
    assert model.config.sliding_window == 4 and "sliding_attention" in model.config.layer_types
    reference.set_attn_implementation(backend)
    model.set_attn_implementation(backend)
    ids = torch.randint(3, 99, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(40) < torch.tensor([[40], [25]])).long()
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]
        for padding_free in (True, False):
            actual = model(input_ids=ids, attention_mask=mask, padding_free=padding_free).last_hidden_state
            torch.testing.assert_close(actual[mask.bool()], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("route", "backend"),
    [
        *(
            (route, backend)
            for route in ("left-padded, padded batch", "flattened rows, one row")
            for backend in BACKENDS
        ),
        ("flattened rows, one row", "flex_attention"),  # the band and document BlockMask (slow to build on CPU)
    ],
)
def test_the_band_mask_of_recorded_and_compiled_forwards_gives_the_dense_band_masked_softmax(
    route, backend, monkeypatch
):
    """Recording hidden states plans what torch.compile and export get: the backend with the band as a mask (with the
    document mask on flattened rows; flex attention's is a block-sparse BlockMask)."""
    model = windowed(7, attn_implementation=backend)
    seqs = route_sequences(route)
    inputs, options = ROUTES[route](seqs)
    plan = model.execution_plan(**inputs, **options, output_hidden_states=True)
    assert plan.sliding == backend and "band mask" in plan.reason
    with torch.no_grad():
        expected = reference_states(model, seqs, monkeypatch)
        actual = real_rows(model(**inputs, **options, output_hidden_states=True).last_hidden_state, inputs)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
