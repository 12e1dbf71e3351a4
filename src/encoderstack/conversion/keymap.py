"""What a BERT-family checkpoint is in EncoderStack terms: the key map, the tasks, and the config fields.

Everything here is data. The map is a list of (BERT key, EncoderStack key) templates that reads both ways, so
`convert` and `export_bert` share it; `{i}` stands for a layer index (ALBERT's `{g}` and `{j}`: a group and a layer in
it) and `{p}` for `weight` or `bias`. BERT keys are written without the `bert.` prefix of its heads, EncoderStack keys
without the `model.` prefix of ours. Where a
target is not one source tensor as it is, the EncoderStack side is a `Piece` (some rows of the source, or one row
block of the target), or a tuple of them when one source tensor feeds several targets (a fused QKV projection).
`FAMILIES` holds every source family (BERT, Megatron-BERT, RoBERTa and its kin): its class and key prefixes, the
EncoderStack fields its layout implies, and where its keys differ from BERT's.
"""

import dataclasses
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from ..configuration_encoderstack import HEADS


class ConversionError(ValueError):
    """A checkpoint that cannot be converted as asked; the message names the file and the key."""


ENCODER_KEYS = [
    ("embeddings.word_embeddings.weight", "embeddings.word_embeddings.weight"),
    ("embeddings.position_embeddings.weight", "embeddings.position_embeddings.weight"),
    ("embeddings.token_type_embeddings.weight", "embeddings.token_type_embeddings.weight"),
    ("embeddings.LayerNorm.{p}", "embeddings.norm.{p}"),
    ("encoder.layer.{i}.attention.self.query.{p}", "layers.{i}.attention.query.{p}"),
    ("encoder.layer.{i}.attention.self.key.{p}", "layers.{i}.attention.key.{p}"),
    ("encoder.layer.{i}.attention.self.value.{p}", "layers.{i}.attention.value.{p}"),
    ("encoder.layer.{i}.attention.output.dense.{p}", "layers.{i}.attention.output.{p}"),
    ("encoder.layer.{i}.attention.output.LayerNorm.{p}", "layers.{i}.attention_residual.norm_out.{p}"),
    ("encoder.layer.{i}.intermediate.dense.{p}", "layers.{i}.mlp.up.{p}"),
    ("encoder.layer.{i}.output.dense.{p}", "layers.{i}.mlp.down.{p}"),
    ("encoder.layer.{i}.output.LayerNorm.{p}", "layers.{i}.mlp_residual.norm_out.{p}"),
    # Megatron-BERT moves the norms in front of each sublayer and adds a final one (pre-LN).
    ("encoder.layer.{i}.attention.ln.{p}", "layers.{i}.attention_residual.norm_in.{p}"),
    ("encoder.layer.{i}.ln.{p}", "layers.{i}.mlp_residual.norm_in.{p}"),
    ("encoder.ln.{p}", "final.norm.{p}"),
    ("pooler.dense.{p}", "pooler.dense.{p}"),
]

LM_HEAD_KEYS = [
    ("cls.predictions.transform.dense.{p}", "lm_head.dense.{p}"),
    ("cls.predictions.transform.LayerNorm.{p}", "lm_head.norm.{p}"),
    ("cls.predictions.bias", "lm_head.decoder.bias"),
    ("cls.predictions.decoder.weight", "lm_head.decoder.weight"),
]


RowSelection = Callable[[object, int], list[int]]  # (EncoderStackConfig, the source's row count) -> row indices


@dataclass(frozen=True)
class Piece:
    """A target built from a source tensor by rows: the source rows `rows` selects, in that order (None: all of
    them), fill row block `block` of the `of` equal blocks of the target. The converter streams each piece in turn."""

    target: str
    rows: RowSelection | None = None
    block: int = 0
    of: int = 1

    def format(self, **groups) -> "Piece":
        return dataclasses.replace(self, target=self.target.format(**groups))


def parts(*order: int, of: int) -> RowSelection:
    """The source's rows as `of` equal blocks, taken in `order`: `parts(0, of=3)` is the query third of a fused
    [Q; K; V] projection; `parts(1, 0, of=2)` swaps the two halves of a packed [up; gate] projection."""

    def select(config, count: int) -> list[int]:
        size = count // of
        return [row for block in order for row in range(block * size, (block + 1) * size)]

    return select


def head_part(part: int, of: int, rotary_pairs: bool = False) -> RowSelection:
    """Part `part` of each head of a projection fused per head (rows viewed as (heads, of, head_dim)): NeoBERT's qkv.
    `rotary_pairs`: the head's features reordered from rotary on pairs (2i, 2i+1) to rotate-half's [0, 2, 4, ..., 1,
    3, 5, ...], so that rotate-half on the reordered query and key gives the same scores."""

    def select(config, count: int) -> list[int]:
        heads = config.num_attention_heads
        head_dim = count // (heads * of)
        order = [*range(0, head_dim, 2), *range(1, head_dim, 2)] if rotary_pairs else list(range(head_dim))
        return [(head * of + part) * head_dim + feature for head in range(heads) for feature in order]

    return select


@dataclass(frozen=True)
class Task:
    """One task (transformers' pipeline name where it has one), its BERT architecture suffix and the EncoderStack class
    that takes its place."""

    name: str
    bert_suffix: str  # BertModel -> "Model", BertForMaskedLM -> "ForMaskedLM", ...
    encoderstack_class: str
    head_keys: tuple = ()


class Tasks(dict):
    """Task name -> Task; an old spelling (`TASK_ALIASES`) still finds its task, with a FutureWarning."""

    def __missing__(self, name):
        if name not in TASK_ALIASES:
            raise KeyError(name)
        warnings.warn(
            f"task {name!r} is now called {TASK_ALIASES[name]!r}; the old name goes in the next release",
            FutureWarning,
            stacklevel=2,
        )
        return self[TASK_ALIASES[name]]


TASKS = Tasks(
    (task.name, task)
    for task in (
        Task("feature-extraction", "Model", "EncoderStackModel"),
        Task("fill-mask", "ForMaskedLM", "EncoderStackForMaskedLM", tuple(LM_HEAD_KEYS)),
        Task(
            "pretraining",
            "ForPreTraining",
            "EncoderStackForPreTraining",
            (*LM_HEAD_KEYS, ("cls.seq_relationship.{p}", "next_sentence.{p}")),
        ),
        # The next-sentence head is a 2-way classifier on the pooled output, which is what sequence
        # classification is; the converted model says so with num_labels=2.
        Task(
            "next-sentence",
            "ForNextSentencePrediction",
            "EncoderStackForSequenceClassification",
            (("cls.seq_relationship.{p}", "classifier.{p}"),),
        ),
        Task(
            "text-classification",
            "ForSequenceClassification",
            "EncoderStackForSequenceClassification",
            (("classifier.{p}", "classifier.{p}"),),
        ),
        Task(
            "token-classification",
            "ForTokenClassification",
            "EncoderStackForTokenClassification",
            (("classifier.{p}", "classifier.{p}"),),
        ),
        Task(
            "question-answering",
            "ForQuestionAnswering",
            "EncoderStackForQuestionAnswering",
            (("qa_outputs.{p}", "classifier.{p}"),),
        ),
        Task(
            "multiple-choice",
            "ForMultipleChoice",
            "EncoderStackForMultipleChoice",
            (("classifier.{p}", "classifier.{p}"),),
        ),
        # ELECTRA's ForPreTraining is its discriminator (the generator is its ForMaskedLM)
        Task(
            "replaced-token-detection",
            "ForPreTraining",
            "EncoderStackForReplacedTokenDetection",
            (
                ("discriminator_predictions.dense.{p}", "discriminator.dense.{p}"),
                ("discriminator_predictions.dense_prediction.{p}", "discriminator.prediction.{p}"),
            ),
        ),
    )
)
# The names of 0.x releases, accepted (with a FutureWarning) for one more release.
TASK_ALIASES = {
    "base": "feature-extraction",
    "masked-lm": "fill-mask",
    "sequence-classification": "text-classification",
}
TASK_CHOICES = sorted({*TASKS, *TASK_ALIASES})
BERT_TASKS = tuple(name for name in TASKS if name != "replaced-token-detection")


def task_named(name: str, error: type[Exception] = ConversionError) -> Task:
    """The task of that name, or of an old spelling (with a FutureWarning); `error` names the known ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise error(f"task {name!r} is not one of {', '.join(sorted(TASKS))}") from None


# Keys of a BERT checkpoint that are deliberately not converted, with the reason recorded in conversion.json.
SKIPPED_KEYS = {
    "embeddings.position_ids": "buffer: EncoderStack computes positions instead of storing them",
    "embeddings.token_type_ids": "buffer: all zeros, the default token type",
    "cls.predictions.decoder.bias": "same tensor as cls.predictions.bias (BERT ties the two)",
}

# The decoder's own name for its bias, where a head stores the bias twice (the key maps map the head's copy, BERT's
# `cls.predictions.bias`, RoBERTa's `lm_head.bias`): skipped where the copies are equal, read where they differ.
DECODER_OWN_BIASES = ("cls.predictions.decoder.bias", "lm_head.decoder.bias", "predictions.decoder.bias")

ROBERTA_LM_HEAD_KEYS = (
    ("lm_head.dense.{p}", "lm_head.dense.{p}"),
    ("lm_head.layer_norm.{p}", "lm_head.norm.{p}"),
    ("lm_head.bias", "lm_head.decoder.bias"),
    ("lm_head.decoder.weight", "lm_head.decoder.weight"),
)
ROBERTA_HEAD_KEYS = {
    "fill-mask": ROBERTA_LM_HEAD_KEYS,
    # RoBERTa's sequence head: dense + tanh on the first token (our `pre_classifier`), then `out_proj`
    "text-classification": (
        ("classifier.dense.{p}", "pre_classifier.{p}"),
        ("classifier.out_proj.{p}", "classifier.{p}"),
    ),
}
ROBERTA_TASKS = (
    "feature-extraction",
    "fill-mask",
    "text-classification",
    "token-classification",
    "question-answering",
    "multiple-choice",
)
ROBERTA_SKIPPED = {
    "embeddings.position_ids": SKIPPED_KEYS["embeddings.position_ids"],
    "embeddings.token_type_ids": SKIPPED_KEYS["embeddings.token_type_ids"],
    "lm_head.decoder.bias": "same tensor as lm_head.bias (RoBERTa ties the two)",
}


def roberta_fields(config: dict) -> dict:
    """Positions count real tokens from pad_token_id + 1 (fairseq's `make_positions`); RoBERTa's heads."""
    pad = config.get("pad_token_id", 1)
    if not isinstance(pad, int) or isinstance(pad, bool):
        raise ConversionError(f"pad_token_id is {pad!r}; RoBERTa counts positions from pad_token_id + 1: it needs one")
    return {"position_offset": pad + 1}


@dataclass(frozen=True, kw_only=True)
class Family:
    """One source model family, declared whole: how its classes and keys are named, the EncoderStack head layout its
    heads become, the fields its layout implies (from its config.json), the keys it adds to or changes from BERT's,
    the heads it has, the transformers config its converted folders export back to, and what convert verifies
    against."""

    architecture_prefix: str  # BertForMaskedLM -> "Bert"
    key_prefix: str  # the encoder's prefix inside its task heads' checkpoints
    head_layout: str = "bert"  # EncoderStackConfig.head_layout
    fields: Callable[[dict], dict] = lambda config: {}
    extra_encoder_keys: tuple = ()
    head_keys: dict = field(default_factory=dict)  # task name -> keys, where they are not BERT's
    tasks: tuple = BERT_TASKS  # the tasks it has
    skipped: dict = field(default_factory=lambda: dict(SKIPPED_KEYS))
    architecture_names: dict = field(default_factory=dict)  # task name -> class name, where not prefix + suffix
    original_prefixes: tuple = ()  # the encoder's prefix in the release transformers ports, where it differs
    export_config: str | None = None  # export_bert: the transformers config class of the folder it writes
    # export_bert: the fields its config takes beyond BERT's, from ours (ConversionError where it has no value for one)
    export_fields: Callable[[object], dict] = lambda config: {}
    # convert's parity reference: the family's own transformers class for the task (`architecture`), where there is one
    transformers_reference: bool = True
    # (the conversion plan) -> what the reference's `from_pretrained` needs beyond the source's config.json
    reference_kwargs: Callable[[object], dict] = lambda plan: {}

    def architecture(self, task: "Task") -> str:
        return self.architecture_names.get(task.name, self.architecture_prefix + task.bert_suffix)

    @property
    def encoder_keys(self) -> list:
        """Its own keys, then BERT's; without BERT's pooler where its layout has none (DeBERTa's heads name theirs
        `pooler`)."""
        keys = [*self.extra_encoder_keys, *ENCODER_KEYS]
        return keys if HEADS[self.head_layout].pooler else [pair for pair in keys if not pair[0].startswith("pooler.")]

    def has(self, task: "Task") -> bool:
        return task.name in self.tasks

    def head_keys_of(self, task: "Task") -> tuple:
        return self.head_keys.get(task.name, task.head_keys)

    def local_name(self, name: str) -> str:
        """A source key without the family's encoder prefix (BERT's is removed when the source is read)."""
        prefix = next((p for p in (self.key_prefix, *self.original_prefixes) if name.startswith(p)), "")
        return name.removeprefix(prefix)


def roberta_family(**declaration) -> Family:
    """RoBERTa's kin: its heads, its skipped keys, positions from pad_token_id + 1, unless declared otherwise."""
    roberta = {"key_prefix": "roberta.", "head_layout": "roberta", "fields": roberta_fields}
    kin = {"head_keys": ROBERTA_HEAD_KEYS, "tasks": ROBERTA_TASKS, "skipped": ROBERTA_SKIPPED}
    return Family(**{**roberta, **kin, **declaration})


def pre_ln_roberta_fields(embedding_norm: bool) -> Callable[[dict], dict]:
    return lambda config: {**roberta_fields(config), "norm_placement": "pre", "embedding_norm": embedding_norm}


FAMILIES = {
    "bert": Family(architecture_prefix="Bert", key_prefix="bert.", export_config="BertConfig"),
    "megatron-bert": Family(
        architecture_prefix="MegatronBert",
        key_prefix="bert.",
        fields=lambda config: {"norm_placement": "pre", "embedding_norm": False},
    ),
    "roberta": roberta_family(architecture_prefix="Roberta", export_config="RobertaConfig"),
    "xlm-roberta": roberta_family(architecture_prefix="XLMRoberta"),
    "camembert": roberta_family(architecture_prefix="Camembert"),
    # Pre-LN RoBERTa: its norms in front of each sublayer, the embedding norm kept, a final norm on the model
    "roberta-prelayernorm": roberta_family(
        architecture_prefix="RobertaPreLayerNorm",
        key_prefix="roberta_prelayernorm.",
        fields=pre_ln_roberta_fields(embedding_norm=True),
        extra_encoder_keys=(
            ("encoder.layer.{i}.attention.LayerNorm.{p}", "layers.{i}.attention_residual.norm_in.{p}"),
            ("encoder.layer.{i}.intermediate.LayerNorm.{p}", "layers.{i}.mlp_residual.norm_in.{p}"),
            ("LayerNorm.{p}", "final.norm.{p}"),
        ),
    ),
    # XLM-R XL/XXL: pre-LN with its own norm names, no embedding norm, the final norm inside the encoder
    "xlm-roberta-xl": roberta_family(
        architecture_prefix="XLMRobertaXL",
        fields=pre_ln_roberta_fields(embedding_norm=False),
        extra_encoder_keys=(
            ("encoder.layer.{i}.attention.self_attn_layer_norm.{p}", "layers.{i}.attention_residual.norm_in.{p}"),
            ("encoder.layer.{i}.LayerNorm.{p}", "layers.{i}.mlp_residual.norm_in.{p}"),
            ("encoder.LayerNorm.{p}", "final.norm.{p}"),
        ),
    ),
}


def electra_fields(config: dict) -> dict:
    """Embeddings at `embedding_size`, projected to the hidden size (ELECTRA-small: 128 -> 256); ELECTRA's heads.
    Its multiple-choice summary must be the first token, projected, through gelu (the default and every release)."""
    summary = (config.get("summary_type", "first"), config.get("summary_use_proj", True))
    if summary != ("first", True) or config.get("summary_activation", "gelu") != "gelu":
        raise ConversionError(
            f"ELECTRA's sequence summary {summary + (config.get('summary_activation'),)} is not supported "
            "(EncoderStack takes the first token, projected, through gelu)"
        )
    size = config.get("embedding_size", config.get("hidden_size"))
    return {"embedding_size": size if size != config.get("hidden_size") else None}


def distilbert_fields(config: dict) -> dict:
    """DistilBERT's own config names, no token types, its fixed LayerNorm epsilon and its heads."""
    renamed = {
        "dim": "hidden_size",
        "n_layers": "num_hidden_layers",
        "n_heads": "num_attention_heads",
        "hidden_dim": "intermediate_size",
        "activation": "hidden_act",
        "dropout": "hidden_dropout_prob",
        "attention_dropout": "attention_probs_dropout_prob",
        "seq_classif_dropout": "classifier_dropout",
    }
    fields = {ours: config[theirs] for theirs, ours in renamed.items() if theirs in config}
    return {**fields, "type_vocab_size": 0, "layer_norm_eps": 1e-12}


DISTILBERT_ENCODER_KEYS = (
    ("embeddings.LayerNorm.{p}", "embeddings.norm.{p}"),
    ("transformer.layer.{i}.attention.q_lin.{p}", "layers.{i}.attention.query.{p}"),
    ("transformer.layer.{i}.attention.k_lin.{p}", "layers.{i}.attention.key.{p}"),
    ("transformer.layer.{i}.attention.v_lin.{p}", "layers.{i}.attention.value.{p}"),
    ("transformer.layer.{i}.attention.out_lin.{p}", "layers.{i}.attention.output.{p}"),
    ("transformer.layer.{i}.sa_layer_norm.{p}", "layers.{i}.attention_residual.norm_out.{p}"),
    ("transformer.layer.{i}.ffn.lin1.{p}", "layers.{i}.mlp.up.{p}"),
    ("transformer.layer.{i}.ffn.lin2.{p}", "layers.{i}.mlp.down.{p}"),
    ("transformer.layer.{i}.output_layer_norm.{p}", "layers.{i}.mlp_residual.norm_out.{p}"),
)
FIRST_TOKEN_HEAD = (("pre_classifier.{p}", "pre_classifier.{p}"), ("classifier.{p}", "classifier.{p}"))

FAMILIES |= {
    "electra": Family(
        architecture_prefix="Electra",
        key_prefix="electra.",
        head_layout="electra",
        fields=electra_fields,
        extra_encoder_keys=(("embeddings_project.{p}", "embeddings.project.{p}"),),
        head_keys={
            "fill-mask": (  # the generator
                ("generator_predictions.dense.{p}", "lm_head.dense.{p}"),
                ("generator_predictions.LayerNorm.{p}", "lm_head.norm.{p}"),
                ("generator_lm_head.weight", "lm_head.decoder.weight"),
                ("generator_lm_head.bias", "lm_head.decoder.bias"),
            ),
            "text-classification": ROBERTA_HEAD_KEYS["text-classification"],
            "multiple-choice": (
                ("sequence_summary.summary.{p}", "pre_classifier.{p}"),
                ("classifier.{p}", "classifier.{p}"),
            ),
        },
        tasks=(*ROBERTA_TASKS, "replaced-token-detection"),
    ),
    "distilbert": Family(
        architecture_prefix="DistilBert",
        key_prefix="distilbert.",
        head_layout="distilbert",
        fields=distilbert_fields,
        extra_encoder_keys=DISTILBERT_ENCODER_KEYS,
        head_keys={
            "fill-mask": (
                ("vocab_transform.{p}", "lm_head.dense.{p}"),
                ("vocab_layer_norm.{p}", "lm_head.norm.{p}"),
                ("vocab_projector.weight", "lm_head.decoder.weight"),
                ("vocab_projector.bias", "lm_head.decoder.bias"),
            ),
            "text-classification": FIRST_TOKEN_HEAD,
            "multiple-choice": FIRST_TOKEN_HEAD,
        },
        tasks=ROBERTA_TASKS,
    ),
}


def rotary_fields(config: dict, family: str, default_theta: float) -> dict:
    """Post-LN with rotary positions counted along the row from 0 (as their classes count them, whatever the padding):
    the checkpoint's `rope_parameters` as they are (its base, and any scaling through transformers' own functions)."""
    if config.get("head_dim") not in (
        None,
        config.get("hidden_size", 0) // max(config.get("num_attention_heads") or 1, 1),
    ):
        raise ConversionError(
            f"{family}'s head_dim {config['head_dim']} other than hidden_size / heads is not supported"
        )
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": default_theta}
    return {"position_embedding_type": "rope", "rope_parameters": dict(rope)}


def gte_fields(config: dict) -> dict:
    """GTE: a gated MLP whose up and gate projections have no bias and whose down projection has one; its masked-LM
    head applies gelu whatever `hidden_act`, ours the MLP's activation, so only gelu converts (every GTE release)."""
    if config.get("hidden_act", "gelu") != "gelu":
        raise ConversionError(f"GTE's hidden_act {config['hidden_act']!r} is not supported (gelu)")
    return {**rotary_fields(config, "GTE", 160_000.0), "hidden_act": "geglu", "mlp_bias": "down"}


def nomic_bert_fields(config: dict) -> dict:
    """NomicBERT: SwiGLU, no bias in attention or the MLP."""
    fields = {
        "hidden_act": gated(config.get("hidden_act", "silu"), "NomicBERT"),
        "attention_bias": False,
        "mlp_bias": False,
    }
    return {**rotary_fields(config, "NomicBERT", 1000.0), **fields}


def fused_qkv() -> tuple:
    """A fused [Q; K; V] projection (each all heads) as the three pieces of ours."""
    return tuple(
        Piece(f"layers.{{i}}.attention.{name}.{{p}}", parts(index, of=3))
        for index, name in enumerate(("query", "key", "value"))
    )


# The layers under the names their checkpoints keep on disk (transformers' conversion_mapping.py renames them when it
# loads them, and `save_pretrained` writes them back): a fused QKV projection, `norm1` / `norm2` after each sublayer.
FLASH_LAYER_KEYS = (
    ("emb_ln.{p}", "embeddings.norm.{p}"),
    ("encoder.layers.{i}.norm1.{p}", "layers.{i}.attention_residual.norm_out.{p}"),
    ("encoder.layers.{i}.norm2.{p}", "layers.{i}.mlp_residual.norm_out.{p}"),
)
ROTARY_TASKS = ("feature-extraction", "fill-mask", "text-classification", "token-classification")

FAMILIES |= {
    "gte": Family(
        architecture_prefix="Gte",
        key_prefix="gte.",
        fields=gte_fields,
        extra_encoder_keys=(
            ("encoder.layer.{i}.attention.qkv_proj.{p}", fused_qkv()),
            ("encoder.layer.{i}.attention.o_proj.{p}", "layers.{i}.attention.output.{p}"),
            ("encoder.layer.{i}.attn_ln.{p}", "layers.{i}.attention_residual.norm_out.{p}"),
            # [up; gate], ours [gate; up]: act(gate) * up
            ("encoder.layer.{i}.mlp.up_gate_proj.weight", Piece("layers.{i}.mlp.up.weight", parts(1, 0, of=2))),
            ("encoder.layer.{i}.mlp.down_proj.{p}", "layers.{i}.mlp.down.{p}"),
            ("encoder.layer.{i}.mlp_ln.{p}", "layers.{i}.mlp_residual.norm_out.{p}"),
        ),
        head_keys={
            "fill-mask": (
                ("lm_head.dense.{p}", "lm_head.dense.{p}"),
                ("lm_head.norm.{p}", "lm_head.norm.{p}"),
                ("lm_head.decoder.{p}", "lm_head.decoder.{p}"),
            )
        },
        tasks=ROTARY_TASKS,
        # the remote-code release's heads keep the encoder under `new.` (transformers' port renames it on load)
        original_prefixes=("new.",),
    ),
    "nomic_bert": Family(
        architecture_prefix="NomicBert",
        key_prefix="nomic_bert.",
        fields=nomic_bert_fields,
        extra_encoder_keys=(
            *FLASH_LAYER_KEYS,
            ("encoder.layers.{i}.attn.Wqkv.{p}", fused_qkv()),
            ("encoder.layers.{i}.attn.out_proj.{p}", "layers.{i}.attention.output.{p}"),
            # act(fc12 x) * fc11 x: ours [gate; up] is [fc12; fc11]
            ("encoder.layers.{i}.mlp.fc12.{p}", Piece("layers.{i}.mlp.up.{p}", block=0, of=2)),
            ("encoder.layers.{i}.mlp.fc11.{p}", Piece("layers.{i}.mlp.up.{p}", block=1, of=2)),
            ("encoder.layers.{i}.mlp.fc2.{p}", "layers.{i}.mlp.down.{p}"),
        ),
        head_keys={
            "fill-mask": (
                ("cls.predictions.transform.dense.{p}", "lm_head.dense.{p}"),
                ("cls.predictions.transform.layer_norm.{p}", "lm_head.norm.{p}"),
                ("cls.predictions.bias", "lm_head.decoder.bias"),
                ("cls.predictions.decoder.weight", "lm_head.decoder.weight"),
            )
        },
        tasks=ROTARY_TASKS,
    ),
    # XLM-R with rotary positions (base 20 000); RoBERTa's heads
    "jina_embeddings_v3": roberta_family(
        architecture_prefix="JinaEmbeddingsV3",
        fields=lambda config: rotary_fields(config, "jina-embeddings-v3", 20_000.0),
        extra_encoder_keys=(
            *FLASH_LAYER_KEYS,
            ("encoder.layers.{i}.mixer.Wqkv.{p}", fused_qkv()),
            ("encoder.layers.{i}.mixer.out_proj.{p}", "layers.{i}.attention.output.{p}"),
            ("encoder.layers.{i}.mlp.fc1.{p}", "layers.{i}.mlp.up.{p}"),
            ("encoder.layers.{i}.mlp.fc2.{p}", "layers.{i}.mlp.down.{p}"),
        ),
        tasks=(*ROTARY_TASKS, "question-answering"),
    ),
}


def gated(activation: str, family: str) -> str:
    """A family's gated MLP activation as EncoderStack's `hidden_act` (the first half of the up projection gated)."""
    gates = {"gelu": "geglu", "silu": "swiglu"}
    if activation not in gates:
        raise ConversionError(f"{family}'s gated activation {activation!r} is not supported (gelu or silu)")
    return gates[activation]


def pooling(config: dict, family: str, names: dict) -> str:
    value = config.get("classifier_pooling", next(iter(names)))
    if value not in names:
        raise ConversionError(f"{family}'s classifier_pooling {value!r} is not supported ({', '.join(names)})")
    return names[value]


def layer_types(config: dict, every: int = 1) -> list[str]:
    """The config's `layer_types`, or older configs' rule: full attention every `every` layers from the first."""
    if config.get("layer_types") is not None:
        return list(config["layer_types"])
    layers = config.get("num_hidden_layers")
    return ["sliding_attention" if index % every else "full_attention" for index in range(layers)]


def rope_by_type(config: dict, full: float, sliding: float) -> dict:
    """transformers' per-type `rope_parameters`, or older configs' `global_rope_theta` / `local_rope_theta`."""
    given = config.get("rope_parameters") or {}
    if "full_attention" in given or "sliding_attention" in given:
        return {kind: dict(given[kind]) for kind in ("full_attention", "sliding_attention") if given.get(kind)}
    return {
        "full_attention": {"rope_type": "default", "rope_theta": config.get("global_rope_theta", full)},
        "sliding_attention": {"rope_type": "default", "rope_theta": config.get("local_rope_theta", sliding)},
    }


def modernbert_fields(config: dict) -> dict:
    """ModernBERT: pre-LN whose first attention reads the normed embeddings, LayerNorms without bias, GeGLU, rotary
    with a base per layer type, local layers with a window of `local_attention` keys (our radius: half of it)."""
    if config.get("classifier_activation", "gelu") != "gelu":
        raise ConversionError(
            f"ModernBERT's classifier_activation {config['classifier_activation']!r} is not supported (gelu)"
        )
    return {
        "hidden_act": gated(config.get("hidden_activation", "gelu"), "ModernBERT"),
        "norm_placement": "pre_skip_first",
        "layer_norm_eps": config.get("norm_eps", 1e-5),
        "norm_bias": config.get("norm_bias", False),
        "attention_bias": config.get("attention_bias", False),
        "mlp_bias": config.get("mlp_bias", False),
        "position_embedding_type": "rope",
        "rope_parameters": rope_by_type(config, 160_000.0, 10_000.0),
        "layer_types": layer_types(config, config.get("global_attn_every_n_layers", 3)),
        "sliding_window": config.get("local_attention", 128) // 2,
        "type_vocab_size": 0,
        "hidden_dropout_prob": config.get("mlp_dropout", 0.0),
        "attention_probs_dropout_prob": config.get("attention_dropout", 0.0),
        "classifier_pooling": pooling(config, "ModernBERT", {"cls": "first", "mean": "mean"}),
        "classifier_bias": config.get("classifier_bias", False),
        "decoder_bias": config.get("decoder_bias", True),
    }


def llama_style_fields(config: dict, family: str) -> dict:
    """EuroBERT's and UltraBERT's Llama-style encoder: pre-RMSNorm without an embedding norm, SwiGLU, rotary,
    grouped-query attention, no biases unless the config says so."""
    heads = config.get("num_attention_heads")
    if config.get("head_dim") not in (None, config.get("hidden_size", 0) // max(heads or 1, 1)):
        raise ConversionError(
            f"{family}'s head_dim {config['head_dim']} other than hidden_size / heads is not supported"
        )
    return {
        "hidden_act": gated(config.get("hidden_act", "silu"), family),
        "norm_placement": "pre",
        "norm_type": "rmsnorm",
        "embedding_norm": False,
        "layer_norm_eps": config.get("rms_norm_eps", 1e-5),
        "num_key_value_heads": config.get("num_key_value_heads"),
        "attention_bias": config.get("attention_bias", False),
        "mlp_bias": config.get("mlp_bias", False),
        "position_embedding_type": "rope",
        "type_vocab_size": 0,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": config.get("attention_dropout", 0.0),
        "classifier_dropout": config.get("classifier_dropout", 0.0),
    }


def eurobert_fields(config: dict) -> dict:
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 10_000.0)}
    return {
        **llama_style_fields(config, "EuroBERT"),
        "rope_parameters": dict(rope),
        "classifier_pooling": pooling(config, "EuroBERT", {"late": "late", "bos": "first", "mean": "mean"}),
        "decoder_bias": config.get("mlp_bias", False),
    }


def ultrabert_fields(config: dict) -> dict:
    return {
        **llama_style_fields(config, "UltraBERT"),
        "rope_parameters": rope_by_type(config, 2_560_000.0, 10_000.0),
        "layer_types": layer_types(config) if config.get("layer_types") else ultrabert_layer_types(config),
        "sliding_window": ultrabert_window(config),
        "classifier_pooling": pooling(config, "UltraBERT", {"cls": "first", "mean": "mean"}),
        "classifier_bias": False,
        "decoder_bias": False,
        "prediction_head_size": config.get("prediction_head_size", 768),
    }


def ultrabert_layer_types(config: dict) -> list[str]:
    """UltraBERT's default: every third layer (1-based) full, the others sliding; original checkpoints give
    `attention_windows`, one per layer, 0 for a full layer."""
    if config.get("attention_windows"):
        return ["sliding_attention" if window else "full_attention" for window in config["attention_windows"]]
    return [
        "sliding_attention" if (index + 1) % 3 else "full_attention" for index in range(config["num_hidden_layers"])
    ]


def ultrabert_window(config: dict) -> int:
    """The radius (UltraBERT's `sliding_window` is one), or the first window of original checkpoints' list."""
    return next(
        (window for window in config.get("attention_windows") or () if window), config.get("sliding_window", 128)
    )


MODERNBERT_HEAD = (
    ("head.dense.{p}", "pre_classifier.{p}"),
    ("head.norm.{p}", "pre_classifier_norm.{p}"),
    ("classifier.{p}", "classifier.{p}"),
)
LLAMA_STYLE_KEYS = (
    ("embed_tokens.weight", "embeddings.word_embeddings.weight"),
    ("layers.{i}.self_attn.q_proj.{p}", "layers.{i}.attention.query.{p}"),
    ("layers.{i}.self_attn.k_proj.{p}", "layers.{i}.attention.key.{p}"),
    ("layers.{i}.self_attn.v_proj.{p}", "layers.{i}.attention.value.{p}"),
    ("layers.{i}.self_attn.o_proj.{p}", "layers.{i}.attention.output.{p}"),
    ("layers.{i}.input_layernorm.weight", "layers.{i}.attention_residual.norm_in.weight"),
    ("layers.{i}.post_attention_layernorm.weight", "layers.{i}.mlp_residual.norm_in.weight"),
    # act(gate) * up: our up projection holds [gate; up], the gated half first
    ("layers.{i}.mlp.gate_proj.{p}", Piece("layers.{i}.mlp.up.{p}", block=0, of=2)),
    ("layers.{i}.mlp.up_proj.{p}", Piece("layers.{i}.mlp.up.{p}", block=1, of=2)),
    ("layers.{i}.mlp.down_proj.{p}", "layers.{i}.mlp.down.{p}"),
    ("norm.weight", "final.norm.weight"),
)
SEQUENCE_CLASSIFIER = (("classifier.{p}", "classifier.{p}"),)

FAMILIES |= {
    "modernbert": Family(
        architecture_prefix="ModernBert",
        key_prefix="model.",
        head_layout="modernbert",
        fields=modernbert_fields,
        extra_encoder_keys=(
            ("embeddings.tok_embeddings.weight", "embeddings.word_embeddings.weight"),
            ("embeddings.norm.{p}", "embeddings.norm.{p}"),
            ("layers.{i}.attn_norm.{p}", "layers.{i}.attention_residual.norm_in.{p}"),
            (
                "layers.{i}.attn.Wqkv.{p}",  # [Q; K; V], each all heads
                tuple(
                    Piece(f"layers.{{i}}.attention.{name}.{{p}}", parts(index, of=3))
                    for index, name in enumerate(("query", "key", "value"))
                ),
            ),
            ("layers.{i}.attn.Wo.{p}", "layers.{i}.attention.output.{p}"),
            ("layers.{i}.mlp_norm.{p}", "layers.{i}.mlp_residual.norm_in.{p}"),
            ("layers.{i}.mlp.Wi.{p}", "layers.{i}.mlp.up.{p}"),  # [input; gate]: act(input) * gate, as ours
            ("layers.{i}.mlp.Wo.{p}", "layers.{i}.mlp.down.{p}"),
            ("final_norm.{p}", "final.norm.{p}"),
        ),
        head_keys={
            "fill-mask": (
                ("head.dense.{p}", "lm_head.dense.{p}"),
                ("head.norm.{p}", "lm_head.norm.{p}"),
                ("decoder.weight", "lm_head.decoder.weight"),
                ("decoder.bias", "lm_head.decoder.bias"),
            ),
            "text-classification": MODERNBERT_HEAD,
            "token-classification": MODERNBERT_HEAD,
            "question-answering": MODERNBERT_HEAD,
            "multiple-choice": MODERNBERT_HEAD,
        },
        tasks=ROBERTA_TASKS,
    ),
    "eurobert": Family(
        architecture_prefix="EuroBert",
        key_prefix="model.",
        head_layout="eurobert",
        fields=eurobert_fields,
        extra_encoder_keys=LLAMA_STYLE_KEYS,
        head_keys={
            "fill-mask": (("lm_head.{p}", "lm_head.decoder.{p}"),),
            "text-classification": (("dense.{p}", "pre_classifier.{p}"), *SEQUENCE_CLASSIFIER),
        },
        tasks=("feature-extraction", "fill-mask", "text-classification", "token-classification"),
    ),
    # on disk (as on the Hub and as transformers saves it): `ultrabert.` and `cls.` where its classes say `model.` and
    # `head.decoder.` (transformers' conversion_mapping.py)
    "ultrabert": Family(
        architecture_prefix="Ultrabert",
        key_prefix="ultrabert.",
        head_layout="ultrabert",
        fields=ultrabert_fields,
        extra_encoder_keys=LLAMA_STYLE_KEYS,
        head_keys={
            "fill-mask": (
                ("head.linear1.weight", "lm_head.dense.weight"),
                ("head.linear2.weight", "lm_head.dense_out.weight"),
                ("cls.weight", "lm_head.decoder.weight"),
            ),
            "text-classification": SEQUENCE_CLASSIFIER,
        },
        tasks=("feature-extraction", "fill-mask", "text-classification", "token-classification", "question-answering"),
    ),
}


def neobert_fields(config: dict) -> dict:
    """NeoBERT (remote code): pre-RMSNorm, SwiGLU at xformers' width (2/3 of `intermediate_size`, rounded up to a
    multiple of 8), rotary (base 10 000) without an embedding norm, a final norm; no biases in the encoder."""
    if config.get("ngpt"):
        raise ConversionError("NeoBERT's normalized-GPT variant (ngpt=true) is not supported")
    if not config.get("rope", True):
        raise ConversionError("NeoBERT without rotary positions (rope=false) is not supported")
    if str(config.get("hidden_act", "SwiGLU")).lower() != "swiglu":
        raise ConversionError(f"NeoBERT's hidden_act {config['hidden_act']!r} is not supported (SwiGLU)")
    width = int(2 * config.get("intermediate_size", 3072) / 3)
    rms = config.get("rms_norm", True)
    return {
        "intermediate_size": 8 * ((width + 7) // 8),
        "hidden_act": "swiglu",
        "norm_placement": "pre",
        "norm_type": "rmsnorm" if rms else "layernorm",
        "embedding_norm": False,
        "layer_norm_eps": config.get("norm_eps", 1e-6),
        "attention_bias": False,
        "mlp_bias": False,
        "position_embedding_type": "rope",
        "rope_theta": 10_000.0,
        "max_position_embeddings": config.get("max_length", 1024),
        "type_vocab_size": 0,
        "hidden_dropout_prob": config.get("dropout", 0.0),
        "attention_probs_dropout_prob": 0.0,
        "classifier_dropout": config.get("classifier_dropout", 0.1),
        "tie_word_embeddings": False,
    }


FAMILIES["neobert"] = Family(
    architecture_prefix="NeoBERT",
    key_prefix="model.",
    head_layout="neobert",
    fields=neobert_fields,
    extra_encoder_keys=(
        ("encoder.weight", "embeddings.word_embeddings.weight"),
        (
            "transformer_encoder.{i}.qkv.weight",  # per head [q; k; v]; rotary on pairs (2i, 2i+1)
            (
                Piece("layers.{i}.attention.query.weight", head_part(0, of=3, rotary_pairs=True)),
                Piece("layers.{i}.attention.key.weight", head_part(1, of=3, rotary_pairs=True)),
                Piece("layers.{i}.attention.value.weight", head_part(2, of=3)),
            ),
        ),
        ("transformer_encoder.{i}.wo.weight", "layers.{i}.attention.output.weight"),
        ("transformer_encoder.{i}.attention_norm.{p}", "layers.{i}.attention_residual.norm_in.{p}"),
        ("transformer_encoder.{i}.ffn.w12.weight", "layers.{i}.mlp.up.weight"),  # [w1; w2]: silu(w1 x) * (w2 x)
        ("transformer_encoder.{i}.ffn.w3.weight", "layers.{i}.mlp.down.weight"),
        ("transformer_encoder.{i}.ffn_norm.{p}", "layers.{i}.mlp_residual.norm_in.{p}"),
        ("layer_norm.{p}", "final.norm.{p}"),
    ),
    head_keys={
        "fill-mask": (("decoder.{p}", "lm_head.decoder.{p}"),),
        "text-classification": (("dense.{p}", "pre_classifier.{p}"), *SEQUENCE_CLASSIFIER),
    },
    tasks=("feature-extraction", "fill-mask", "text-classification"),
    architecture_names={
        "feature-extraction": "NeoBERT",
        "fill-mask": "NeoBERTLMHead",
        "text-classification": "NeoBERTHFForSequenceClassification",
    },
    transformers_reference=False,  # remote code only
)


def mpnet_fields(config: dict) -> dict:
    """MPNet: RoBERTa's positions (counted from its fixed padding index 1 + 1) without token types, and one learned
    relative-position bias in every layer's scores, bucketed into 32 whatever the config says (its encoder calls
    the bucketing with the default)."""
    if config.get("pad_token_id", 1) != 1:
        raise ConversionError(
            f"MPNet numbers positions from its fixed padding index 1; pad_token_id {config['pad_token_id']!r} "
            "is not supported"
        )
    if config.get("relative_attention_num_buckets", 32) != 32:
        raise ConversionError(
            f"MPNet's relative_attention_num_buckets {config['relative_attention_num_buckets']!r} is not supported "
            "(its encoder buckets into 32)"
        )
    return {
        "position_offset": 2,
        "type_vocab_size": 0,
        "relative_attention": "bias",
        "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128,
    }


FAMILIES["mpnet"] = roberta_family(
    architecture_prefix="MPNet",
    key_prefix="mpnet.",
    fields=mpnet_fields,
    extra_encoder_keys=(
        ("encoder.layer.{i}.attention.attn.q.{p}", "layers.{i}.attention.query.{p}"),
        ("encoder.layer.{i}.attention.attn.k.{p}", "layers.{i}.attention.key.{p}"),
        ("encoder.layer.{i}.attention.attn.v.{p}", "layers.{i}.attention.value.{p}"),
        ("encoder.layer.{i}.attention.attn.o.{p}", "layers.{i}.attention.output.{p}"),
        ("encoder.layer.{i}.attention.LayerNorm.{p}", "layers.{i}.attention_residual.norm_out.{p}"),
        ("encoder.relative_attention_bias.weight", "relative_attention.bias.weight"),
    ),
)


# ALBERT's defaults where they differ from BERT's: its config.json may leave them out
ALBERT_DEFAULTS = {
    "vocab_size": 30000,
    "embedding_size": 128,
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "intermediate_size": 16384,
    "hidden_act": "gelu_new",
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


def albert_fields(config: dict) -> dict:
    """ALBERT: embeddings at `embedding_size`, always projected (ours only where the widths differ), and layer
    sharing; its `num_hidden_layers` counts the blocks of `inner_group_num` layers, ours every layer run."""
    fields = {name: config.get(name, default) for name, default in ALBERT_DEFAULTS.items()}
    if fields["embedding_size"] == fields["hidden_size"]:
        raise ConversionError(
            f"ALBERT's embedding_size equal to hidden_size ({fields['hidden_size']}) is not supported (its "
            "embedding projection is then a square matrix, which EncoderStack has only between different widths)"
        )
    inner = config.get("inner_group_num", 1)
    return {
        **fields,
        "num_hidden_layers": config.get("num_hidden_layers", 12) * inner,
        "num_hidden_groups": config.get("num_hidden_groups", 1),
        "inner_group_num": inner,
        "classifier_dropout": config.get("classifier_dropout_prob", 0.1),
    }


def albert_export_fields(config) -> dict:
    """ALBERT's config fields of an EncoderStack config: its blocks of `inner_group_num` layers, its groups."""
    if config.embedding_size is None:
        raise ConversionError("albert cannot express embedding_size=None (ALBERT always projects its embeddings)")
    blocks = config.num_hidden_layers // config.inner_group_num
    dropout = config.classifier_dropout
    return {
        "embedding_size": config.embedding_size,
        "num_hidden_layers": blocks,
        "num_hidden_groups": config.num_hidden_groups or blocks,
        "inner_group_num": config.inner_group_num,
        "classifier_dropout_prob": config.hidden_dropout_prob if dropout is None else dropout,
    }


ALBERT_LAYER = "encoder.albert_layer_groups.{g}.albert_layers.{j}."
ALBERT_LM_HEAD_KEYS = (
    ("predictions.dense.{p}", "lm_head.dense.{p}"),
    ("predictions.LayerNorm.{p}", "lm_head.norm.{p}"),
    ("predictions.bias", "lm_head.decoder.bias"),
    ("predictions.decoder.weight", "lm_head.decoder.weight"),
)

FAMILIES["albert"] = Family(
    architecture_prefix="Albert",
    key_prefix="albert.",
    head_layout="albert",
    fields=albert_fields,
    export_config="AlbertConfig",
    export_fields=albert_export_fields,
    extra_encoder_keys=(
        ("encoder.embedding_hidden_mapping_in.{p}", "embeddings.project.{p}"),
        (ALBERT_LAYER + "attention.query.{p}", "layers.{i}.attention.query.{p}"),
        (ALBERT_LAYER + "attention.key.{p}", "layers.{i}.attention.key.{p}"),
        (ALBERT_LAYER + "attention.value.{p}", "layers.{i}.attention.value.{p}"),
        (ALBERT_LAYER + "attention.dense.{p}", "layers.{i}.attention.output.{p}"),
        (ALBERT_LAYER + "attention.LayerNorm.{p}", "layers.{i}.attention_residual.norm_out.{p}"),
        (ALBERT_LAYER + "ffn.{p}", "layers.{i}.mlp.up.{p}"),
        (ALBERT_LAYER + "ffn_output.{p}", "layers.{i}.mlp.down.{p}"),
        (ALBERT_LAYER + "full_layer_layer_norm.{p}", "layers.{i}.mlp_residual.norm_out.{p}"),
        ("pooler.{p}", "pooler.dense.{p}"),
    ),
    head_keys={
        "fill-mask": ALBERT_LM_HEAD_KEYS,
        "pretraining": (*ALBERT_LM_HEAD_KEYS, ("sop_classifier.classifier.{p}", "sentence_order.{p}")),
    },
    tasks=(
        "feature-extraction",
        "fill-mask",
        "pretraining",
        "text-classification",
        "token-classification",
        "question-answering",
        "multiple-choice",
    ),
    skipped={
        "embeddings.position_ids": SKIPPED_KEYS["embeddings.position_ids"],
        "embeddings.token_type_ids": SKIPPED_KEYS["embeddings.token_type_ids"],
        "predictions.decoder.bias": "same tensor as predictions.bias (ALBERT ties the two)",
    },
)


def deberta_fields(config: dict, v1: bool = False) -> dict:
    """DeBERTa: BERT's post-LN layers with disentangled attention (relative-position embeddings shared by the layers,
    projected in each, as c2p and p2c terms in its scores), absolute positions at the input only where
    `position_biased_input` (deberta-base and v3 have none), and its heads: the ContextPooler's dense and activation on
    the first token, BERT's masked-LM transform (`cls.predictions`, or `lm_predictions.lm_head` where `legacy=false`).
    v2 and v3 add log buckets, shared position keys and a norm of the relative embeddings; v1 has a fused `in_proj`
    without biases, its own query and value biases, and a position key projection without one."""
    hidden = config.get("hidden_size")
    head_size = hidden // max(config.get("num_attention_heads") or 1, 1)
    unsupported = {
        "conv_kernel_size": (config.get("conv_kernel_size", 0), 0, "the convolution after the first layer"),
        "talking_head": (config.get("talking_head", False), False, "attention without talking heads"),
        "embedding_size": (config.get("embedding_size", hidden), hidden, "embed_proj, normalized after projection"),
        "attention_head_size": (config.get("attention_head_size", head_size), head_size, "hidden_size / heads"),
        "pooler_hidden_act": (config.get("pooler_hidden_act", "gelu"), "gelu", "the ContextPooler's gelu"),
        "pooler_hidden_size": (config.get("pooler_hidden_size", hidden), hidden, "a pooler as wide as the layers"),
    }
    for name, (value, supported, why) in unsupported.items():
        if value != supported:
            raise ConversionError(f"DeBERTa's {name} {value!r} is not supported (EncoderStack converts {why})")
    terms = config.get("pos_att_type") or []
    terms = [term.strip() for term in terms.lower().split("|")] if isinstance(terms, str) else list(terms)
    if any(term not in ("c2p", "p2c") for term in terms):
        raise ConversionError(f"DeBERTa's pos_att_type {terms!r} is not supported (c2p and/or p2c)")
    relative = {}
    if config.get("relative_attention", False) and terms:
        buckets, reach = config.get("position_buckets", -1), config.get("max_relative_positions", -1)
        norms = [name.strip() for name in str(config.get("norm_rel_ebd", "none")).lower().split("|")]
        relative = {
            "relative_attention": "disentangled",
            "position_buckets": buckets if buckets > 0 and not v1 else None,
            "max_relative_positions": reach if reach >= 1 else config.get("max_position_embeddings", 512),
            "share_att_key": config.get("share_att_key", False) and not v1,
            "pos_att_type": [term for term in ("c2p", "p2c") if term in terms],
            "norm_rel_ebd": "layer_norm" if "layer_norm" in norms and not v1 else "none",
        }
    fields = {
        "position_embedding_type": "absolute" if config.get("position_biased_input", True) else None,
        "type_vocab_size": config.get("type_vocab_size", 0),
        "layer_norm_eps": config.get("layer_norm_eps", 1e-7),
        "classifier_dropout": config.get("cls_dropout"),
        **relative,
    }
    if v1:  # `in_proj` has no bias: the query and value biases are its own, the key has none, nor the position key
        fields["attention_bias"] = ["query", "value", "output", "position_query"]
    return fields


DEBERTA_CONTEXT_POOLER = (("pooler.dense.{p}", "pre_classifier.{p}"), ("classifier.{p}", "classifier.{p}"))
DEBERTA_HEADS = {
    "fill-mask": (
        *LM_HEAD_KEYS,  # legacy=true (the default)
        ("lm_predictions.lm_head.dense.{p}", "lm_head.dense.{p}"),  # legacy=false: tied to the word embeddings
        ("lm_predictions.lm_head.LayerNorm.{p}", "lm_head.norm.{p}"),
        ("lm_predictions.lm_head.bias", "lm_head.decoder.bias"),
    ),
    "text-classification": DEBERTA_CONTEXT_POOLER,
    "multiple-choice": DEBERTA_CONTEXT_POOLER,
}


# DeBERTa-v3's releases also hold its pre-training discriminator, which transformers' classes ignore (as they do here)
DEBERTA_SKIPPED = {
    **SKIPPED_KEYS,
    **{
        f"mask_predictions.{part}.{p}": "DeBERTa-v3's replaced-token-detection head, which transformers' classes ignore"
        for part in ("dense", "LayerNorm", "classifier")
        for p in ("weight", "bias")
    },
}


def deberta_reference(plan) -> dict:
    """A masked-LM head stored as `lm_predictions` (the v3 releases, whose configs leave `legacy` at its default, true)
    is what DeBERTa's class reads with `legacy=false`; with the default it would start a fresh `cls` head."""
    sources = (rows.key for pieces in plan.mapped.values() for rows in pieces)
    return {"legacy": False} if any("lm_predictions." in key for key in sources) else {}


def deberta_family(**declaration) -> Family:
    deberta = {"key_prefix": "deberta.", "head_layout": "deberta", "head_keys": DEBERTA_HEADS, "tasks": ROBERTA_TASKS}
    return Family(**{**deberta, "skipped": DEBERTA_SKIPPED, "reference_kwargs": deberta_reference, **declaration})


FAMILIES |= {
    "deberta-v2": deberta_family(
        architecture_prefix="DebertaV2",
        fields=deberta_fields,
        extra_encoder_keys=(
            ("encoder.layer.{i}.attention.self.query_proj.{p}", "layers.{i}.attention.query.{p}"),
            ("encoder.layer.{i}.attention.self.key_proj.{p}", "layers.{i}.attention.key.{p}"),
            ("encoder.layer.{i}.attention.self.value_proj.{p}", "layers.{i}.attention.value.{p}"),
            ("encoder.layer.{i}.attention.self.pos_key_proj.{p}", "layers.{i}.attention.position_key.{p}"),
            ("encoder.layer.{i}.attention.self.pos_query_proj.{p}", "layers.{i}.attention.position_query.{p}"),
            ("encoder.rel_embeddings.weight", "relative_attention.embeddings.weight"),
            ("encoder.LayerNorm.{p}", "relative_attention.norm.{p}"),
        ),
    ),
    "deberta": deberta_family(
        architecture_prefix="Deberta",
        fields=lambda config: deberta_fields(config, v1=True),
        tasks=tuple(task for task in ROBERTA_TASKS if task != "multiple-choice"),  # transformers has no v1 class
        extra_encoder_keys=(
            (
                "encoder.layer.{i}.attention.self.in_proj.weight",  # per head [q; k; v]
                tuple(
                    Piece(f"layers.{{i}}.attention.{name}.weight", head_part(index, of=3))
                    for index, name in enumerate(("query", "key", "value"))
                ),
            ),
            ("encoder.layer.{i}.attention.self.q_bias", "layers.{i}.attention.query.bias"),
            ("encoder.layer.{i}.attention.self.v_bias", "layers.{i}.attention.value.bias"),
            ("encoder.layer.{i}.attention.self.pos_proj.weight", "layers.{i}.attention.position_key.weight"),
            ("encoder.layer.{i}.attention.self.pos_q_proj.{p}", "layers.{i}.attention.position_query.{p}"),
            ("encoder.rel_embeddings.weight", "relative_attention.embeddings.weight"),
        ),
    ),
}

# Families that transformers has but EncoderStack's layers cannot express, and why.
REFUSED_FAMILIES = {
    "funnel": "Funnel-Transformer pools the sequence between blocks",
    "longformer": "Longformer's global tokens attend through their own query, key and value projections",
    "big_bird": "BigBird's block-sparse attention is not BERT's dense attention",
}

# Fields that mean the same in BertConfig and EncoderStackConfig.
BERT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "max_position_embeddings",
    "type_vocab_size",
    "initializer_range",
    "layer_norm_eps",
    "pad_token_id",
    "classifier_dropout",
    "tie_word_embeddings",
    "id2label",
    "label2id",
    "problem_type",
)

# `{g}` and `{j}`: ALBERT's group and the layer inside it, our stored layer `{i}` = g * inner_group_num + j
_PLACEHOLDERS = {"i": r"(?P<i>\d+)", "p": r"(?P<p>weight|bias)", "g": r"(?P<g>\d+)", "j": r"(?P<j>\d+)"}


def _compile(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for name, group in _PLACEHOLDERS.items():
        pattern = pattern.replace(re.escape("{" + name + "}"), group)
    return re.compile(pattern + r"\Z")


def translate(key: str, pairs, reverse: bool = False, inner_group_num: int = 1):
    """The other side's name of `key` under the first matching (BERT, EncoderStack) template, or None; forward, a
    `Piece` or a tuple of them where the template says so. Reverse, only plain names translate. `inner_group_num`:
    the layers in each of ALBERT's groups (`{g}`, `{j}`), numbered in order as our stored layers (`{i}`)."""
    for bert, ours in pairs:
        if reverse and not isinstance(ours, str):
            continue
        source, target = (ours, bert) if reverse else (bert, ours)
        match = _compile(source).match(key)
        if match:
            groups = match.groupdict()
            if "g" in groups:
                groups["i"] = int(groups.pop("g")) * inner_group_num + int(groups.pop("j"))
            elif reverse and "{g}" in target:
                groups["g"], groups["j"] = divmod(int(groups["i"]), inner_group_num)
            if isinstance(target, tuple):
                return tuple(piece.format(**groups) for piece in target)
            return target.format(**groups)
    return None


def task_for_architecture(architecture: str) -> tuple[str, Task]:
    """('bert', Task) for 'BertForMaskedLM' and the like; ConversionError for anything else."""
    for name, family in FAMILIES.items():
        for task in TASKS.values():
            if family.has(task) and architecture == family.architecture(task):
                return name, task
    known = sorted(f.architecture(t) for f in FAMILIES.values() for t in TASKS.values() if f.has(t))
    raise ConversionError(f"architecture {architecture!r} cannot be converted; supported: {', '.join(known)}")


def task_for_encoderstack_class(class_name: str) -> Task:
    for task in TASKS.values():
        if task.encoderstack_class == class_name and task.name != "next-sentence":
            return task
    known = sorted({task.encoderstack_class for task in TASKS.values()})
    raise ConversionError(
        f"architecture {class_name!r} is not an EncoderStack class; expected one of {', '.join(known)}"
    )
