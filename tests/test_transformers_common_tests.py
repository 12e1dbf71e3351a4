"""transformers' own common model tests (`ModelTesterMixin`) on EncoderStackModel: every one of them for a post-LN
model with learned positions and a pre-LN one with rotary positions, and the RoPE tests for every placement.

They are not in transformers' wheel: `make` unpacks `tests/test_modeling_common.py` from the installed release's source
distribution into the virtual environment (`.venv/transformers-tests/`). That file imports two mixins of other test
folders that the source distribution leaves out (`ExportTesterMixin`, which `ModelTesterMixin` extends, and
`GenerationTesterMixin`, which it only names); they stand here as empty classes, so the export and generation tests
do not run (tests/test_exporters.py covers the export; an encoder does not generate)."""

import importlib
import sys
import types
import unittest
from pathlib import Path
from unittest import mock

import pytest
import transformers
from conftest import PLACEMENTS
from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

import encoderstack

COMMON_TESTS = Path(sys.prefix) / "transformers-tests" / "test_modeling_common.py"
PACKAGE = "transformers_common_tests"


def common_tests():
    """transformers' `test_modeling_common` module, imported as part of a package of its own."""
    if not COMMON_TESTS.exists():
        pytest.fail(f"{COMMON_TESTS} is missing: `make test` unpacks it from transformers' source distribution")
    unpacked = COMMON_TESTS.with_name("VERSION").read_text().strip()
    if unpacked != transformers.__version__:
        pytest.fail(f"{COMMON_TESTS} is transformers {unpacked}'s, not {transformers.__version__}'s: run make")
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(COMMON_TESTS.parent)]
    sys.modules.setdefault(PACKAGE, package)
    for folder, module, mixin in (
        ("exporters", "test_export", "ExportTesterMixin"),
        ("generation", "test_utils", "GenerationTesterMixin"),
    ):
        sys.modules.setdefault(f"{PACKAGE}.{folder}", types.ModuleType(f"{PACKAGE}.{folder}"))
        stand_in = types.ModuleType(f"{PACKAGE}.{folder}.{module}")
        setattr(stand_in, mixin, type(mixin, (), {}))
        sys.modules.setdefault(stand_in.__name__, stand_in)
    return importlib.import_module(f"{PACKAGE}.test_modeling_common")


common = common_tests()


class EncoderStackModelTester:
    """What `ModelTesterMixin` asks of a model's tester: BERT's tester's sizes (transformers' BertModelTester)."""

    def __init__(self, parent, **config):
        self.parent, self.config = parent, config
        self.batch_size, self.seq_length, self.is_training = 3, 7, True
        self.vocab_size, self.hidden_size, self.num_hidden_layers = 99, 32, 2
        self.num_attention_heads, self.intermediate_size, self.type_vocab_size = 4, 37, 2
        self.max_position_embeddings, self.num_labels = 64, 3

    def get_config(self):
        sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        sizes += ("type_vocab_size", "max_position_embeddings", "num_labels")
        return encoderstack.EncoderStackConfig(**{name: getattr(self, name) for name in sizes}, **self.config)

    def prepare_config_and_inputs_for_common(self):
        input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = common.random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {"input_ids": input_ids, "attention_mask": mask}


class CommonTests(common.ModelTesterMixin):
    all_model_classes = (encoderstack.EncoderStackModel,)
    config: dict = {}

    def setUp(self):
        self.model_tester = EncoderStackModelTester(self, **self.config)
        # the RoPE tests find the bare model class among transformers' own names; a plugin's is registered apart
        names = mock.patch.dict(MODEL_MAPPING_NAMES, {"encoderstack": "EncoderStackModel"})
        names.start()
        self.addCleanup(names.stop)


class TestPostLNWithLearnedPositions(CommonTests, unittest.TestCase):
    config = {"norm_placement": "post", "position_embedding_type": "absolute"}


class TestPreLNWithRotaryPositions(CommonTests, unittest.TestCase):
    config = {"norm_placement": "pre", "position_embedding_type": "rope"}


# (parameterized's expanded cases; it leaves the undecorated name as None)
ROPE_TESTS = [name for name in dir(CommonTests) if name.startswith("test_model_rope") and getattr(CommonTests, name)]


@pytest.mark.parametrize("position", ["absolute", "rope"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_transformers_rope_tests_pass_for_every_placement(placement, position):
    """At `initializer_range` 0.1: at BERT's 0.02 a DeepNorm model's output moves by only 2e-5 when its rotary positions
    are scaled by 10 (its branches start scaled by beta^2 and its residual by alpha), below the test's resolution
    (`allclose` at 1e-5 absolute and relative): the test would call the scaling ignored, which it is not."""
    config = {"norm_placement": placement, "position_embedding_type": position, "initializer_range": 0.1}
    case = type("Case", (CommonTests, unittest.TestCase), {"config": config})
    result = unittest.TestResult()
    unittest.TestSuite(case(name) for name in ROPE_TESTS).run(result)
    assert not result.failures and not result.errors, [text for _, text in result.failures + result.errors]
    ran = result.testsRun - len(result.skipped)
    # learned positions: every RoPE test skips (no `rope_parameters`); rotary: the three scaling tests run
    assert ran == (0 if position == "absolute" else 3), [(test.id(), why) for test, why in result.skipped]
