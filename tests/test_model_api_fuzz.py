"""A seeded fuzz of the model API: random shapes, dtypes and values for every argument of every head. Each call
either returns finite outputs or raises a ValueError / TypeError from EncoderStack's own checks — never an index or
runtime error from deep inside a kernel, and never a plausible result from arguments that do not fit."""

import random
import traceback

import pytest
import torch
from conftest import HEADS, build

import encoderstack

CASES = 300
DTYPES = (torch.long, torch.int32, torch.float32, torch.bool)


def random_tensor(rng, shape, dtype):
    if dtype is torch.bool:
        return torch.tensor([rng.random() < 0.7 for _ in range(torch.Size(shape).numel())]).view(shape)
    values = [rng.choice((0, 1, 1, 1, 2, 5, 98, 99, -1, -100, 1000)) for _ in range(torch.Size(shape).numel())]
    return torch.tensor(values, dtype=dtype).view(shape)


def random_shape(rng, base):
    """Mostly the right shape, sometimes one dimension off, dropped or added."""
    shape = list(base)
    roll = rng.random()
    if roll < 0.15 and shape:
        shape[rng.randrange(len(shape))] += rng.choice((-1, 1, 2))
    elif roll < 0.2 and shape:
        shape.pop()
    elif roll < 0.25:
        shape.append(rng.choice((1, 2)))
    return tuple(max(0, size) for size in shape)


def random_call(rng, model_class):
    choices = model_class is encoderstack.EncoderStackForMultipleChoice
    base = (rng.choice((1, 2, 3)), *((2,) if choices else ()), rng.choice((1, 4, 7)))
    kwargs = {}
    if rng.random() < 0.9:
        kwargs["input_ids"] = random_tensor(rng, random_shape(rng, base), rng.choice(DTYPES[:1] * 6 + DTYPES))
    if rng.random() < 0.15 or "input_ids" not in kwargs:
        kwargs["inputs_embeds"] = torch.randn(*random_shape(rng, (*base, 32)))
    for name in ("attention_mask", "token_type_ids", "position_ids"):
        if rng.random() < 0.5:
            kwargs[name] = random_tensor(rng, random_shape(rng, base), rng.choice(DTYPES))
    label_shapes = {
        encoderstack.EncoderStackForMaskedLM: {"labels": base},
        encoderstack.EncoderStackForPreTraining: {"labels": base, "next_sentence_label": base[:1]},
        encoderstack.EncoderStackForSequenceClassification: {"labels": base[:1]},
        encoderstack.EncoderStackForTokenClassification: {"labels": base},
        encoderstack.EncoderStackForQuestionAnswering: {"start_positions": base[:1], "end_positions": base[:1]},
        encoderstack.EncoderStackForMultipleChoice: {"labels": base[:1]},
    }.get(model_class, {})
    for name, shape in label_shapes.items():
        if rng.random() < 0.6:
            kwargs[name] = random_tensor(rng, random_shape(rng, shape), rng.choice(DTYPES[:1] * 3 + DTYPES))
    if rng.random() < 0.1:
        kwargs["padding_free"] = rng.choice((True, False, "yes", 1))
    return kwargs


def raised_by_encoderstack(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return any("encoderstack" in frame.filename and "tests" not in frame.filename for frame in frames[-2:])


@pytest.fixture(scope="module")
def models():
    return {model_class: build(model_class) for model_class in HEADS}


def test_random_arguments_give_finite_outputs_or_one_of_our_errors(models):
    rng = random.Random(0)
    outcomes = {"ok": 0, "refused": 0}
    for case in range(CASES):
        model_class = rng.choice(HEADS)
        kwargs = random_call(rng, model_class)
        described = {key: (tuple(v.shape), str(v.dtype)) if torch.is_tensor(v) else v for key, v in kwargs.items()}
        try:
            with torch.no_grad():
                outputs = models[model_class](**kwargs)
        except (ValueError, TypeError) as error:
            assert raised_by_encoderstack(error), f"{model_class.__name__}{described}: {error!r} not from our checks"
            outcomes["refused"] += 1
            continue
        except Exception as error:  # noqa: BLE001  (the point: anything else is a bug)
            pytest.fail(f"case {case}: {model_class.__name__}{described} raised {type(error).__name__}: {error}")
        for key, value in outputs.items():
            if torch.is_tensor(value) and value.is_floating_point() and key != "loss":
                assert torch.isfinite(value).all(), f"{model_class.__name__}{described}: {key} not finite"
        outcomes["ok"] += 1
    assert outcomes["ok"] and outcomes["refused"], outcomes  # the fuzz reaches both outcomes
