"""EncoderStack configuration: a BERT-shaped encoder whose normalization placement is a config choice.

Self-contained on purpose (imports only `transformers`): `save_pretrained` copies this file next to the weights so
that `trust_remote_code=True` works on machines without the package.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN


def unscaled(count: int) -> float:
    return 1.0


@dataclass(frozen=True)
class Placement:
    """One normalization placement's row, the whole of its math: the norms around each sublayer F, the scales on its
    shortcut, branch and input as functions of the depth N (or of the 1-based layer l), the init, ResiDual's second
    stream, and, for placements whose sublayers differ, the row each sublayer follows. The README gives the
    equations."""

    norm_in: bool = False  # F(LN(h))
    norm_branch: bool = False  # LN(F(.)) before the residual add
    norm_out: bool = False  # LN(h + F(.))
    final_norm: bool = False  # one more norm after the last layer
    dual_stream: bool = False  # ResiDual: also accumulate the un-normalized sum of every F
    qkv_norm: bool = False  # HybridNorm: attention normalizes each head's query, key and value
    # Admin: a learnable per-feature shortcut scale, h -> LN(omega * h + F(h)), which a profiling pass on a batch sets
    # before training (`prepare_for_training`, `profile_admin`)
    omega: bool = False
    alpha: Callable[[int], float] = unscaled  # h -> LN(alpha(N) h + F(.)); DeepScaleLM's lambda
    branch_scale: Callable[[int], float] = unscaled  # h -> h + beta(N) F(.), DeepScaleLM's beta
    input_scale: Callable[[int], float] = unscaled  # F(scale(l) LN(h)), l the 1-based layer: LayerNorm Scaling
    init_gain: Callable[[int], float] = unscaled  # on the init std of every branch projection (value, output, FFN)
    fan_in_init: bool = False  # every projection of a layer starts from normal(0, 1/fan_in): DeepScaleLM
    # (config, 0-based layer index, "attention" or "mlp") -> the row that sublayer follows; None: this row
    per_sublayer: Callable[["EncoderStackConfig", int, str], "Placement"] | None = None

    def at(self, config: "EncoderStackConfig", layer_idx: int, sublayer: str) -> "Placement":
        return self if self.per_sublayer is None else self.per_sublayer(config, layer_idx, sublayer)

    def init_std(self, config: "EncoderStackConfig", fan_in: int, branch: bool) -> float | None:
        """The init std of a projection in a sublayer that follows this row; None: BERT's `initializer_range`."""
        if self.fan_in_init:
            return fan_in**-0.5
        gain = self.init_gain(config.num_hidden_layers)
        return config.initializer_range * gain if branch and gain != 1.0 else None


def mix_ln(config: "EncoderStackConfig", layer_idx: int, sublayer: str) -> Placement:
    """Mix-LN: post-LN in the first floor(mix_ln_ratio * N) layers, pre-LN after."""
    post_layers = math.floor(config.mix_ln_ratio * config.num_hidden_layers)
    return PLACEMENTS["post"] if layer_idx < post_layers else PLACEMENTS["pre"]


def hybrid_norm(config: "EncoderStackConfig", layer_idx: int, sublayer: str) -> Placement:
    """HybridNorm, x' = x + Attn(QKV-norm); x = LN(x') + FFN(LN(x')): written per sublayer, the norm after the
    attention's add, and a plain residual around the feed-forward network (its input and shortcut are that norm)."""
    return Placement(norm_out=True, qkv_norm=True) if sublayer == "attention" else Placement()


def hybrid_norm_star(config: "EncoderStackConfig", layer_idx: int, sublayer: str) -> Placement:
    """HybridNorm*: the first layer pre-LN around both sublayers (its attention keeps the QKV-norm)."""
    if layer_idx == 0:
        return Placement(norm_in=True, qkv_norm=sublayer == "attention")
    return hybrid_norm(config, layer_idx, sublayer)


def pre_skip_first(config: "EncoderStackConfig", layer_idx: int, sublayer: str) -> Placement:
    """ModernBERT's pre-LN: the first attention reads the normalized embeddings without a norm of its own."""
    return Placement() if (layer_idx, sublayer) == (0, "attention") else PLACEMENTS["pre"]


@dataclass(frozen=True)
class PlacementEntry:
    """A placement as the package knows it: its row, its one-line equation (the model card; the README gives it in
    full), its Hub tag and its colour in the diagnostics plots (a matplotlib colour name)."""

    row: Placement
    equation: str
    tag: str
    colour: str


SANDWICH = Placement(norm_in=True, norm_branch=True, final_norm=True)
# The one registry of placements: `norm_placement` accepts its names, in this order.
PLACEMENT_REGISTRY = {
    "post": PlacementEntry(Placement(norm_out=True), "`h = LN(h + Drop(F(h)))`, as BERT", "post-ln", "tab:red"),
    "pre": PlacementEntry(
        Placement(norm_in=True, final_norm=True), "`h = h + Drop(F(LN(h)))`, then a final `LN`", "pre-ln", "tab:blue"
    ),
    "sandwich": PlacementEntry(
        SANDWICH, "`h = h + Drop(LN_out(F(LN_in(h))))`, then a final `LN`", "sandwich-ln", "tab:green"
    ),
    "deepnorm": PlacementEntry(
        Placement(norm_out=True, alpha=lambda n: (2 * n) ** 0.25, init_gain=lambda n: (8 * n) ** -0.25),
        "`h = LN(α·h + Drop(F(h)))` with `α = (2N)^(1/4)`",
        "deepnorm",
        "tab:purple",
    ),
    "resi_dual": PlacementEntry(
        Placement(norm_out=True, final_norm=True, dual_stream=True),
        "`f = Drop(F(a)); a = LN(a + f); d = d + f`, output `a + LN_final(d)`",
        "resi-dual",
        "tab:orange",
    ),
    "peri": PlacementEntry(  # Peri-LN is the literature's name for the sandwich block
        SANDWICH,
        "`h = h + Drop(LN_out(F(LN_in(h))))`, then a final `LN` (the same block as `sandwich`)",
        "peri-ln",
        "tab:brown",
    ),
    "mix": PlacementEntry(
        Placement(final_norm=True, per_sublayer=mix_ln),
        "`post` in layers `l ≤ ⌊mix_ln_ratio·N⌋`, `pre` after, then a final `LN`",
        "mix-ln",
        "tab:pink",
    ),
    "lns": PlacementEntry(
        Placement(norm_in=True, final_norm=True, input_scale=lambda layer: layer**-0.5),
        "`h = h + Drop(F(LN(h) / √l))`, `l` the 1-based layer, then a final `LN`",
        "layernorm-scaling",
        "tab:gray",
    ),
    "hybrid": PlacementEntry(
        Placement(final_norm=True, per_sublayer=hybrid_norm),
        "`h = h + Drop(Attn(LN_q(q), LN_k(k), LN_v(v)))`, then `h = LN(h)`, `h = h + Drop(FFN(h))`; final `LN`",
        "hybridnorm",
        "tab:olive",
    ),
    "hybrid_star": PlacementEntry(
        Placement(final_norm=True, per_sublayer=hybrid_norm_star),
        "`hybrid`, with layer 1 `pre` (and its QKV norms); then a final `LN`",
        "hybridnorm-star",
        "tab:cyan",
    ),
    "admin": PlacementEntry(
        Placement(norm_out=True, omega=True),
        "`h = LN(ω ⊙ h + Drop(F(h)))`, `ω` set by `profile_admin` on a batch",
        "admin",
        "black",
    ),
    "deepscale": PlacementEntry(
        Placement(
            norm_in=True,
            final_norm=True,
            alpha=lambda n: (1 - 1 / n) ** 0.5,
            branch_scale=lambda n: (1 / n) ** 0.5,
            fan_in_init=True,
        ),
        "`h = λ·h + β·Drop(F(LN(h)))`, `β² = 1/N`, `λ² = 1 − β²`, then a final `LN`",
        "deepscalelm",
        "gold",
    ),
    "pre_skip_first": PlacementEntry(
        Placement(final_norm=True, per_sublayer=pre_skip_first),
        "`pre`, except that layer 1's attention reads `h` itself (the embedding norm serves)",
        "pre-ln",
        "teal",
    ),
}
PLACEMENTS = {name: entry.row for name, entry in PLACEMENT_REGISTRY.items()}
PLACEMENT_EQUATIONS = {name: entry.equation for name, entry in PLACEMENT_REGISTRY.items()}
NormPlacement = Literal[tuple(PLACEMENT_REGISTRY)]
NORM_PLACEMENTS = get_args(NormPlacement)
GATED_ACTIVATIONS = {"geglu": "gelu", "swiglu": "silu"}


@dataclass(frozen=True)
class Heads:
    """The parts of the task heads that differ between the BERT-family layouts (`config.head_layout`), the way
    `Placement` holds a placement: what feeds the sequence-level classifiers (None: BERT's pooler in the encoder; an
    activation: the head's own dense layer and that activation on the first token, without a pooler) and the
    masked-LM head's activation (None: `hidden_act`); whether the bare encoder has BERT's pooler at all; whether the
    per-token classifiers also get the dense layer and activation first, and whether a norm follows them (ModernBERT's
    prediction head); and what the masked-LM head is: `"transform"` (dense, activation, norm, decoder: BERT's),
    `"decoder"` (the decoder alone) or `"two_layer"` (dense, activation, dense back, activation, decoder); and which
    sentence-pair task the pre-training head predicts."""

    sequence: str | None = None  # sequence classification
    choice: str | None = None  # multiple choice
    token: str | None = None  # token classification and question answering
    lm_act: str | None = None
    pooler: bool = True
    transform_norm: bool = False
    lm: str = "transform"
    # the pre-training head's sentence-pair task on the pooled output: BERT's next sentence, ALBERT's sentence order
    sentence_pair: Literal["next_sentence", "sentence_order"] = "next_sentence"


# The one registry of head layouts: `head_layout` accepts its names, in this order.
HEADS = {
    "bert": Heads(),
    "roberta": Heads(sequence="tanh", lm_act="gelu"),  # multiple choice keeps the pooler, as RoBERTa's does
    "electra": Heads(sequence="gelu", choice="gelu", lm_act="gelu", pooler=False),
    "distilbert": Heads(sequence="relu", choice="relu", pooler=False),
    "modernbert": Heads(sequence="gelu", choice="gelu", token="gelu", lm_act="gelu", pooler=False, transform_norm=True),
    "eurobert": Heads(sequence="gelu", pooler=False, lm="decoder"),
    "ultrabert": Heads(lm_act="gelu_pytorch_tanh", pooler=False, lm="two_layer"),
    "neobert": Heads(sequence="tanh", pooler=False, lm="decoder"),
    "deberta": Heads(sequence="gelu", choice="gelu", pooler=False),  # its ContextPooler; BERT's masked-LM head
    "albert": Heads(sentence_pair="sentence_order"),
}
HeadLayout = Literal[tuple(HEADS)]
HEAD_LAYOUTS = get_args(HeadLayout)
LayerType = Literal["full_attention", "sliding_attention"]  # transformers' names
LAYER_TYPES = get_args(LayerType)
CpuKernels = Literal["torch", "onednn", "onednn-prepacked"]
CPU_KERNELS = get_args(CpuKernels)
ClassifierPooling = Literal["first", "mean", "late"]
AttentionProjection = Literal["query", "key", "value", "output", "position_key", "position_query"]


@strict
class EncoderStackConfig(PreTrainedConfig):
    r"""
    Configuration of an EncoderStack model. Fields shared with `BertConfig` keep BERT's names and meaning, so a BERT
    config maps onto this one field by field; the defaults describe bert-base-uncased with post-LN.

    norm_placement (`str`, defaults to `"post"`):
        Where each sublayer's normalization sits: `"post"` (BERT), `"pre"`, `"sandwich"` (also named `"peri"`),
        `"deepnorm"`, `"resi_dual"`, `"mix"`, `"lns"`, `"hybrid"`, `"hybrid_star"`, `"admin"`, `"deepscale"` or
        `"pre_skip_first"` (pre-LN whose first attention has no input norm: ModernBERT's, where the embedding norm
        serves). The README gives the equation of each.
    norm_type (`str`, defaults to `"layernorm"`):
        `"layernorm"`, `"rmsnorm"`, `"dyt"` (`weight * tanh(alpha * x) + bias`) or `"derf"`
        (`weight * erf(alpha * x + shift) + bias`), for every norm in the model; `alpha` and `shift` are learnable
        scalars of each norm.
    dyt_alpha_init (`float`, defaults to 0.5):
        The initial `alpha` of every `"dyt"` or `"derf"` norm (`shift` starts at 0).
    mix_ln_ratio (`float`, defaults to 0.25):
        Mix-LN only: the share of the layers, from the first, that are post-LN (`floor(mix_ln_ratio * N)` of them);
        the rest are pre-LN.
    embedding_norm (`bool`, defaults to `True`):
        Normalize the summed embeddings (BERT does; Megatron-BERT does not).
    position_embedding_type (`str`, *optional*, defaults to `"absolute"`):
        `"absolute"` (learned), `"sinusoidal"` (fixed, as in the 2017 Transformer), `"rope"` (rotary) or `None`: no
        positions at the input (DeBERTa-v3's `position_biased_input=False`, where `relative_attention` alone places
        the tokens).
    rope_theta (`float`, defaults to 10000.0):
        Base of the rotary frequencies, used with `position_embedding_type="rope"` where `rope_parameters` names
        none.
    rope_parameters (`dict`, *optional*):
        Rotary positions only: transformers' rotary parameters, kept in the form given. Flat, for every layer type
        (`{"rope_type": "default", "rope_theta": 1e4}`; `rope_type` one of transformers' `ROPE_INIT_FUNCTIONS`, with
        its own keys, e.g. `"factor"`; `"partial_rotary_factor"` rotates that leading share of each head), or one
        dict per layer type (`{"full_attention": {...}, "sliding_attention": {...}}`: ModernBERT's global and local
        bases). `rope_theta` fills a missing base; `None` is `{"rope_type": "default", "rope_theta": rope_theta}`. A
        config without rotary positions has no `rope_parameters` attribute (as transformers' configs of models without
        RoPE), so transformers' RoPE tests skip it. The frequencies are transformers' own functions'.
    num_key_value_heads (`int`, *optional*):
        Grouped-query attention: the number of key/value heads, each shared by `num_attention_heads /
        num_key_value_heads` query heads (EuroBERT). `None`: one per query head.
    attention_bias (`bool` or `list[str]`, defaults to `True`):
        Whether the query, key, value and output projections (and `relative_attention="disentangled"`'s position
        projections) have biases (BERT's do; ModernBERT's, EuroBERT's not), or the list of those that have one, by
        name: `"query"`, `"key"`, `"value"`, `"output"`, `"position_key"`, `"position_query"` (DeBERTa v1: every one
        but the key and the position key).
    mlp_bias (`bool` or `"down"`, defaults to `True`):
        Which feed-forward projections have biases: all (`True`), none (`False`), or `"down"`, the output projection
        only (GTE's).
    norm_bias (`bool`, defaults to `True`):
        Whether every LayerNorm has a bias (ModernBERT's have none).
    resi_dual_scale (`float`, defaults to 1.0):
        ResiDual only: constant factor on every update of the un-normalized stream. The final norm makes it
        exact in real arithmetic; a value below 1 keeps that stream from overflowing in low precision.
    padding_free (`bool`, defaults to `True`):
        When the attention mask has padding, run on the real tokens only: gather them once into one packed row, do
        the position-wise work on them and attention per sequence (one call per sequence on CPU, one varlen kernel
        call on a GPU that has one), scatter once at the end (padded positions of every per-token output are then
        0). Same numbers on real tokens; `False` runs the padded batch as BERT does (flattened rows then get a
        block-diagonal mask). The `padding_free` argument of `forward` overrides it per call.
    position_offset (`int`, *optional*):
        `None` (BERT): positions count 0, 1, ... along each row, whatever its padding. An integer k (RoBERTa, XLM-R,
        CamemBERT: `pad_token_id + 1`): the real tokens of each sequence count k, k + 1, ..., so that left and right
        padding give the same positions; `position_ids` below k are refused.
    embedding_size (`int`, *optional*):
        The width of the embeddings (ELECTRA-small: 128); where it differs from `hidden_size`, a linear projection
        follows them, and the masked-LM head predicts from this width (tied to the word embeddings). `None`: the
        hidden size.
    head_layout (`str`, defaults to `"bert"`):
        What the sequence-level and masked-LM heads are made of, as in the family the weights come from: `"bert"`
        (the pooler, tanh(dense(first token)), feeds the classifier), `"roberta"` (sequence classification: dense,
        tanh and the classifier on the first token, no pooler; masked-LM activation gelu), `"electra"` (dense, gelu,
        classifier on the first token for sequence classification and multiple choice; no pooler anywhere) or
        `"distilbert"` (dense, ReLU, classifier; no pooler). `type_vocab_size=0` means no token-type embeddings
        (DistilBERT), and `token_type_ids` ignored, as its classes ignore them. `"modernbert"`: each classification head
        runs dense, gelu and norm (ModernBERT's prediction head) on its pooled or per-token features, the masked-LM head
        dense, gelu, norm and the decoder; `"eurobert"`: sequence classification dense and gelu on the pooled features,
        the masked-LM head the decoder alone; `"ultrabert"`: the classifiers on the pooled or per-token features
        directly, the masked-LM head two projections through `prediction_head_size`, each followed by gelu (tanh);
        `"neobert"`: sequence classification dense and tanh on the first token, the masked-LM head the decoder alone;
        `"deberta"`: DeBERTa's ContextPooler (dense and gelu on the first token) for sequence classification and
        multiple choice, BERT's masked-LM head. No pooler in these five. `"albert"`: BERT's heads, with a
        sentence-order head (ALBERT's) in place of the next-sentence head in pre-training.
    classifier_pooling (`str`, defaults to `"first"`):
        What the sequence-level heads read: `"first"` (each sequence's first real token), `"mean"` (the mean of its
        real tokens) or `"late"` (EuroBERT: the head's logits on every real token, averaged).
    classifier_bias (`bool`, defaults to `True`):
        Whether the heads' dense layers (the masked-LM transform, a layout's classification transform) have biases.
    decoder_bias (`bool`, defaults to `True`):
        Whether the masked-LM decoder has a bias.
    cpu_kernels (`str`, defaults to `"torch"`):
        Which library runs float32 on the CPU: `"torch"` (its linear, MKL's GEMM, and its SDPA kernel: the reference
        classes' own kernels, so a converted model gives their numbers) or `"onednn"` (oneDNN: projections with exact
        GELU fused into the up-projection, 2x faster on an AMD EPYC with AVX-512, 1.15x on Intel cores; and in
        inference attention as one oneDNN Graph kernel, 1.7-2.0x SDPA per layer; other reduction orders, ~1e-5 from the
        reference on a bert-large-sized model). bf16 runs in oneDNN either way where the CPU has native bf16.
        `"onednn-prepacked"`: as `"onednn"`, and inference (float32 and bf16) reads each projection's weight from a
        copy in oneDNN's blocked layout, made on first use and remade when the weight changes: the same numbers,
        1.07-1.22x faster GEMMs, twice the projection weights' memory. Change it on a built model with
        `model.set_cpu_kernels(...)`. (`cpu_linear`, its name before, is read as it.)
    prediction_head_size (`int`, *optional*):
        `head_layout="ultrabert"` only: the width between the masked-LM head's two projections; `None`: the hidden
        size.
    layer_types (`list[str]`, *optional*):
        Each layer's attention, named as in transformers: `"full_attention"` (a token sees every token of its
        sequence) or `"sliding_attention"` (a token sees the tokens within `sliding_window` of it). `None`: every
        layer full.
    sliding_window (`int`, *optional*):
        The radius of the sliding layers, the one convention of this model: query i attends to key j when
        |i - j| <= sliding_window, 2 * sliding_window + 1 keys in all. ModernBERT's `local_attention=128` is 64 here;
        UltraBERT's `sliding_window` is this radius already. Needed when a layer slides.
    relative_attention (`str`, *optional*):
        A relative-position term added to every layer's attention scores, from the distances between each sequence's
        tokens: `None` (none), `"bias"` (MPNet's: one learned bias per head for each bucket of the key-minus-query
        distance, T5's bidirectional buckets, computed once per forward and shared by the layers) or `"disentangled"`
        (DeBERTa's: relative-position embeddings shared by the layers, which each layer projects with its own query
        and key projections, adding content-to-position `c2p` (its queries against the key's distance) and
        position-to-content `p2c` (its keys against the query's distance) terms; the scores are then scaled by
        `sqrt(head_dim * (1 + len(pos_att_type)))`). It runs on the eager and sdpa backends (as an additive float
        mask); flash kernels take no score term, so the execution plan picks a path that does and says so.
    relative_attention_num_buckets (`int`, defaults to 32):
        `relative_attention="bias"`: the number of distance buckets, half for each direction; of each half, the
        first half counts distances exactly and the rest grow logarithmically up to `relative_attention_max_distance`.
    relative_attention_max_distance (`int`, defaults to 128):
        `relative_attention="bias"`: the distance from which every farther key shares the last bucket.
    position_buckets (`int`, *optional*):
        `relative_attention="disentangled"`: DeBERTa's log buckets, `position_buckets` each way (256 in DeBERTa-v3):
        the query-minus-key distances up to half of them count exactly, farther ones logarithmically up to
        `max_relative_positions`. `None`: no buckets, each distance its own embedding up to `max_relative_positions`.
    max_relative_positions (`int`, *optional*):
        `relative_attention="disentangled"`: the distance the buckets reach (or, without buckets, the farthest
        distance told apart). `None`: `max_position_embeddings`.
    share_att_key (`bool`, defaults to `False`):
        `relative_attention="disentangled"`: the relative-position embeddings are projected by the layer's own query
        and key projections (DeBERTa-v3), not by projections of their own.
    pos_att_type (`list[str]`, *optional*):
        `relative_attention="disentangled"`: the terms, `"c2p"` and/or `"p2c"`.
    norm_rel_ebd (`str`, defaults to `"none"`):
        `relative_attention="disentangled"`: `"layer_norm"` normalizes the relative-position embeddings once per
        forward (DeBERTa-v3), `"none"` leaves them as they are.
    num_hidden_groups (`int`, *optional*):
        Layer sharing, ALBERT's: the layers, in blocks of `inner_group_num`, are split in order into this many
        groups, and every block of a group runs the same `inner_group_num` stored layers (block b of B uses group
        `int(b / (B / num_hidden_groups))`, as ALBERT's). Each stored layer is saved once, and its gradient sums over
        its uses. `num_hidden_layers` counts the layers run (ALBERT's counts the blocks: an ALBERT config has
        `inner_group_num` times fewer). `None`: every layer its own weights. Layers that share weights share their
        norm placement row, layer type and scales too: a config where these differ between them (Mix-LN across a
        group boundary, LayerNorm Scaling, Admin's profiled scales, ModernBERT's first layer) is refused.
    inner_group_num (`int`, defaults to 1):
        The distinct layers in each group, run in order (ALBERT's); `num_hidden_layers` must be a multiple of it.
    sparse_prediction (`bool`, defaults to `True`):
        Masked-LM heads in training with labels run the prediction head, its logits and the loss on the labelled
        tokens only (as ModernBERT's `sparse_prediction`): the same loss, a fraction of the vocabulary projection's
        work. `logits` then hold one row per labelled token, in order; in eval mode they are always per token.
    """

    model_type = "encoderstack"

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float | int = 0.1
    attention_probs_dropout_prob: float | int = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    classifier_dropout: float | int | None = None
    tie_word_embeddings: bool = True
    norm_placement: NormPlacement = "post"
    norm_type: Literal["layernorm", "rmsnorm", "dyt", "derf"] = "layernorm"
    dyt_alpha_init: float | int = 0.5
    mix_ln_ratio: float | int = 0.25
    embedding_norm: bool = True
    position_embedding_type: Literal["absolute", "sinusoidal", "rope"] | None = "absolute"
    rope_theta: float | int = 10000.0
    resi_dual_scale: float | int = 1.0
    padding_free: bool = True
    sparse_prediction: bool = True
    position_offset: int | None = None
    embedding_size: int | None = None
    head_layout: HeadLayout = "bert"
    layer_types: list[LayerType] | None = None
    sliding_window: int | None = None
    num_key_value_heads: int | None = None
    attention_bias: bool | list[AttentionProjection] = True
    mlp_bias: bool | Literal["down"] = True
    norm_bias: bool = True
    classifier_pooling: ClassifierPooling = "first"
    classifier_bias: bool = True
    decoder_bias: bool = True
    prediction_head_size: int | None = None
    cpu_kernels: CpuKernels = "torch"
    relative_attention: Literal["bias", "disentangled"] | None = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    position_buckets: int | None = None
    max_relative_positions: int | None = None
    share_att_key: bool = False
    pos_att_type: list[Literal["c2p", "p2c"]] | None = None
    norm_rel_ebd: Literal["none", "layer_norm"] = "none"
    num_hidden_groups: int | None = None
    inner_group_num: int = 1

    def __post_init__(self, **kwargs):
        # Not a field: only a rotary config has the attribute, which transformers then standardizes (flat or per type)
        rope_parameters = kwargs.pop("rope_parameters", None)
        if rope_parameters is not None or self.position_embedding_type == "rope":
            self.rope_parameters = rope_parameters
        if "cpu_linear" in kwargs:  # configs saved before the field covered attention too
            self.cpu_kernels = kwargs.pop("cpu_linear")
        super().__post_init__(**kwargs)

    def convert_rope_params_to_dict(self, **kwargs):
        if not isinstance(self.rope_parameters, dict | None):
            return kwargs  # left for validation to name
        return super().convert_rope_params_to_dict(**kwargs)

    def nested_rope_parameter_keys(self, rope_parameters):
        """Keys naming a layer type, declared or not: configs saved before `rope_parameters` kept the flat form spelled
        it out per layer type whatever `layer_types` said."""
        return [key for key in rope_parameters if key in LAYER_TYPES]

    def rope_parameters_by_type(self) -> dict:
        """{layer type: that type's rotary parameters}, each with its `rope_type` and `rope_theta`: a flat
        `rope_parameters` (even one assigned after `__init__`) serves every layer type."""
        given = getattr(self, "rope_parameters", None) or {}
        nested = self.nested_rope_parameter_keys(given)
        return {
            layer_type: {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                **dict(given.get(layer_type) or {} if nested else given),
            }
            for layer_type in LAYER_TYPES
        }

    def stored_layer_of(self) -> list[int]:
        """For each layer in order, the stored layer whose weights it runs: its own index without sharing; ALBERT's
        grouping with `num_hidden_groups`."""
        inner = self.inner_group_num
        blocks = self.num_hidden_layers // inner
        groups = self.num_hidden_groups or blocks
        return [int(block / (blocks / groups)) * inner + j for block in range(blocks) for j in range(inner)]

    def check_layer_sharing(self):
        """Layers that run the same stored layer must agree on what the layer's construction reads from its index."""
        inner = self.inner_group_num
        if inner <= 0 or self.num_hidden_layers % inner:
            raise ValueError(
                f"`inner_group_num` must be a positive divisor of `num_hidden_layers` ({self.num_hidden_layers}), got "
                f"{inner}."
            )
        blocks = self.num_hidden_layers // inner
        if self.num_hidden_groups is not None and not 0 < self.num_hidden_groups <= blocks:
            raise ValueError(
                f"`num_hidden_groups` must lie in [1, {blocks}] (`num_hidden_layers` / `inner_group_num`) or be None, "
                f"got {self.num_hidden_groups}."
            )
        placement = PLACEMENTS[self.norm_placement]

        def built_from(index):
            rows = [placement.at(self, index, sublayer) for sublayer in ("attention", "mlp")]
            layer_type = self.layer_types[index] if self.layer_types is not None else "full_attention"
            return layer_type, *rows, *(row.input_scale(index + 1) for row in rows)

        first = {}
        for index, stored in enumerate(self.stored_layer_of()):
            shared_with = first.setdefault(stored, index)
            if shared_with == index:
                continue
            if placement.omega:
                raise ValueError(
                    "norm_placement 'admin' profiles a shortcut scale for every layer; with layer sharing "
                    f"(`num_hidden_groups` {self.num_hidden_groups}) layers {shared_with} and {index} would share one."
                )
            names = ("layer type", "attention's norm row", "FFN's norm row", "attention's scale", "FFN's scale")
            differ = [name for name, a, b in zip(names, built_from(shared_with), built_from(index)) if a != b]
            if differ:
                raise ValueError(
                    f"Layers {shared_with} and {index} share weights (`num_hidden_groups` {self.num_hidden_groups}, "
                    f"`inner_group_num` {inner}) but differ in their {' and '.join(differ)} (norm_placement "
                    f"{self.norm_placement!r}, `layer_types`): layers that share weights must be built alike."
                )

    def validate_architecture(self):
        """Part of `@strict` validation: every message names the field and the offending value."""
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"`{name}` must be a positive integer, got {getattr(self, name)}.")
        if self.type_vocab_size < 0:
            raise ValueError(f"`type_vocab_size` must be 0 (no token types) or more, got {self.type_vocab_size}.")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"`pad_token_id` must be None or an id of the vocabulary, in [0, {self.vocab_size - 1}] "
                f"(`vocab_size` {self.vocab_size}), got {self.pad_token_id}."
            )
        if self.embedding_size is not None and self.embedding_size <= 0:
            raise ValueError(f"`embedding_size` must be a positive integer or None, got {self.embedding_size}.")
        if self.position_offset is not None and not 0 <= self.position_offset < self.max_position_embeddings:
            raise ValueError(
                f"`position_offset` must lie in [0, {self.max_position_embeddings - 1}] (below "
                f"`max_position_embeddings`), got {self.position_offset}."
            )
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                f"({self.num_attention_heads})."
            )
        if self.hidden_act not in (*ACT2FN, *GATED_ACTIVATIONS):
            raise ValueError(
                f"Unknown `hidden_act` {self.hidden_act!r}; expected one of {sorted((*ACT2FN, *GATED_ACTIVATIONS))}."
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1:
                raise ValueError(f"`{name}` must lie in [0, 1), got {value}.")
        if self.position_embedding_type == "rope" and (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(
                f"Rotary positions need an even head size, got {self.hidden_size // self.num_attention_heads}."
            )
        kv_heads = self.num_key_value_heads
        if kv_heads is not None and (kv_heads <= 0 or self.num_attention_heads % kv_heads):
            raise ValueError(
                f"`num_key_value_heads` ({kv_heads}) must be a positive divisor of `num_attention_heads` "
                f"({self.num_attention_heads})."
            )
        if hasattr(self, "rope_parameters"):
            self.check_rope_parameters()
        if self.prediction_head_size is not None and self.prediction_head_size <= 0:
            raise ValueError(
                f"`prediction_head_size` must be a positive integer or None, got {self.prediction_head_size}."
            )
        if not 0 <= self.mix_ln_ratio <= 1:
            raise ValueError(f"`mix_ln_ratio` must lie in [0, 1], got {self.mix_ln_ratio}.")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"`layer_types` names {len(self.layer_types)} layers, but `num_hidden_layers` is "
                f"{self.num_hidden_layers}."
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"`sliding_window` must be a positive integer or None, got {self.sliding_window}.")
        if "sliding_attention" in (self.layer_types or ()) and self.sliding_window is None:
            raise ValueError("`layer_types` has sliding layers, but `sliding_window` (their radius) is not set.")
        if self.relative_attention is not None:
            self.check_relative_attention()
        for name in ("layer_norm_eps", "initializer_range", "rope_theta", "resi_dual_scale", "dyt_alpha_init"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"`{name}` must be a positive finite number, got {getattr(self, name)}.")
        self.check_layer_sharing()

    def check_relative_attention(self):
        if "sliding_attention" in (self.layer_types or ()):
            raise ValueError("`relative_attention` does not combine with sliding layers (`layer_types`).")
        if self.relative_attention == "disentangled":
            return self.check_disentangled_attention()
        buckets, distance = self.relative_attention_num_buckets, self.relative_attention_max_distance
        if buckets < 4:
            raise ValueError(
                f"`relative_attention_num_buckets` must be at least 4 (half each way, of each half the first half "
                f"exact), got {buckets}."
            )
        if distance <= buckets // 4:
            raise ValueError(
                f"`relative_attention_max_distance` must exceed the {buckets // 4} distances counted exactly, got "
                f"{distance}."
            )

    def check_disentangled_attention(self):
        terms = self.pos_att_type or []
        if not terms or len(set(terms)) != len(terms):
            raise ValueError(
                f"relative_attention='disentangled' needs `pos_att_type`, 'c2p' and/or 'p2c' once each, got {terms!r}."
            )
        for name in ("position_buckets", "max_relative_positions"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"`{name}` must be a positive integer or None, got {getattr(self, name)}.")
        reach = self.max_relative_positions or self.max_position_embeddings
        if self.position_buckets is not None and reach <= self.position_buckets // 2 + 1:
            raise ValueError(
                f"`max_relative_positions` ({reach}) must exceed the {self.position_buckets // 2 + 1} distances the "
                f"{self.position_buckets} `position_buckets` count exactly."
            )
        if self.num_key_value_heads not in (None, self.num_attention_heads):
            raise ValueError(
                "relative_attention='disentangled' projects the positions with every head's key: grouped-query "
                f"attention (`num_key_value_heads` {self.num_key_value_heads}) is not supported."
            )

    def check_rope_parameters(self):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if self.position_embedding_type != "rope":
            raise ValueError(
                "`rope_parameters` needs rotary positions (position_embedding_type='rope'), got "
                f"{self.position_embedding_type!r}."
            )
        if not isinstance(self.rope_parameters, dict):
            raise ValueError(f"`rope_parameters` must be a dict or None, got {self.rope_parameters!r}.")
        unknown = [key for key in self.rope_parameters if key not in LAYER_TYPES]
        if unknown and any(key in LAYER_TYPES for key in self.rope_parameters):
            raise ValueError(f"`rope_parameters` names {unknown}, which are not layer types {list(LAYER_TYPES)}.")
        for layer_type, parameters in self.rope_parameters_by_type().items():
            rope_type = parameters["rope_type"]
            if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(
                    f"`rope_parameters` ({layer_type}): unknown rope_type {rope_type!r}; expected 'default' or one of "
                    f"{sorted(ROPE_INIT_FUNCTIONS)}."
                )
            theta = parameters["rope_theta"]
            if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
                raise ValueError(
                    f"`rope_parameters` ({layer_type}): rope_theta must be a positive number, got {theta}."
                )
            share = parameters.get("partial_rotary_factor", 1.0)
            if not (isinstance(share, (int, float)) and 0 < share <= 1):
                raise ValueError(
                    f"`rope_parameters` ({layer_type}): partial_rotary_factor must lie in (0, 1], got {share}."
                )


__all__ = ["EncoderStackConfig"]
