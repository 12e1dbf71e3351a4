"""What a BERT checkpoint is in EncoderStack terms: the key map, the tasks, and the config fields.

Everything here is data. The map is a list of (BERT key, EncoderStack key) templates that reads both ways, so
`convert` and `export_bert` share it; `{i}` stands for a layer index and `{p}` for `weight` or `bias`. BERT keys
are written without the `bert.` prefix of its heads, EncoderStack keys without the `model.` prefix of ours.
"""

import re
from dataclasses import dataclass


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


@dataclass(frozen=True)
class Task:
    """One BERT architecture suffix and the EncoderStack class that takes its place."""

    name: str
    bert_suffix: str  # BertModel -> "Model", BertForMaskedLM -> "ForMaskedLM", ...
    encoderstack_class: str
    head_keys: tuple = ()


TASKS = {
    task.name: task
    for task in (
        Task("base", "Model", "EncoderStackModel"),
        Task("masked-lm", "ForMaskedLM", "EncoderStackForMaskedLM", tuple(LM_HEAD_KEYS)),
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
            "sequence-classification",
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
    )
}

# The source model families: architecture prefix, and the EncoderStack fields that their layout implies.
FAMILIES = {
    "bert": ("Bert", {}),
    "megatron-bert": ("MegatronBert", {"norm_placement": "pre", "embedding_norm": False}),
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

# Keys of a BERT checkpoint that are deliberately not converted, with the reason recorded in conversion.json.
SKIPPED_KEYS = {
    "embeddings.position_ids": "buffer: EncoderStack computes positions instead of storing them",
    "cls.predictions.decoder.bias": "same tensor as cls.predictions.bias (BERT ties the two)",
}

_PLACEHOLDERS = {"i": r"(?P<i>\d+)", "p": r"(?P<p>weight|bias)"}


def _compile(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for name, group in _PLACEHOLDERS.items():
        pattern = pattern.replace(re.escape("{" + name + "}"), group)
    return re.compile(pattern + r"\Z")


def translate(key: str, pairs, reverse: bool = False) -> str | None:
    """The other side's name of `key` under the first matching (BERT, EncoderStack) template, or None."""
    for bert, ours in pairs:
        source, target = (ours, bert) if reverse else (bert, ours)
        match = _compile(source).match(key)
        if match:
            return target.format(**match.groupdict())
    return None


def task_for_architecture(architecture: str) -> tuple[str, Task]:
    """('bert', Task) for 'BertForMaskedLM' and the like; ConversionError for anything else."""
    for family, (prefix, _) in FAMILIES.items():
        for task in TASKS.values():
            if architecture == prefix + task.bert_suffix:
                return family, task
    known = sorted(prefix + t.bert_suffix for prefix, _ in FAMILIES.values() for t in TASKS.values())
    raise ConversionError(f"architecture {architecture!r} cannot be converted; supported: {', '.join(known)}")


def task_for_encoderstack_class(class_name: str) -> Task:
    for task in TASKS.values():
        if task.encoderstack_class == class_name and task.name != "next-sentence":
            return task
    known = sorted({task.encoderstack_class for task in TASKS.values()})
    raise ConversionError(
        f"architecture {class_name!r} is not an EncoderStack class; expected one of {', '.join(known)}"
    )
