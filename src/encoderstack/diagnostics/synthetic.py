"""A masked-LM task that a small model learns in a few hundred CPU steps, and a seeded training run on it.

Each sequence is `[CLS] x_1 .. x_k [SEP] p(x_1) .. p(x_k) [SEP]`: the x follow a fixed random bigram grammar (every
token has a few allowed successors) and p is a fixed random permutation of the content tokens. A masked token is
predictable from its neighbours (the grammar) and, unless its partner in the other half is masked too, exactly from
that partner (the permutation): the loss can fall from ln 36 = 3.6 at init to about ln 4 = 1.4 with the grammar
alone, and towards 0 with the partner, which takes attention across the sequence.
"""

import math
from dataclasses import dataclass

import torch

from ..configuration_encoderstack import EncoderStackConfig
from ..modeling_encoderstack import EncoderStackForMaskedLM

CLS, SEP, MASK = 1, 2, 3  # 0 is the config's pad_token_id; the sequences all have one length and need no padding
NUM_SPECIAL = 4
NUM_CONTENT = 32
TASK_VOCAB_SIZE = NUM_SPECIAL + NUM_CONTENT
HALF_LENGTH = 8
SUCCESSORS = 4
MASK_FRACTION = 0.15
GRAMMAR_SEED = 8  # the task is one fixed grammar; the run's seed varies the model and the samples only


class SyntheticMLMTask:
    """The fixed grammar, and seeded batches of masked sequences from it."""

    def __init__(self):
        generator = torch.Generator().manual_seed(GRAMMAR_SEED)
        self.successors = torch.stack(
            [torch.randperm(NUM_CONTENT, generator=generator)[:SUCCESSORS] for _ in range(NUM_CONTENT)]
        )
        self.permutation = torch.randperm(NUM_CONTENT, generator=generator)

    @property
    def seq_length(self) -> int:
        return 2 * HALF_LENGTH + 3

    def sample(self, batch_size: int, generator: torch.Generator) -> dict:
        """`input_ids` with MASK at the masked content positions, `labels` there (-100 elsewhere), no padding."""
        first_half = torch.empty(batch_size, HALF_LENGTH, dtype=torch.long)
        first_half[:, 0] = torch.randint(NUM_CONTENT, (batch_size,), generator=generator)
        for position in range(1, HALF_LENGTH):
            choice = torch.randint(SUCCESSORS, (batch_size,), generator=generator)
            first_half[:, position] = self.successors[first_half[:, position - 1], choice]
        sequence = torch.full((batch_size, self.seq_length), SEP)
        sequence[:, 0] = CLS
        sequence[:, 1 : HALF_LENGTH + 1] = first_half + NUM_SPECIAL
        sequence[:, HALF_LENGTH + 2 : -1] = self.permutation[first_half] + NUM_SPECIAL
        content = torch.cat([torch.arange(1, HALF_LENGTH + 1), torch.arange(HALF_LENGTH + 2, self.seq_length - 1)])
        num_masked = max(1, round(MASK_FRACTION * len(content)))
        masked = content[torch.rand(batch_size, len(content), generator=generator).argsort(dim=1)[:, :num_masked]]
        is_masked = torch.zeros_like(sequence, dtype=torch.bool).scatter_(1, masked, True)
        return {
            "input_ids": sequence.masked_fill(is_masked, MASK),
            "attention_mask": torch.ones_like(sequence),
            "labels": sequence.masked_fill(~is_masked, -100),
        }


def diagnostic_config(norm_placement: str, num_layers: int, hidden_size: int = 64, **overrides) -> EncoderStackConfig:
    """A small EncoderStack for the synthetic task: 4 heads, FFN 4x wide, BERT's init, no dropout (so that every
    measurement and training run is a deterministic function of the seed), and rotary positions: with BERT's learned
    positions starting from N(0, 0.02), a 6-layer pre-LN model at width 64 needs ~250 steps to start using the
    neighbour and partner positions (loss 3.54 -> 2.2 after 300 steps at lr 1e-3); with rotary ones, -> 0.4."""
    return EncoderStackConfig(
        **{"vocab_size": TASK_VOCAB_SIZE, **diagnostic_fields(norm_placement, num_layers, hidden_size), **overrides}
    )


def diagnostic_fields(norm_placement: str, num_layers: int, hidden_size: int) -> dict:
    """The config fields of `diagnostic_config` but the vocabulary, which is the task's (or the tokenizer's)."""
    return {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "intermediate_size": 4 * hidden_size,
        "max_position_embeddings": 64,
        "position_embedding_type": "rope",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "norm_placement": norm_placement,
    }


PROFILING_BATCH_SIZE = 32


def build_masked_lm(config: EncoderStackConfig, seed: int) -> EncoderStackForMaskedLM:
    """A fresh model from `seed`, prepared for training (Admin's shortcut scales profiled) on a task batch of its own,
    drawn from a generator of its own, so that the training batches stay those of every other placement."""
    torch.manual_seed(seed)
    model = EncoderStackForMaskedLM(config)
    batch = SyntheticMLMTask().sample(PROFILING_BATCH_SIZE, torch.Generator().manual_seed(seed))
    model.prepare_for_training(batch["input_ids"], batch["attention_mask"])
    return model


def final_loss(losses: list[float]) -> float:
    """The mean of the last tenth of the steps (at least one), so that one noisy batch does not decide."""
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


def divergence(losses: list[float]) -> str | None:
    """Why a run counts as diverged, or None: a non-finite loss, or a final loss above the first step's."""
    if not all(math.isfinite(loss) for loss in losses):
        step = next(step for step, loss in enumerate(losses, 1) if not math.isfinite(loss))
        return f"loss {losses[step - 1]} at step {step}"
    if final_loss(losses) > losses[0]:
        return f"final loss {final_loss(losses):.3g} above the first {losses[0]:.3g}"
    return None


@dataclass
class TrainingRun:
    """The loss of every step (a run stops at the first non-finite one) and the trained model."""

    losses: list[float]
    model: EncoderStackForMaskedLM

    @property
    def divergence(self) -> str | None:
        return divergence(self.losses)


def train_synthetic_mlm(
    model_or_config: EncoderStackForMaskedLM | EncoderStackConfig,
    steps: int,
    lr: float,
    warmup_steps: int = 0,
    seed: int = 0,
    batch_size: int = 32,
) -> TrainingRun:
    """AdamW (weight decay 0.01), learning rate rising linearly over `warmup_steps` and constant after, no gradient
    clipping (it would hide the instability this run is meant to show). A config is built with weights from `seed`;
    a model is trained in place. Batches are drawn from `seed`."""
    model = model_or_config
    if isinstance(model_or_config, EncoderStackConfig):
        model = build_masked_lm(model_or_config, seed)
    if model.config.vocab_size < TASK_VOCAB_SIZE:
        raise ValueError(f"the synthetic task needs `vocab_size` >= {TASK_VOCAB_SIZE}, got {model.config.vocab_size}")
    task = SyntheticMLMTask()
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps)))
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(**task.sample(batch_size, generator)).loss
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    return TrainingRun(losses=losses, model=model.eval())
