"""`encoderstack pretrain`: masked-LM pre-training, from scratch or continued from a checkpoint, on transformers'
Trainer. Every batch is one flattened row (`DataCollatorWithFlattening`: no padding, each sequence attends only to
itself), masked example by example with transformers' own masking.

Text is `.txt` (one paragraph a line, blank lines between documents), `.jsonl` (a `text` field a line) or a folder of
them, read line by line (checked as it is read) into a `datasets` Arrow cache that lives only as long as the run.
"""

import collections
import dataclasses
import hashlib
import json
import math
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import transformers

from . import training
from .checkpoint import TOKENIZER_FILES, has_tokenizer, sha256
from .configuration_encoderstack import EncoderStackConfig
from .jsonfile import read_json_object
from .modeling_encoderstack import EncoderStackForMaskedLM
from .training import (
    CommandTrainingArguments,
    DataError,
    TrainingError,
    check_weights,
    checkpoints,
    datasets_offline,
    flattening_collator,
    is_complete,
    is_integer,
    load_tokenizer,
    model_config,
    output_beside_checkpoints,
    plot_losses,
    require_matplotlib,
    setting,
    settings_from,
    settings_record,
    source_family,
)

TEXT_SUFFIXES = (".txt", ".jsonl")
METRICS = ("mlm_loss", "perplexity", "accuracy")
EVAL_MASK_SEED = 1234  # one masking of the evaluation text for every run, so that runs compare
HELD_OUT = 0.1  # of the training documents, when no evaluation text is given
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PREPARATION_SEQUENCES = 32
ADMIN_PROFILING_SEQUENCES = PREPARATION_SEQUENCES  # the old name, kept for one release


class PretrainError(TrainingError):
    """A pre-training run that cannot start: its settings, its model or config, or its resume state."""


@dataclass
class PretrainArguments:
    """What `pretrain` itself takes (Trainer's settings are `PretrainTrainingArguments`)."""

    # recorded by content in the run's inputs, or not a setting of the run
    RUN_ONLY: ClassVar = (
        "model",
        "config",
        "tokenizer",
        "train_tokenizer",
        "train",
        "eval",
        "num_proc",
        "resume",
        "force",
    )

    model: str | None = setting(None, "EncoderStack or BERT folder to continue from (converted on the fly)")
    config: str | None = setting(None, "a fresh model: EncoderStackConfig fields key=value,... or a JSON file")
    tokenizer: str | None = setting(None, "a fresh model's tokenizer (a folder)")
    train_tokenizer: int | None = dataclasses.field(
        default=None,
        metadata={"help": "a fresh model's tokenizer: WordPiece trained on its text", "metavar": "VOCAB_SIZE"},
    )
    train: str | None = setting(
        None, ".txt (a paragraph a line, blank lines between documents), .jsonl (a text field), or a folder of them"
    )
    eval: str | None = setting(None, "evaluation text, as --train (default: a held-out tenth of its documents)")
    mlm_probability: float = setting(0.15, "share of the tokens masked")
    whole_word_mask: bool = setting(False, "mask whole words (all with [MASK])")
    max_length: int = setting(128, "tokens per sequence, [CLS] and [SEP] in")
    num_proc: int | None = setting(None, "processes that tokenize the text (datasets.map; default: this one)")
    resume: bool = setting(False, "continue from the last checkpoint of an unfinished run")
    force: bool = setting(False, "replace an existing output folder, or start over")

    def __post_init__(self):
        if self.train is None:
            raise PretrainError("no training text given (train, --train)")
        if not (isinstance(self.mlm_probability, (int, float)) and 0 < self.mlm_probability < 1):
            raise PretrainError(f"mlm_probability must lie strictly between 0 and 1, got {self.mlm_probability!r}")
        if not (is_integer(self.max_length) and self.max_length >= 3):
            raise PretrainError(f"max_length must be at least 3 ([CLS], a token, [SEP]), got {self.max_length!r}")
        if self.num_proc is not None and not (is_integer(self.num_proc) and self.num_proc > 0):
            raise PretrainError(f"num_proc must be a positive integer, got {self.num_proc!r}")
        if (self.model is None) == (self.config is None):
            raise PretrainError("give a model folder (model, --model) or a fresh model's config (config, --config)")
        if self.model is not None and (self.tokenizer is not None or self.train_tokenizer is not None):
            raise PretrainError(f"{self.model}: continued pre-training uses the model folder's own tokenizer")
        if self.model is None and (self.tokenizer is None) == (self.train_tokenizer is None):
            raise PretrainError(
                "a fresh model (config) needs exactly one of tokenizer (a folder) or train_tokenizer "
                "(a vocabulary size)"
            )


@dataclass
class PretrainTrainingArguments(CommandTrainingArguments):
    """Trainer's settings for pre-training: an evaluation and a checkpoint every quarter of the run (the last step
    included), the best kept by the masked-LM loss, the tokens seen counted."""

    output_dir: str | None = setting("encoderstack-pretrained", "where the best checkpoint goes", "--output")
    num_train_epochs: float = setting(1.0, "passes over the text (max_steps overrides it)", "--epochs")
    per_device_train_batch_size: int = setting(32, "sequences per process and step", "--batch-size")
    per_device_eval_batch_size: int = setting(32, "sequences per process in evaluation")
    lr_scheduler_type: transformers.SchedulerType | str = setting(
        "linear",
        "learning-rate schedule after the warm-up (constant: constant_with_warmup when warming up)",
        "--scheduler",
    )
    warmup_steps: float = setting(0, "linear warm-up: optimizer steps, or below 1 a share of the run", "--warmup-ratio")
    eval_strategy: str = setting("steps", "when to evaluate (and keep the best checkpoint)")
    eval_steps: float | None = setting(0.25, "steps between evaluations, or below 1 a share of the run")
    save_steps: float | None = setting(None, "steps between checkpoints (default: eval_steps)")
    logging_steps: float = setting(0.05, "steps between loss logs, or below 1 a share of the run")
    logging_first_step: bool = setting(True, "log the loss of the first step")
    load_best_model_at_end: bool = setting(True, "keep the best checkpoint (pretrain needs it)")
    metric_for_best_model: str | None = setting("mlm_loss", "the metric the best checkpoint is chosen by")
    include_num_input_tokens_seen: str | bool = setting(True, "count the training tokens (tokens/s, pretrain.json)")
    remove_unused_columns: bool = setting(False, "pretrain's collator needs every column")

    def __post_init__(self):
        if self.save_steps is None:
            self.save_steps = self.eval_steps
        if self.lr_scheduler_type == "constant" and self.warmup_steps:
            self.lr_scheduler_type = "constant_with_warmup"
        super().__post_init__()


# ---------------------------------------------------------------------------------------------------------------- data


def text_files(path) -> list[Path]:
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise DataError(f"{path}: no .txt or .jsonl files in the folder")
        return files
    if not path.is_file():
        raise DataError(f"{path}: no such file or folder")
    if path.suffix not in TEXT_SUFFIXES:
        raise DataError(f"{path}: not a .txt or .jsonl file")
    return [path]


def jsonl_text(line: str, path: Path, number: int) -> str:
    try:
        row = json.loads(line)
    except ValueError as error:
        raise DataError(f"{path}: line {number}: not a JSON object ({error})") from None
    if not isinstance(row, dict) or "text" not in row:
        raise DataError(f"{path}: line {number}: missing field 'text'")
    if not isinstance(row["text"], str) or not row["text"].strip():
        raise DataError(f"{path}: line {number}: field 'text' must be a non-empty string, got {row['text']!r}")
    return row["text"].strip()


def documents(path: Path):
    """(first line, text) of each document: a `.txt` file's runs of non-blank lines (one paragraph each, joined by
    newlines), or a `.jsonl` line's `text`. Streams the file; raises DataError naming the line of anything unusable."""
    found, start, paragraphs = False, None, []
    with path.open("rb") as stream:
        for number, raw in enumerate(stream, start=1):
            try:
                line = raw.decode("utf-8").removeprefix("\ufeff" if number == 1 else "")
            except UnicodeDecodeError as error:
                raise DataError(
                    f"{path}: line {number}: not UTF-8 text ({error.reason} at byte {error.start} of the line)"
                ) from None
            if path.suffix == ".jsonl":
                if line.strip():
                    found = True
                    yield number, jsonl_text(line, path, number)
            elif line.strip():
                start = start or number
                paragraphs.append(line.strip())
            elif paragraphs:
                found = True
                yield start, "\n".join(paragraphs)
                start, paragraphs = None, []
    if paragraphs:
        yield start, "\n".join(paragraphs)
    elif not found:
        raise DataError(f"{path}: no text (the file is empty or blank)")


def read_documents(files):
    """The `datasets` generator: a row per document. `files` carries each file's index (`datasets` calls the
    generator once per file, with a list of one) and sha256 (so that the cache's fingerprint changes with the
    contents)."""
    for index, name, _digest in files:
        for line, text in documents(Path(name)):
            yield {"text": text, "file": index, "line": line}


def load_documents(files: dict, cache: Path):
    """The documents of `files` (path -> sha256) as a `datasets.Dataset` cached under `cache`."""
    with datasets_offline() as datasets:
        try:
            return datasets.Dataset.from_generator(
                read_documents,
                cache_dir=str(cache),
                gen_kwargs={"files": [(i, str(f), d) for i, (f, d) in enumerate(files.items())]},
            )
        except datasets.exceptions.DatasetGenerationError as error:
            if isinstance(error.__cause__, DataError):
                raise error.__cause__ from None
            raise


def chunker(tokenizer, max_length: int, offsets: bool):
    """`datasets.map` function: each document's tokens, end to end, cut into sequences of at most `max_length`
    ([CLS] ... [SEP]), with the tokens of each that are not the unknown token counted (`known`). With `offsets`
    (whole-word masking), character offsets that keep words apart across lines."""
    body, cls, sep, unknown = max_length - 2, tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.unk_token_id

    def chunk(batch):
        out = {"input_ids": [], "file": [], "length": [], "known": [], **({"offsets": []} if offsets else {})}
        for text, file in zip(batch["text"], batch["file"]):
            lines = text.split("\n")
            encoded = tokenizer(lines, add_special_tokens=False, return_offsets_mapping=offsets, verbose=False)
            ids = [token for line in encoded["input_ids"] for token in line]
            if offsets:
                spans, base = [], 0
                for line, line_spans in zip(lines, encoded["offset_mapping"]):
                    spans += [(base + a, base + b) for a, b in line_spans]
                    base += len(line) + 1
            for start in range(0, len(ids), body):
                out["input_ids"].append([cls, *ids[start : start + body], sep])
                out["file"].append(file)
                out["length"].append(len(out["input_ids"][-1]))
                out["known"].append(sum(token != unknown for token in ids[start : start + body]))
                if offsets:
                    out["offsets"].append([(0, 0), *spans[start : start + body], (0, 0)])
        return out

    return chunk


def example_seed(seed: int, epoch: int, row: int) -> int:
    """The masking seed of one sequence (its `row` in the training set) in one epoch. A run masks each sequence the
    same way whether or not it was interrupted and resumed: one generator for the whole run would restart on resume,
    and its state at a checkpoint would be a batch off (accelerate collates a batch ahead of the one trained)."""
    return int.from_bytes(hashlib.blake2b(f"{seed} {epoch} {row}".encode(), digest_size=8).digest(), "little")


class MaskedFlattening(transformers.TrainerCallback):
    """The collator: masks each sequence on its own with transformers' `DataCollatorForLanguageModeling` logic
    (BERT's 80/10/10, or whole words), seeded by (seed, epoch, row), then flattens the batch into one row. Sequences
    that already carry labels (the evaluation set, masked once with a fixed seed) are flattened as they are. As a
    Trainer callback it learns the epoch, so that each epoch masks a sequence anew."""

    def __init__(self, tokenizer, mlm_probability: float, whole_word_mask: bool, seed: int):
        with warnings.catch_warnings():  # whole words: transformers masks with [MASK] only, and says so each time
            warnings.simplefilter("ignore")
            self.masking = transformers.DataCollatorForLanguageModeling(
                tokenizer, mlm_probability=mlm_probability, whole_word_mask=whole_word_mask, seed=seed
            )
        self.seed, self.epoch = seed, 0
        self.special = torch.tensor(tokenizer.all_special_ids)
        self.flatten = flattening_collator()

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.epoch = int(state.epoch)  # a resumed run begins in the epoch it was interrupted in

    def mask(self, example: dict, row: int) -> dict:
        self.masking.generator = torch.Generator().manual_seed(example_seed(self.seed, self.epoch, row))
        ids = torch.tensor(example["input_ids"])[None]
        offsets = torch.tensor(example["offsets"])[None] if "offsets" in example else None
        ids, labels = self.masking.torch_mask_tokens(
            ids, special_tokens_mask=torch.isin(ids, self.special), offset_mapping=offsets
        )
        return {"input_ids": ids[0].tolist(), "labels": labels[0].tolist()}

    def __call__(self, examples):
        # Trainer evaluates with the training collator too: the evaluation set comes masked once, and stays so
        return self.flatten(
            [example if "labels" in example else self.mask(example, example["row"]) for example in examples]
        )


def data_record(files: dict, chunks) -> list[dict]:
    """Each file with its sha256 and the sequences and tokens it gave (of the split `chunks` holds)."""
    per_file = [{"file": str(f), "sha256": digest, "sequences": 0, "tokens": 0} for f, digest in files.items()]
    for file, length in zip(chunks["file"], chunks["length"]):
        per_file[file]["sequences"] += 1
        per_file[file]["tokens"] += length
    return per_file


# --------------------------------------------------------------------------------------------------- model, tokenizer


def config_fields(config) -> dict:
    """EncoderStackConfig fields from a dict, a JSON file, or `key=value,key=value` (values read as JSON, else as
    strings)."""
    if isinstance(config, EncoderStackConfig):
        return config.to_diff_dict()
    if isinstance(config, dict):
        return dict(config)
    text = str(config)
    if text.endswith(".json") or Path(text).is_file():
        return read_json_object(Path(text), PretrainError)
    fields = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise PretrainError(f"config: {item!r} is not key=value")
        try:
            fields[key.strip()] = json.loads(value)
        except ValueError:
            fields[key.strip()] = value.strip()
    return fields


def checked_config(config) -> dict:
    """The fields of a fresh model's config, refused here (before any data is read) if EncoderStackConfig would."""
    fields = config_fields(config)
    if unknown := sorted(set(fields) - set(EncoderStackConfig().to_dict())):
        raise PretrainError(f"config: unknown field {unknown[0]!r} (not an EncoderStackConfig field)")
    try:
        EncoderStackConfig(**{"vocab_size": 1, **fields})
    except Exception as error:  # the config's own validation names the field (huggingface_hub wraps it)
        raise PretrainError(f"config: {' '.join(str(error.__cause__ or error).split())}") from None
    return fields


def fresh_config(fields: dict, tokenizer) -> EncoderStackConfig:
    fields = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, **fields}
    if not is_integer(fields["vocab_size"]) or fields["vocab_size"] < len(tokenizer):
        raise PretrainError(
            f"config: vocab_size {fields['vocab_size']!r} is less than the tokenizer's {len(tokenizer)} tokens"
        )
    return EncoderStackConfig(**fields, architectures=["EncoderStackForMaskedLM"])


def train_wordpiece(texts, vocab_size: int):
    """A BERT-style (lower-cased) WordPiece tokenizer trained on `texts` with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.decoder = decoders.WordPiece()
    wordpiece.train_from_iterator(
        texts,
        trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False),
    )
    cls, sep = wordpiece.token_to_id("[CLS]"), wordpiece.token_to_id("[SEP]")
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=wordpiece,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def check_tokenizer(tokenizer, where) -> None:
    for name in ("cls_token", "sep_token", "mask_token"):
        if getattr(tokenizer, name) is None:
            raise PretrainError(
                f"{where}: the tokenizer has no {name}; masked-LM pre-training needs [CLS], [SEP] and [MASK]"
            )


def check_tokenizer_folder(tokenizer) -> None:
    folder = Path(tokenizer)
    if not folder.is_dir():
        raise PretrainError(f"{folder}: no such tokenizer folder")
    if not has_tokenizer(folder):
        raise PretrainError(f"{folder}: no tokenizer files ({' or '.join(TOKENIZER_FILES)}) in the folder")


def choose_tokenizer(model, tokenizer, train_tokenizer, config, documents, saved=None):
    if saved is not None:  # a resumed run's own tokenizer: training another would give other ids
        return load_tokenizer(saved, config or {})
    if model is not None:
        return load_tokenizer(model, config)
    if tokenizer is not None:
        return load_tokenizer(tokenizer, {})
    if not (is_integer(train_tokenizer) and train_tokenizer > len(SPECIAL_TOKENS)):
        raise PretrainError(
            f"train_tokenizer must be a vocabulary size above {len(SPECIAL_TOKENS)}, got {train_tokenizer!r}"
        )
    return train_wordpiece((row["text"] for row in documents), train_tokenizer)


def starting_model(model, config, tokenizer, train_set):
    """The model to train and the tensors it had to initialize (the MLM head of a folder without one). A fresh model
    prepares itself for training on the first training sequences (`prepare_for_training`)."""
    if model is None:
        network = EncoderStackForMaskedLM(fresh_config(config, tokenizer))
        rows = train_set[:PREPARATION_SEQUENCES]["input_ids"]
        network.prepare_for_training(*padded_ids(rows, tokenizer.pad_token_id))
        return network, ["all (a fresh model)"]
    network, info = EncoderStackForMaskedLM.from_pretrained(model, output_loading_info=True)
    return network, sorted(info["missing_keys"])


def padded_ids(rows: list[list[int]], fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids padded with `fill` into one batch: (ids, attention_mask)."""
    longest = max(map(len, rows))
    pads = [longest - len(row) for row in rows]
    input_ids = [row + [fill] * pad for row, pad in zip(rows, pads)]
    attention_mask = [[1] * len(row) + [0] * pad for row, pad in zip(rows, pads)]
    return torch.tensor(input_ids), torch.tensor(attention_mask)


# ----------------------------------------------------------------------------------------------------------- training


def token_scores(logits, labels):
    """Per-token loss and prediction for the metrics (keeping the logits would hold tokens x vocabulary floats)."""
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none")
    return torch.stack([loss.view(labels.shape), logits.argmax(-1).float()], dim=-1)


def mlm_metrics(prediction: transformers.EvalPrediction) -> dict:
    """Masked-LM loss over every masked token of the evaluation set (not a mean of batch means), its perplexity, and
    the fraction of masked tokens predicted exactly."""
    labels = prediction.label_ids
    keep = labels != -100
    loss = float(prediction.predictions[..., 0][keep].mean())
    accuracy = float((prediction.predictions[..., 1][keep] == labels[keep]).mean())
    return {"mlm_loss": loss, "perplexity": math.exp(min(loss, 700.0)), "accuracy": accuracy}


def folder_digest(folder) -> dict:
    """The sha256 of each file of a model or tokenizer folder but its card: what a resumed run must find again."""
    return {p.name: sha256(p) for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != "README.md"}


def run_inputs(model, config, tokenizer, train_tokenizer, train_files: dict, eval_files: dict) -> dict:
    """What a run is made from, by content (as JSON would give it back): a resumed run must be made from the same."""
    inputs = {
        "train": list(train_files.values()),
        "eval": list(eval_files.values()),
        "model": folder_digest(model) if model is not None else None,
        "config": config,
        "tokenizer": folder_digest(tokenizer) if tokenizer is not None else None,
        "train_tokenizer": train_tokenizer,
    }
    return json.loads(json.dumps(inputs, default=str))


INPUT_NAMES = {
    "train": "the training text (train, --train)",
    "eval": "the evaluation text (eval, --eval)",
    "model": "the model folder (model, --model)",
    "config": "the config (config, --config)",
    "tokenizer": "the tokenizer folder (tokenizer, --tokenizer)",
    "train_tokenizer": "train_tokenizer (--train-tokenizer)",
}


def changed_input(saved: dict, inputs: dict) -> str | None:
    """How this run's inputs differ from the interrupted run's, in words; None if they do not."""
    for key, value in inputs.items():
        before = saved.get(key)
        if before == value:
            continue
        if isinstance(before, dict) and isinstance(value, dict):
            name = min(name for name in {*before, *value} if before.get(name) != value.get(name))
            return f"{INPUT_NAMES[key]}: {name} is not the interrupted run's"
        if isinstance(value, list):
            return f"{INPUT_NAMES[key]} is not the interrupted run's (the sha256 of its files differ)"
        return f"{INPUT_NAMES[key]} was {before!r} in the interrupted run, now {value!r}"
    return None


def resume_point(scratch: Path, resume: bool, force: bool, run: dict) -> str | None:
    """The checkpoint to resume from (None: start over), once the interrupted run is known to be this one: the same
    settings and inputs (`run`), its tokenizer saved, a complete checkpoint (one whose save was not cut short)."""
    saved_points = checkpoints(scratch)
    if not resume:
        if saved_points and not force:
            raise PretrainError(
                f"{scratch}: checkpoints of an unfinished run; pass --resume (resume=True) to continue "
                "it or --force (force=True) to start over"
            )
        return None
    if not saved_points:
        raise PretrainError(f"{scratch}: no checkpoint to resume from")
    saved = read_json_object(scratch / "run.json", PretrainError)
    settings, saved_settings = run["settings"], saved.get("settings", {})
    if changed := sorted(key for key in {*settings, *saved_settings} if saved_settings.get(key) != settings.get(key)):
        raise PretrainError(
            f"{scratch}: the interrupted run had {changed[0]}={saved_settings.get(changed[0])!r}, this one "
            f"{settings.get(changed[0])!r}; resume with the same settings"
        )
    if difference := changed_input(saved.get("inputs", {}), run["inputs"]):
        raise PretrainError(f"{scratch}: {difference}; resume with the same inputs, or start over with --force")
    if not has_tokenizer(scratch / "tokenizer"):
        raise PretrainError(f"{scratch}: the interrupted run's tokenizer is missing; start over with --force")
    complete = list(filter(is_complete, saved_points))
    if not complete:
        raise PretrainError(
            f"{scratch}: no complete checkpoint to resume from ({saved_points[-1].name} was interrupted while being "
            "saved); start over with --force"
        )
    for partial in saved_points[saved_points.index(complete[-1]) + 1 :]:
        print(
            f"{partial}: incomplete (its save was interrupted), removed; resuming from {complete[-1].name}",
            file=sys.stderr,
        )
        shutil.rmtree(partial, ignore_errors=True)
    return str(complete[-1])


def pretrain(**settings) -> dict:
    """Masked-LM pre-training of `model` (an EncoderStack or BERT folder, converted on the fly) or of a fresh model
    from `config` (fields as a dict, a JSON file or `key=value,...`) with `tokenizer` (a folder) or a WordPiece
    tokenizer trained on `train` (`train_tokenizer`: its vocabulary size). Evaluates on `eval` (default: a held-out
    tenth of the training documents) before training and every `eval_steps` (default: a quarter of the run), keeps
    the best checkpoint, and writes it to `output` with the tokenizer, `pretrain.json`, `loss.png` and a model card.
    `settings`: the fields of `PretrainArguments` and of `PretrainTrainingArguments` (every `TrainingArguments`
    field, e.g. `bf16=True`), or their aliases (`output`, `epochs`, `batch_size`, `lr`, `scheduler`).

    Settings, model folder and data are all checked before any model is built (PretrainError, DataError)."""
    ours, trainer_settings = settings_from(settings, PretrainArguments, PretrainTrainingArguments)
    run = PretrainArguments(**ours)
    args = PretrainTrainingArguments(**trainer_settings)
    args.check_run("pretrain", METRICS, ("labels",), load_best_model_at_end=True, remove_unused_columns=False)
    require_matplotlib("pretrain")
    inputs = [run.model, run.config, run.tokenizer, run.train, run.eval]
    destination = output_beside_checkpoints(args, run.force, inputs)
    scratch = Path(args.output_dir)  # until the run has finished: `resume` picks up the last one
    folder_config = model_config(run.model) if run.model is not None else None
    if run.model is not None:
        check_weights(run.model, PretrainError)
    if run.tokenizer is not None:
        check_tokenizer_folder(run.tokenizer)
    config = checked_config(run.config) if run.config is not None else None
    check_positions(run.max_length, folder_config or config)
    train_files = {f: sha256(f) for f in text_files(run.train)}
    eval_files = {f: sha256(f) for f in text_files(run.eval)} if run.eval is not None else {}
    settings = settings_record(run, args)
    inputs = run_inputs(run.model, config, run.tokenizer, run.train_tokenizer, train_files, eval_files)
    checkpoint = resume_point(scratch, run.resume, run.force, {"settings": settings, "inputs": inputs})
    with destination.scratch("data") as cache:  # removed on a terminating signal too, not only on Ctrl-C
        tokenizer, train_set, eval_set, data = prepare_text(
            train_files,
            eval_files,
            train=run.train,
            cache=Path(cache),
            max_length=run.max_length,
            mlm_probability=run.mlm_probability,
            seed=args.seed,
            model=run.model,
            tokenizer=run.tokenizer,
            train_tokenizer=run.train_tokenizer,
            folder_config=folder_config,
            whole_word_mask=run.whole_word_mask,
            num_proc=run.num_proc,
            eval=run.eval,
            saved_tokenizer=scratch / "tokenizer" if checkpoint is not None else None,
        )
        record = {
            "base_model": str(run.model) if run.model is not None else None,
            "source_family": source_family(run.model) if run.model is not None else None,
            "data": data,
            "settings": settings,
            "inputs": inputs,
        }
        return train_and_save(run, args, config, tokenizer, train_set, eval_set, destination, checkpoint, record)


def check_positions(max_length: int, config: dict) -> None:
    if config.get("position_embedding_type", "absolute") == "absolute":
        positions = config.get("max_position_embeddings", EncoderStackConfig().max_position_embeddings)
        if max_length > positions:
            raise PretrainError(
                f"max_length {max_length} is more than the model's {positions} learned positions "
                "(max_position_embeddings)"
            )


def held_out(documents, train, seed: int):
    """A seeded tenth of the training documents for evaluation (whole documents: no sequence is in both)."""
    if len(documents) < 2:
        raise DataError(
            f"{train}: {len(documents)} document; holding out evaluation text needs at least 2 (or give eval, --eval)"
        )
    return documents.train_test_split(test_size=max(1, round(HELD_OUT * len(documents))), seed=seed)


def prepare_text(
    train_files: dict,
    eval_files: dict,
    *,
    train,
    cache: Path,
    max_length: int,
    mlm_probability: float,
    seed: int,
    model=None,
    tokenizer=None,
    train_tokenizer=None,
    folder_config=None,
    whole_word_mask: bool = False,
    num_proc=None,
    eval=None,
    saved_tokenizer=None,
):
    """The pre-training data path: documents read into `datasets` under `cache`, the tokenizer (a resumed run's
    `saved_tokenizer`, the model folder's, a folder, or trained on the training documents), each document cut into
    sequences, the evaluation set masked once. Text that gives no tokens, or no masked evaluation token, is refused
    here. Returns (tokenizer, train_set, eval_set, the data record)."""
    train_docs = load_documents(train_files, cache / "train")
    if eval_files:
        eval_docs = load_documents(eval_files, cache / "eval")
    else:
        split = held_out(train_docs, train, seed)
        train_docs, eval_docs = split["train"], split["test"]
    tokenizer = choose_tokenizer(model, tokenizer, train_tokenizer, folder_config, train_docs, saved_tokenizer)
    check_tokenizer(tokenizer, model or "tokenizer")
    chunk = chunker(tokenizer, max_length, whole_word_mask)
    train_set, eval_set = (
        docs.map(
            chunk,
            batched=True,
            remove_columns=docs.column_names,
            num_proc=num_proc,
            new_fingerprint=f"{name}-chunks",
            desc=f"Tokenizing the {name} text",
        )
        for name, docs in (("train", train_docs), ("eval", eval_docs))
    )
    eval_source = eval if eval_files else f"{train} (its held-out evaluation documents)"
    # a training file's documents may all have been held out: its sequences are then all in the evaluation set
    check_tokens(train_files, [train_set] if eval_files else [train_set, eval_set], tokenizer.unk_token)
    check_tokens(eval_files, [eval_set], tokenizer.unk_token)
    for where, split in ((train, train_set), (eval_source, eval_set)):
        refuse_tokenless(where, len(split), len(split) and sum(split["known"]), tokenizer.unk_token)
    data = {
        "train": data_record(train_files, train_set),
        "eval": data_record(eval_files, eval_set) if eval_files else f"{len(eval_docs)} held-out training documents",
        "train_sequences": len(train_set),
        "train_tokens": sum(train_set["length"]),
        "eval_sequences": len(eval_set),
        "eval_tokens": sum(eval_set["length"]),
    }
    eval_set = eval_set.map(
        MaskedFlattening(tokenizer, mlm_probability, whole_word_mask, EVAL_MASK_SEED).mask,
        with_indices=True,
        remove_columns=eval_set.column_names,
        new_fingerprint="eval-masked",
        desc="Masking the eval text",
    )
    data["eval_masked_tokens"] = sum(sum(label != -100 for label in row) for row in eval_set["labels"])
    if not data["eval_masked_tokens"]:  # the evaluation loss would be undefined, and found out after training
        raise DataError(
            f"{eval_source}: masking left none of its {data['eval_tokens']} tokens masked (mlm_probability "
            f"{mlm_probability}; [CLS], [SEP] and other special tokens are never masked); give more evaluation text"
        )
    train_set = train_set.select_columns(["input_ids", *(["offsets"] if whole_word_mask else [])])
    train_set = train_set.add_column("row", range(len(train_set)))  # each sequence's masking seed: example_seed
    return tokenizer, train_set, eval_set, data


def check_tokens(files: dict, splits: list, unknown_token) -> None:
    """Each of `files` (the index of each in the sequences' `file`), over its sequences in all of `splits`."""
    sequences, known = collections.Counter(), collections.Counter()
    for split in filter(len, splits):  # an empty split has no columns
        for file, count in zip(split["file"], split["known"]):
            sequences[file] += 1
            known[file] += count
    for index, file in enumerate(files):
        refuse_tokenless(file, sequences[index], known[index], unknown_token)


def refuse_tokenless(where, sequences: int, known: int, unknown_token) -> None:
    """Text the tokenizer turns into nothing (control characters only, say), or into its unknown token only (text in
    a script its vocabulary lacks), fails before training, named."""
    if not sequences:
        raise DataError(f"{where}: no tokens (the tokenizer turns the text into nothing)")
    if not known:
        raise DataError(
            f"{where}: every token is the unknown token {unknown_token} (a tokenizer for another language or script?)"
        )


def mlm_trainer(
    network, args, tokenizer, train_set, eval_set, mlm_probability: float, whole_word_mask: bool, **kwargs
) -> transformers.Trainer:
    """A pre-training Trainer: masking each sequence on its own, then flattening; the masked-LM metrics."""
    collator = MaskedFlattening(tokenizer, mlm_probability, whole_word_mask, args.seed)
    trainer = transformers.Trainer(
        model=network,
        args=args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        data_collator=collator,
        compute_metrics=mlm_metrics,
        preprocess_logits_for_metrics=token_scores,
        **kwargs,
    )
    trainer.add_callback(collator)
    return trainer


def train_and_save(run, args, config, tokenizer, train_set, eval_set, destination, checkpoint, record) -> dict:
    scratch = Path(args.output_dir)
    transformers.set_seed(args.seed)
    network, initialized = starting_model(run.model, config, tokenizer, train_set)
    if args.should_save and checkpoint is None:  # starting over: an older run's checkpoints must not pass for ours
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True, exist_ok=True)
        (scratch / "run.json").write_text(
            json.dumps({"settings": record["settings"], "inputs": record["inputs"]}, indent=2)
        )
        tokenizer.save_pretrained(scratch / "tokenizer")  # --resume reuses it: a trained one would come out otherwise
    trainer = mlm_trainer(network, args, tokenizer, train_set, eval_set, run.mlm_probability, run.whole_word_mask)
    # the best checkpoint's own evaluation: the eval masking is fixed, so evaluating it again would repeat it exactly
    return training.train_and_save(
        trainer,
        tokenizer,
        destination,
        "pretrain.json",
        {**record, "initialized": initialized},
        lambda *outcome: results(*outcome, resumed_from=checkpoint),
        plot,
        evaluate_best=False,
        resume_from_checkpoint=checkpoint,
        resumable=True,
    )


def results(trainer, output, history, before, after, best_step, resumed_from) -> dict:
    trained_tokens = trainer.state.num_input_tokens_seen
    return {
        "eval_loss_before": before["eval_mlm_loss"],
        "eval_loss_after": after["eval_mlm_loss"],
        "before": {name: before[f"eval_{name}"] for name in METRICS},
        "after": {name: after[f"eval_{name}"] for name in METRICS},
        "steps": trainer.state.global_step,
        "trained_tokens": trained_tokens,
        "train_tokens_per_second": output.metrics.get("train_runtime")
        and trained_tokens / output.metrics["train_runtime"],
        "best_checkpoint_step": best_step,
        "resumed_from_step": int(Path(resumed_from).name.split("-")[-1]) if resumed_from else None,
        "evaluations": [{"step": 0, **before}] + [entry for entry in history if "eval_mlm_loss" in entry],
        "world_size": trainer.args.world_size,
        "python": sys.version.split()[0],
    }


def plot(history, before, path) -> None:
    plot_losses(
        [{"step": 0, "eval_mlm_loss": before["eval_mlm_loss"]}, *history],
        path,
        title="Pre-training loss",
        eval_key="eval_mlm_loss",
        learning_rate=True,
    )


def __getattr__(name):
    if (
        name == "stdlib_corpus"
    ):  # moved beside the data (diagnostics.corpus uses it); the old name stays for one release
        from .data.stdlib import stdlib_corpus

        return stdlib_corpus
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
