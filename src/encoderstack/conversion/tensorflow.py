"""Google's original TensorFlow BERT checkpoints as one more source dialect, read without TensorFlow.

A TF variable name becomes the Hugging Face BERT name (`bert/encoder/layer_3/attention/self/query/kernel` ->
`encoder.layer.3.attention.self.query.weight`, transposed), and from there the shared key map takes over.
"""

import re
from pathlib import Path

from .keymap import ConversionError
from .sources import Source, TensorSource, read_config
from .tf_checkpoint import TFCheckpoint, TFCheckpointError, find_checkpoint_prefix

# Google's `gelu` is the tanh approximation; transformers' "gelu" is the exact erf form.
GELU = {"tanh": "gelu_pytorch_tanh", "erf": "gelu"}

# Whole names that the generic rules below would get wrong. (TF name, BERT name)
SPECIAL_NAMES = {
    "cls/predictions/output_bias": "cls.predictions.bias",
    "cls/seq_relationship/output_weights": "cls.seq_relationship.weight",
    "cls/seq_relationship/output_bias": "cls.seq_relationship.bias",
    "output_weights": "classifier.weight",  # run_classifier.py's fine-tuned head
    "output_bias": "classifier.bias",
    "cls/squad/output_weights": "qa_outputs.weight",  # run_squad.py's span head
    "cls/squad/output_bias": "qa_outputs.bias",
}
TRAINING_STATE = re.compile(r"(.*/(adam_[mv]|Adam(_\d+)?|ExponentialMovingAverage)|global_step|beta[12]_power)\Z")


def bert_name(tf_name: str) -> tuple[str, bool]:
    """(Hugging Face BERT name, whether the tensor must be transposed): dense kernels are [in, out] in TF."""
    if tf_name in SPECIAL_NAMES:
        return SPECIAL_NAMES[tf_name], False
    parts = tf_name.removeprefix("bert/").split("/")
    parts = [re.sub(r"\Alayer_(\d+)\Z", r"layer.\1", part) for part in parts]
    last = parts[-1]
    renamed = {"kernel": "weight", "gamma": "weight", "beta": "bias"}.get(last, last)
    if last.endswith("_embeddings"):
        return ".".join(parts) + ".weight", False
    return ".".join(parts[:-1] + [renamed]), last == "kernel"


class TFCheckpointSource(TensorSource):
    format = "tensorflow checkpoint (V2 bundle)"

    def __init__(self, prefix: Path):
        self.checkpoint = TFCheckpoint(prefix)
        self.files = [Path(f"{prefix}.index"), *sorted(prefix.parent.glob(f"{prefix.name}.data-*"))]

    def keys(self):
        return self.checkpoint.names()

    def shape(self, key):
        return self.checkpoint.shape(key)

    def dtype(self, key):
        return self.checkpoint.dtype(key)

    def get(self, key):
        return self.checkpoint.get_tensor(key)

    def file_of(self, key):
        return self.files[0]

    def close(self):
        self.checkpoint.close()


def architecture(names: set[str], tensors: TFCheckpointSource) -> tuple[str, dict]:
    """The BERT class a Google checkpoint amounts to, from the heads it holds."""
    if "output_weights" in names:
        shape = tensors.shape("output_weights")
        if len(shape) != 2 or shape[0] < 1:
            raise ConversionError(
                f"{tensors.file_of('output_weights')}: variable 'output_weights' has shape "
                f"{list(shape)}; a classifier's is [num_labels >= 1, hidden_size]"
            )
        return "BertForSequenceClassification", {"num_labels": shape[0]}
    if "cls/squad/output_weights" in names:
        return "BertForQuestionAnswering", {"num_labels": 2}
    if "cls/predictions/output_bias" in names:
        return ("BertForPreTraining" if "cls/seq_relationship/output_weights" in names else "BertForMaskedLM"), {}
    return "BertModel", {}


def default_lowercase(folder: Path) -> tuple[bool, str]:
    """Google names its releases uncased_L-12_H-768_A-12 / cased_L-12_...: lower-case unless it says cased."""
    name = folder.name.lower()
    if "uncased" in name:
        return True, f"folder name {folder.name!r} says uncased"
    if "cased" in name:
        return False, f"folder name {folder.name!r} says cased"
    return True, "no cased/uncased in the folder name: BERT's default"


SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def check_vocab(vocab: Path, vocab_size) -> None:
    """A vocab.txt that BERT's tokenizer can use with this checkpoint: UTF-8, one token a line, BERT's special
    tokens, and no id beyond the embedding table."""
    try:
        tokens = vocab.read_text(encoding="utf-8").removesuffix("\n").split("\n")
    except UnicodeDecodeError as error:
        raise ConversionError(f"{vocab}: not UTF-8 text (byte {error.start}); expected one token a line") from None
    if tokens == [""]:
        raise ConversionError(f"{vocab}: empty; a BERT vocabulary lists one token a line")
    missing = [token for token in SPECIAL_TOKENS if token not in set(tokens)]
    if missing:
        raise ConversionError(f"{vocab}: not a BERT vocabulary ({len(tokens)} lines, no {' '.join(missing)})")
    if isinstance(vocab_size, int) and len(tokens) > vocab_size:
        raise ConversionError(f"{vocab}: {len(tokens)} tokens, more than the checkpoint's vocab_size {vocab_size}")


def open_tf_source(path: Path, gelu: str = "tanh", lowercase: bool | None = None):
    """A `Source` for a Google checkpoint folder or prefix; None if `path` is not a TensorFlow checkpoint."""
    prefix = find_checkpoint_prefix(path)
    if prefix is None:
        return None
    if gelu not in GELU:
        raise ConversionError(f"gelu must be one of {sorted(GELU)}, got {gelu!r}")
    folder = prefix.parent
    config = read_config(folder, "bert_config.json")
    tensors = TFCheckpointSource(prefix)
    names = set(tensors.keys())
    arch, extra = architecture(names, tensors)
    notes = {}
    if config.get("hidden_act") == "gelu":
        config["hidden_act"] = GELU[gelu]
        notes["gelu"] = f"{gelu}: hidden_act={GELU[gelu]!r}" + (
            " (Google's original, tanh approximation)"
            if gelu == "tanh"
            else " (exact erf form, transformers' historical choice)"
        )
    config.update(model_type="bert", architectures=[arch], **extra)
    skipped, bert_names = {}, {}
    for name in sorted(names):
        if TRAINING_STATE.match(name):
            skipped[name] = "training state (optimizer slot or step counter), not a model weight"
        else:
            bert_names[name] = bert_name(name)
    vocab = folder / "vocab.txt"
    write_tokenizer = None
    if vocab.is_file():
        check_vocab(vocab, config.get("vocab_size"))
        lower, why = default_lowercase(folder) if lowercase is None else (lowercase, "chosen with --lowercase/--cased")
        notes["tokenizer"] = f"BertTokenizer from vocab.txt, do_lower_case={lower} ({why})"

        def write_tokenizer(output: Path):
            from transformers import BertTokenizer

            BertTokenizer(str(vocab), do_lower_case=lower).save_pretrained(output)
    else:
        notes["tokenizer"] = "none: the checkpoint folder has no vocab.txt"
    return Source(
        folder,
        config,
        tensors,
        bert_names,
        skipped,
        notes=notes,
        write_extras=write_tokenizer,
        copy_other_files=False,
        reference="google",
        config_file="bert_config.json",
    )


__all__ = ["GELU", "TFCheckpointError", "bert_name", "open_tf_source"]
