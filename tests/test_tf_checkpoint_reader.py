"""Tests of the TensorFlow V2 checkpoint reader against checkpoints written by TensorFlow.

The fixtures under tests/fixtures/tf were written by TensorFlow's own Saver (see
make_tf_fixtures.py there). Malformed inputs are made from copies in tmp_path; to make
a specific bound check (rather than a checksum) fire, the index is re-encoded with
correct block checksums by the small table writer below.
"""

from __future__ import annotations

import dataclasses
import random
import re
import shutil
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from encoderstack.conversion import tf_checkpoint
from encoderstack.conversion.tf_checkpoint import TFCheckpoint, TFCheckpointError, find_checkpoint_prefix

FIXTURES = Path(__file__).parent / "fixtures" / "tf"
PREFIX = "bert_model.ckpt"
SHARD = f"{PREFIX}.data-00000-of-00001"
TABLE_MAGIC = 0xDB4775248B80FB57


def fixture_prefix(name: str) -> Path:
    return FIXTURES / name / PREFIX


def copy_fixture(name: str, tmp_path: Path) -> Path:
    """A writable copy of a fixture's checkpoint files; returns its prefix."""
    folder = tmp_path / name
    folder.mkdir()
    for path in (FIXTURES / name).glob(f"{PREFIX}.*"):
        shutil.copy(path, folder / path.name)
    return folder / PREFIX


def raises_checkpoint_error(*fragments: str):
    """Expect a TFCheckpointError whose message holds these literal fragments, in order."""
    return pytest.raises(TFCheckpointError, match="(?s)" + ".*".join(map(re.escape, fragments)))


# --- A minimal writer of LevelDB-format tables and bundle entries ----------


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def masked_crc(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def encode_block(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A table block with every entry a restart point (no prefix sharing)."""
    body, restarts = b"", []
    for key, value in entries:
        restarts.append(len(body))
        body += varint(0) + varint(len(key)) + varint(len(value)) + key + value
    restarts = restarts or [0]
    return body + b"".join(r.to_bytes(4, "little") for r in restarts) + len(restarts).to_bytes(4, "little")


def with_trailer(block: bytes, compression: int = 0) -> bytes:
    return block + bytes([compression]) + masked_crc(block + bytes([compression])).to_bytes(4, "little")


def assemble_table(data_blocks: list[tuple[bytes, bytes]], compression: int = 0) -> bytes:
    """A table from (raw data block, last key in it) pairs: data, metaindex, index, footer."""
    table, index_entries = b"", []
    for block, last_key in data_blocks:
        index_entries.append((last_key, varint(len(table)) + varint(len(block))))
        table += with_trailer(block, compression)
    handles = b""
    for block in (encode_block([]), encode_block(index_entries)):
        handles += varint(len(table)) + varint(len(block))
        table += with_trailer(block)
    return table + handles.ljust(40, b"\0") + TABLE_MAGIC.to_bytes(8, "little")


def write_table(path: Path, entries: list[tuple[bytes, bytes]], per_block=10**9, compression=0) -> None:
    chunks = [entries[i : i + per_block] for i in range(0, len(entries), per_block)]
    path.write_bytes(assemble_table([(encode_block(c), c[-1][0]) for c in chunks], compression))


def encode_entry(entry) -> bytes:
    dims = b"".join(b"\x12" + varint(len(varint(d)) + 1) + b"\x08" + varint(d) for d in entry.dims or ())
    shape = b"\x18\x01" if entry.dims is None else dims
    return (
        b"\x08"
        + varint(entry.dtype)
        + b"\x12"
        + varint(len(shape))
        + shape
        + b"\x18"
        + varint(entry.shard_id)
        + b"\x20"
        + varint(entry.offset)
        + b"\x28"
        + varint(entry.size)
        + b"\x35"
        + entry.masked_crc32c.to_bytes(4, "little")
        + (b"\x3a\x00" if entry.partitioned else b"")
    )


def index_entries(prefix: Path) -> list[tuple[bytes, bytes]]:
    index = Path(f"{prefix}.index")
    return tf_checkpoint._table_entries(index.read_bytes(), index)


def rewrite_entry(prefix: Path, name: str, **changes) -> None:
    """Re-encode the index with one variable's BundleEntryProto fields changed."""
    entries = []
    for key, value in index_entries(prefix):
        if key == name.encode():
            entry = tf_checkpoint._parse_entry(value, name)
            value = encode_entry(dataclasses.replace(entry, **changes))
        entries.append((key, value))
    write_table(Path(f"{prefix}.index"), entries)


def rewrite_header(prefix: Path, header: bytes) -> None:
    entries = index_entries(prefix)
    write_table(Path(f"{prefix}.index"), [(b"", header), *entries[1:]])


# --- Reading what TensorFlow wrote -------------------------------------------


def test_reads_every_variable_of_a_pretraining_checkpoint_written_by_tensorflow():
    expected = np.load(FIXTURES / "pretraining" / "tensors.npz")
    with TFCheckpoint(fixture_prefix("pretraining")) as checkpoint:
        assert checkpoint.names() == sorted(expected.files)
        for name in checkpoint:
            tensor = checkpoint.get_tensor(name)
            assert tensor.dtype == checkpoint.dtype(name) == torch.float32
            assert tuple(tensor.shape) == checkpoint.shape(name) == expected[name].shape
            np.testing.assert_array_equal(tensor.numpy(), expected[name])


def test_names_are_sorted_and_the_checkpoint_behaves_like_a_collection_of_names():
    with TFCheckpoint(str(fixture_prefix("pretraining"))) as checkpoint:
        names = checkpoint.names()
        assert names == sorted(names) and "" not in names
        assert list(checkpoint) == names and len(checkpoint) == len(names) == 46
        assert "bert/pooler/dense/kernel" in checkpoint and "bert/pooler" not in checkpoint
        with pytest.raises(KeyError, match="no variable 'missing'"):
            checkpoint.get_tensor("missing")


def test_shapes_follow_google_bert_conventions():
    with TFCheckpoint(fixture_prefix("pretraining")) as checkpoint:
        assert checkpoint.shape("bert/embeddings/word_embeddings") == (80, 32)
        assert checkpoint.shape("bert/encoder/layer_1/intermediate/dense/kernel") == (32, 37)
        assert checkpoint.shape("bert/encoder/layer_1/output/dense/kernel") == (37, 32)
        assert checkpoint.shape("cls/seq_relationship/output_weights") == (2, 32)
        assert checkpoint.shape("cls/predictions/output_bias") == (80,)


def test_reads_a_float16_checkpoint_as_the_float16_rounding_of_the_float32_weights():
    expected = np.load(FIXTURES / "pretraining" / "tensors.npz")
    with TFCheckpoint(fixture_prefix("float16")) as checkpoint:
        assert checkpoint.names() == sorted(expected.files)
        for name in checkpoint:
            tensor = checkpoint.get_tensor(name)
            assert tensor.dtype == torch.float16
            np.testing.assert_array_equal(tensor.numpy(), expected[name].astype(np.float16))


def test_reads_a_checkpoint_spread_over_two_data_shards():
    expected = np.load(FIXTURES / "pretraining" / "tensors.npz")
    assert sorted(p.name for p in (FIXTURES / "two_shards").glob("*.data-*")) == [
        f"{PREFIX}.data-00000-of-00002",
        f"{PREFIX}.data-00001-of-00002",
    ]
    with TFCheckpoint(fixture_prefix("two_shards")) as checkpoint:
        assert checkpoint.names() == sorted(expected.files)
        for name in checkpoint:
            np.testing.assert_array_equal(checkpoint.get_tensor(name).numpy(), expected[name])


def test_lists_optimizer_slots_and_an_int64_global_step_of_a_training_checkpoint():
    weights = np.load(FIXTURES / "pretraining" / "tensors.npz")
    with TFCheckpoint(fixture_prefix("with_optimizer")) as checkpoint:
        slots = [f"{name}/{slot}" for name in weights.files for slot in ("adam_m", "adam_v")]
        assert checkpoint.names() == sorted([*weights.files, *slots, "global_step"])
        for name in weights.files:
            np.testing.assert_array_equal(checkpoint.get_tensor(name).numpy(), weights[name])
            assert checkpoint.shape(f"{name}/adam_v") == weights[name].shape
        assert (checkpoint.get_tensor("bert/pooler/dense/kernel/adam_v") >= 0).all()
        assert checkpoint.dtype("global_step") == torch.int64 and checkpoint.shape("global_step") == ()
        assert checkpoint.get_tensor("global_step").item() == 100000


def test_reads_a_classifier_checkpoint_with_top_level_output_weights():
    with TFCheckpoint(fixture_prefix("classifier")) as checkpoint:
        assert not any(name.startswith("cls/") for name in checkpoint)
        assert checkpoint.shape("output_weights") == (3, 32) and checkpoint.shape("output_bias") == (3,)
        assert checkpoint.get_tensor("output_weights").abs().sum() > 0


def test_reads_every_supported_dtype_exactly_as_tensorflow_wrote_it():
    expected = np.load(FIXTURES / "mixed_dtypes" / "expected.npz")
    with TFCheckpoint(fixture_prefix("mixed_dtypes")) as checkpoint:
        assert checkpoint.names() == sorted([*expected.files, "string", "partitioned"])
        assert checkpoint.dtype("bfloat16") == torch.bfloat16 and checkpoint.dtype("bool") == torch.bool
        for name in expected.files:
            tensor = checkpoint.get_tensor(name)
            values = tensor.float().numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
            assert values.dtype == expected[name].dtype, name
            np.testing.assert_array_equal(values, expected[name])
        assert checkpoint.get_tensor("empty").shape == (0, 4)
        assert checkpoint.get_tensor("scalar/global_step").shape == ()


def test_lists_a_string_variable_but_refuses_to_read_it():
    with TFCheckpoint(fixture_prefix("mixed_dtypes")) as checkpoint:
        assert checkpoint.shape("string") == (2,)
        for read in (checkpoint.dtype, checkpoint.get_tensor):
            with raises_checkpoint_error("'string'", "unsupported dtype 7", "DT_STRING"):
                read("string")


def test_refuses_a_partitioned_variable_and_hides_its_slices():
    with TFCheckpoint(fixture_prefix("mixed_dtypes")) as checkpoint:
        assert checkpoint.shape("partitioned") == (4, 3)
        assert not any(name.startswith("\0") for name in checkpoint)
        with raises_checkpoint_error("'partitioned'", "partitioned variables are not supported"):
            checkpoint.get_tensor("partitioned")


def test_a_returned_tensor_owns_its_memory():
    with TFCheckpoint(fixture_prefix("pretraining")) as checkpoint:
        first = checkpoint.get_tensor("bert/pooler/dense/bias")
        first += 1.0
        assert not torch.equal(first, checkpoint.get_tensor("bert/pooler/dense/bias"))


def test_a_closed_checkpoint_refuses_reads():
    checkpoint = TFCheckpoint(fixture_prefix("pretraining"))
    checkpoint.get_tensor("bert/pooler/dense/bias")
    checkpoint.close()
    with raises_checkpoint_error("closed"):
        checkpoint.get_tensor("bert/pooler/dense/bias")


def test_the_test_table_writer_reencodes_an_index_that_reads_back_identically(tmp_path):
    prefix = copy_fixture("with_optimizer", tmp_path)
    write_table(Path(f"{prefix}.index"), index_entries(prefix), per_block=7)
    with TFCheckpoint(prefix) as copy, TFCheckpoint(fixture_prefix("with_optimizer")) as original:
        assert copy.names() == original.names()
        for name in ("bert/embeddings/word_embeddings", "cls/predictions/output_bias", "global_step"):
            assert torch.equal(copy.get_tensor(name), original.get_tensor(name))


# --- Finding the prefix --------------------------------------------------------


def test_finds_the_prefix_in_a_folder_from_the_prefix_itself_or_from_its_index_file():
    folder = FIXTURES / "pretraining"
    assert find_checkpoint_prefix(folder) == folder / PREFIX
    assert find_checkpoint_prefix(folder / PREFIX) == folder / PREFIX
    assert find_checkpoint_prefix(f"{folder / PREFIX}.index") == folder / PREFIX
    assert find_checkpoint_prefix(folder / "bert_config.json") is None


def test_finding_a_prefix_handles_other_names_several_checkpoints_and_none(tmp_path):
    assert find_checkpoint_prefix(tmp_path) is None
    assert find_checkpoint_prefix(tmp_path / "nothing") is None
    (tmp_path / "model.ckpt-100000.index").write_bytes(b"")
    assert find_checkpoint_prefix(tmp_path) == tmp_path / "model.ckpt-100000"
    (tmp_path / "model.ckpt-200000.index").write_bytes(b"")
    with raises_checkpoint_error("several", "model.ckpt-100000", "model.ckpt-200000"):
        find_checkpoint_prefix(tmp_path)
    (tmp_path / f"{PREFIX}.index").write_bytes(b"")
    assert find_checkpoint_prefix(tmp_path) == tmp_path / PREFIX


# --- Malformed input -------------------------------------------------------------


def test_a_missing_index_file_is_reported(tmp_path):
    with raises_checkpoint_error("cannot read checkpoint index", "nowhere.index"):
        TFCheckpoint(tmp_path / "nowhere")


@pytest.mark.parametrize("keep", [0, 20, 47, 1000, -1])
def test_a_truncated_index_is_reported(tmp_path, keep):
    prefix = copy_fixture("pretraining", tmp_path)
    index = Path(f"{prefix}.index")
    index.write_bytes(index.read_bytes()[:keep])
    with pytest.raises(TFCheckpointError, match=str(index)):
        TFCheckpoint(prefix)


def test_a_bad_footer_magic_is_reported(tmp_path):
    prefix = copy_fixture("pretraining", tmp_path)
    index = Path(f"{prefix}.index")
    index.write_bytes(index.read_bytes()[:-1] + b"\x00")
    with raises_checkpoint_error("bad table magic 0x00", "expected 0xdb4775248b80fb57"):
        TFCheckpoint(prefix)


def test_a_flipped_byte_in_an_index_block_fails_its_checksum(tmp_path):
    prefix = copy_fixture("pretraining", tmp_path)
    index = Path(f"{prefix}.index")
    table = bytearray(index.read_bytes())
    table[100] ^= 0x01
    index.write_bytes(bytes(table))
    with raises_checkpoint_error("data block", "offset 0", "fails its checksum"):
        TFCheckpoint(prefix)


def test_a_compressed_index_block_is_refused(tmp_path):
    prefix = copy_fixture("pretraining", tmp_path)
    write_table(Path(f"{prefix}.index"), index_entries(prefix), compression=1)
    with raises_checkpoint_error("compressed", "type 1"):
        TFCheckpoint(prefix)


def test_a_flipped_byte_in_a_data_shard_fails_the_tensor_checksum(tmp_path):
    prefix = copy_fixture("pretraining", tmp_path)
    name = "bert/embeddings/word_embeddings"
    entry = tf_checkpoint._parse_entry(dict(index_entries(prefix))[name.encode()], name)
    shard = prefix.parent / SHARD
    data = bytearray(shard.read_bytes())
    data[entry.offset + 17] ^= 0x80
    shard.write_bytes(bytes(data))
    with TFCheckpoint(prefix) as checkpoint:
        checkpoint.get_tensor("bert/pooler/dense/kernel")
        with raises_checkpoint_error(repr(name), "checksum mismatch", f"[{entry.offset}, ", SHARD):
            checkpoint.get_tensor(name)


def test_an_offset_past_the_end_of_the_shard_is_reported(tmp_path):
    prefix = copy_fixture("pretraining", tmp_path)
    shard_size = (prefix.parent / SHARD).stat().st_size
    rewrite_entry(prefix, "bert/pooler/dense/bias", offset=shard_size - 64)
    with (
        TFCheckpoint(prefix) as checkpoint,
        raises_checkpoint_error("'bert/pooler/dense/bias'", "outside data shard", f"{shard_size} bytes"),
    ):
        checkpoint.get_tensor("bert/pooler/dense/bias")


def test_a_negative_offset_is_reported(tmp_path):
    prefix = copy_fixture("pretraining", tmp_path)
    rewrite_entry(prefix, "bert/pooler/dense/bias", offset=-8)
    with TFCheckpoint(prefix) as checkpoint, raises_checkpoint_error("bytes [-8, ", "outside data shard"):
        checkpoint.get_tensor("bert/pooler/dense/bias")


def test_a_truncated_data_shard_is_reported(tmp_path):
    prefix = copy_fixture("pretraining", tmp_path)
    shard = prefix.parent / SHARD
    shard.write_bytes(shard.read_bytes()[:1000])
    with TFCheckpoint(prefix) as checkpoint, raises_checkpoint_error("outside data shard", "1000 bytes"):
        checkpoint.get_tensor("bert/embeddings/word_embeddings")


def test_a_missing_shard_file_is_named_and_the_other_shard_stays_readable(tmp_path):
    prefix = copy_fixture("two_shards", tmp_path)
    (prefix.parent / f"{PREFIX}.data-00001-of-00002").unlink()
    readable, errors = 0, []
    with TFCheckpoint(prefix) as checkpoint:
        for name in checkpoint:
            try:
                checkpoint.get_tensor(name)
                readable += 1
            except TFCheckpointError as error:
                errors.append(str(error))
    assert readable > 0 and errors
    assert all("cannot open data shard" in e and "data-00001-of-00002" in e for e in errors)


def test_a_shard_id_beyond_the_number_of_shards_is_reported(tmp_path):
    prefix = copy_fixture("pretraining", tmp_path)
    rewrite_entry(prefix, "bert/pooler/dense/bias", shard_id=3)
    with TFCheckpoint(prefix) as checkpoint, raises_checkpoint_error("shard_id 3 not in [0, 1)"):
        checkpoint.get_tensor("bert/pooler/dense/bias")


def test_an_unknown_dtype_is_reported_only_when_the_variable_is_read(tmp_path):
    prefix = copy_fixture("pretraining", tmp_path)
    rewrite_entry(prefix, "bert/pooler/dense/bias", dtype=99)
    with TFCheckpoint(prefix) as checkpoint:
        assert "bert/pooler/dense/bias" in checkpoint.names()
        assert checkpoint.shape("bert/pooler/dense/bias") == (32,)
        checkpoint.get_tensor("bert/pooler/dense/kernel")
        with raises_checkpoint_error("'bert/pooler/dense/bias'", "unsupported dtype 99"):
            checkpoint.get_tensor("bert/pooler/dense/bias")


def test_a_size_that_does_not_match_the_shape_is_reported(tmp_path):
    prefix = copy_fixture("pretraining", tmp_path)
    rewrite_entry(prefix, "bert/pooler/dense/bias", size=64)
    with (
        TFCheckpoint(prefix) as checkpoint,
        raises_checkpoint_error("size 64 bytes does not match shape [32]", "128 bytes"),
    ):
        checkpoint.get_tensor("bert/pooler/dense/bias")


@pytest.mark.parametrize(
    ("dims", "fragment"),
    [(None, "unknown rank"), ((32, -1), "invalid shape"), ((0, 1 << 40, 1 << 40), "absurd shape")],
)
def test_an_impossible_shape_is_reported(tmp_path, dims, fragment):
    prefix = copy_fixture("pretraining", tmp_path)
    rewrite_entry(prefix, "bert/pooler/dense/bias", dims=dims)
    with TFCheckpoint(prefix) as checkpoint, raises_checkpoint_error(fragment):
        checkpoint.get_tensor("bert/pooler/dense/bias")


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        (b"\x08\x00", "num_shards is 0"),
        (b"\x08\x01\x10\x01", "big-endian"),
        (b"\x08\x01\x1a\x02\x10\x05", "version 5"),
    ],
)
def test_an_unusable_bundle_header_is_reported(tmp_path, header, fragment):
    prefix = copy_fixture("pretraining", tmp_path)
    rewrite_header(prefix, header)
    with raises_checkpoint_error("bundle header", fragment):
        TFCheckpoint(prefix)


def test_an_index_without_a_header_entry_is_reported(tmp_path):
    prefix = copy_fixture("pretraining", tmp_path)
    write_table(Path(f"{prefix}.index"), index_entries(prefix)[1:])
    with raises_checkpoint_error("no bundle header"):
        TFCheckpoint(prefix)


def test_keys_out_of_order_are_reported(tmp_path):
    prefix = copy_fixture("pretraining", tmp_path)
    entries = index_entries(prefix)
    write_table(Path(f"{prefix}.index"), [entries[0], entries[2], entries[1], *entries[3:]])
    with raises_checkpoint_error("keys out of order"):
        TFCheckpoint(prefix)


def test_an_overlong_varint_in_an_entry_is_reported(tmp_path):
    prefix = copy_fixture("pretraining", tmp_path)
    entries = index_entries(prefix)
    entries[5] = (entries[5][0], b"\x08" + b"\xff" * 12)
    write_table(Path(f"{prefix}.index"), entries)
    with raises_checkpoint_error("longer than 10 bytes"):
        TFCheckpoint(prefix)


# --- Fuzzing: only TFCheckpointError escapes, and nothing hangs ------------------


def mutate(data: bytes, mutations: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for kind, position, byte in mutations:
        at = position % (len(buf) + 1)
        if kind == "flip" and buf:
            buf[at % len(buf)] ^= 1 << (byte % 8)
        elif kind == "set" and buf:
            buf[at % len(buf)] = byte
        elif kind == "insert":
            buf[at:at] = bytes([byte])
        elif kind == "truncate":
            del buf[at:]
        elif kind == "ff_run":
            buf[at : at + 1 + byte % 12] = b"\xff" * (1 + byte % 12)
    return bytes(buf)


def read_everything(prefix: Path) -> None:
    """Open and read every variable; only TFCheckpointError may escape."""
    try:
        with TFCheckpoint(prefix) as checkpoint:
            for name in checkpoint.names():
                try:
                    checkpoint.shape(name)
                    checkpoint.dtype(name)
                    checkpoint.get_tensor(name)
                except TFCheckpointError:
                    pass
    except TFCheckpointError:
        pass


MUTATIONS = st.lists(
    st.tuples(
        st.sampled_from(["flip", "set", "insert", "truncate", "ff_run"]),
        st.integers(0, 1 << 16),
        st.integers(0, 255),
    ),
    min_size=1,
    max_size=4,
)
FUZZ_SETTINGS = settings(
    max_examples=200,
    deadline=2000,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@pytest.fixture
def small_checkpoint(tmp_path) -> Path:
    return copy_fixture("mixed_dtypes", tmp_path)


@FUZZ_SETTINGS
@given(mutations=MUTATIONS)
def test_a_mutated_index_raises_only_checkpoint_errors(small_checkpoint, mutations):
    original = (FIXTURES / "mixed_dtypes" / f"{PREFIX}.index").read_bytes()
    Path(f"{small_checkpoint}.index").write_bytes(mutate(original, mutations))
    read_everything(small_checkpoint)


@FUZZ_SETTINGS
@given(mutations=MUTATIONS)
def test_a_mutated_data_shard_raises_only_checkpoint_errors(small_checkpoint, mutations):
    original = (FIXTURES / "mixed_dtypes" / SHARD).read_bytes()
    (small_checkpoint.parent / SHARD).write_bytes(mutate(original, mutations))
    read_everything(small_checkpoint)


def random_mutations(rng: random.Random, count: int) -> list[tuple[str, int, int]]:
    kinds = ["flip", "set", "insert", "truncate", "ff_run"]
    return [(rng.choice(kinds), rng.randrange(1 << 16), rng.randrange(256)) for _ in range(count)]


def test_mutations_behind_valid_block_checksums_raise_only_checkpoint_errors(small_checkpoint):
    """Re-checksummed tables get past the CRCs, so the decoders and bound checks themselves are
    fuzzed: odd cases mutate a raw block (entry framing), even ones a single entry's value."""
    rng = random.Random(1234)
    entries = index_entries(fixture_prefix("mixed_dtypes"))
    for case in range(600):
        if case % 2:
            block = mutate(encode_block(entries), random_mutations(rng, rng.randint(1, 3)))
        else:
            victim = rng.randrange(len(entries))
            key, value = entries[victim]
            changed = (key, mutate(value, random_mutations(rng, 1)))
            block = encode_block([*entries[:victim], changed, *entries[victim + 1 :]])
        Path(f"{small_checkpoint}.index").write_bytes(assemble_table([(block, entries[-1][0])]))
        read_everything(small_checkpoint)
