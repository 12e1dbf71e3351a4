"""Read TensorFlow checkpoints (format V2, the "tensor bundle") without TensorFlow.

A checkpoint ``prefix`` is an index ``prefix.index`` plus data shards
``prefix.data-SSSSS-of-NNNNN``. The index is a LevelDB-format table that maps the
empty key to a ``BundleHeaderProto`` and every variable name to a
``BundleEntryProto`` (dtype, shape, shard, offset, size, masked crc32c); a shard
holds raw little-endian tensor bytes at ``[offset, offset + size)``.

A checkpoint is untrusted input: every offset, length and checksum is checked
before it is used, and every defect is reported as :class:`TFCheckpointError`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import google_crc32c
import numpy as np
import torch

__all__ = ["TFCheckpoint", "TFCheckpointError", "find_checkpoint_prefix"]

_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER_SIZE = 48
_BLOCK_TRAILER_SIZE = 5
_CRC_MASK_DELTA = 0xA282EAD8
_READ_CHUNK = 16 << 20
_MAX_RANK = 254  # TensorShape::MaxDimensions()
_MAX_ELEMENTS = 1 << 62  # keeps even zero-size shapes representable in torch

# DataType enum values of tensorflow/core/framework/types.proto
_DTYPES = {
    1: torch.float32, 2: torch.float64, 3: torch.int32, 4: torch.uint8, 5: torch.int16,
    6: torch.int8, 9: torch.int64, 10: torch.bool, 14: torch.bfloat16, 19: torch.float16,
}  # fmt: skip
_UNSUPPORTED_DTYPE_NAMES = {
    7: "DT_STRING", 8: "DT_COMPLEX64", 17: "DT_UINT16", 18: "DT_COMPLEX128",
    20: "DT_RESOURCE", 21: "DT_VARIANT", 22: "DT_UINT32", 23: "DT_UINT64",
}  # fmt: skip


class TFCheckpointError(ValueError):
    """A TensorFlow checkpoint is malformed, corrupt or uses an unsupported feature."""


# --- Low-level decoding -----------------------------------------------------


def _mask(crc: int) -> int:
    """LevelDB's CRC masking, which TensorFlow applies to block and tensor checksums."""
    return (((crc >> 15) | (crc << 17)) + _CRC_MASK_DELTA) & 0xFFFFFFFF


def _varint(buf: bytes, pos: int, end: int, what: str, max_bytes: int = 10) -> tuple[int, int]:
    """Decode an unsigned varint at ``buf[pos:end]``; return (value, position after it)."""
    value = 0
    for i in range(max_bytes):
        if pos + i >= end:
            raise TFCheckpointError(f"{what}: varint at offset {pos} runs past the end ({end})")
        byte = buf[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if byte < 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, pos + i + 1
    raise TFCheckpointError(f"{what}: varint at offset {pos} is longer than {max_bytes} bytes")


def _as_int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _proto_fields(buf: bytes, what: str) -> dict[int, list[tuple[int, int | bytes]]]:
    """Decode protobuf wire format into {field number: [(wire type, value), ...]}."""
    fields: dict[int, list[tuple[int, int | bytes]]] = {}
    pos, end = 0, len(buf)
    while pos < end:
        tag, pos = _varint(buf, pos, end, what)
        number, wire_type = tag >> 3, tag & 7
        if number == 0:
            raise TFCheckpointError(f"{what}: protobuf field number 0 at offset {pos}")
        if wire_type == 0:
            value, pos = _varint(buf, pos, end, what)
        elif wire_type in (1, 2, 5):
            if wire_type == 2:
                width, pos = _varint(buf, pos, end, what)
            else:
                width = 8 if wire_type == 1 else 4
            if width > end - pos:
                raise TFCheckpointError(
                    f"{what}: field {number} needs {width} bytes at offset {pos}, only {end - pos} left"
                )
            raw = buf[pos : pos + width]
            value = raw if wire_type == 2 else int.from_bytes(raw, "little")
            pos += width
        else:
            raise TFCheckpointError(f"{what}: unsupported protobuf wire type {wire_type} (field {number})")
        fields.setdefault(number, []).append((wire_type, value))
    return fields


def _field(fields: dict, number: int, wire_type: int, default: int | bytes, what: str):
    """The last occurrence of a scalar field (protobuf semantics), checked for its wire type."""
    if number not in fields:
        return default
    actual_type, value = fields[number][-1]
    if actual_type != wire_type:
        raise TFCheckpointError(f"{what}: field {number} has wire type {actual_type}, expected {wire_type}")
    return value


def _repeated_messages(fields: dict, number: int, what: str) -> list[bytes]:
    if any(wire_type != 2 for wire_type, _ in fields.get(number, [])):
        raise TFCheckpointError(f"{what}: field {number} is not a length-delimited message")
    return [value for _, value in fields.get(number, [])]


# --- The LevelDB-format table in the .index file --------------------------


def _block_handle(buf: bytes, pos: int, end: int, what: str) -> tuple[tuple[int, int], int]:
    offset, pos = _varint(buf, pos, end, what)
    size, pos = _varint(buf, pos, end, what)
    return (offset, size), pos


def _read_block(table: bytes, handle: tuple[int, int], what: str) -> bytes:
    offset, size = handle
    limit = len(table) - _FOOTER_SIZE
    if offset + size + _BLOCK_TRAILER_SIZE > limit:
        raise TFCheckpointError(
            f"{what} (offset {offset}, size {size}) extends past the table contents ({limit} bytes)"
        )
    end = offset + size
    stored_crc = int.from_bytes(table[end + 1 : end + _BLOCK_TRAILER_SIZE], "little")
    if _mask(google_crc32c.value(table[offset : end + 1])) != stored_crc:
        raise TFCheckpointError(f"{what} (offset {offset}, size {size}) fails its checksum: corrupt index")
    if table[end] != 0:
        raise TFCheckpointError(
            f"{what} (offset {offset}) is compressed (type {table[end]}); only uncompressed is supported"
        )
    return table[offset:end]


def _block_entries(block: bytes, what: str) -> list[tuple[bytes, bytes]]:
    """Decode the prefix-compressed (key, value) entries of one table block."""
    if len(block) < 4:
        raise TFCheckpointError(f"{what}: block of {len(block)} bytes is too short for its restart count")
    num_restarts = int.from_bytes(block[-4:], "little")
    if num_restarts > (len(block) - 4) // 4:
        raise TFCheckpointError(f"{what}: {num_restarts} restart points do not fit a {len(block)}-byte block")
    limit = len(block) - 4 - 4 * num_restarts
    entries, key, pos = [], b"", 0
    while pos < limit:
        shared, pos = _varint(block, pos, limit, what, max_bytes=5)
        unshared, pos = _varint(block, pos, limit, what, max_bytes=5)
        value_length, pos = _varint(block, pos, limit, what, max_bytes=5)
        if shared > len(key) or unshared + value_length > limit - pos:
            raise TFCheckpointError(
                f"{what}: entry at offset {pos} (shared {shared}, unshared {unshared}, "
                f"value {value_length}) does not fit the previous key ({len(key)}) or the block ({limit})"
            )
        key = key[:shared] + block[pos : pos + unshared]
        pos += unshared
        entries.append((key, block[pos : pos + value_length]))
        pos += value_length
    return entries


def _table_entries(table: bytes, path: Path) -> list[tuple[bytes, bytes]]:
    """All (key, value) pairs of a LevelDB-format table, in key order."""
    if len(table) < _FOOTER_SIZE:
        raise TFCheckpointError(f"{path}: {len(table)} bytes is too short for the table footer")
    footer_start = len(table) - _FOOTER_SIZE
    magic = int.from_bytes(table[-8:], "little")
    if magic != _TABLE_MAGIC:
        raise TFCheckpointError(f"{path}: bad table magic {magic:#018x}, expected {_TABLE_MAGIC:#018x}")
    _, pos = _block_handle(table, footer_start, len(table) - 8, f"{path}: footer")
    index_handle, _ = _block_handle(table, pos, len(table) - 8, f"{path}: footer")
    index_block = _read_block(table, index_handle, f"{path}: index block")
    entries, next_free = [], 0
    for _, handle_bytes in _block_entries(index_block, f"{path}: index block"):
        handle, _ = _block_handle(handle_bytes, 0, len(handle_bytes), f"{path}: index entry")
        if handle[0] < next_free:  # blocks must be disjoint, so the total work stays linear
            raise TFCheckpointError(f"{path}: data block at offset {handle[0]} overlaps the one before")
        next_free = handle[0] + handle[1] + _BLOCK_TRAILER_SIZE
        block = _read_block(table, handle, f"{path}: data block")
        entries.extend(_block_entries(block, f"{path}: data block at offset {handle[0]}"))
    for (previous, _), (key, _) in zip(entries, entries[1:]):
        if key <= previous:
            raise TFCheckpointError(f"{path}: keys out of order ({previous!r} then {key!r})")
    return entries


# --- Bundle protos ---------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    dtype: int
    dims: tuple[int, ...] | None  # None: unknown rank
    shard_id: int
    offset: int
    size: int
    masked_crc32c: int
    partitioned: bool


def _parse_shape(buf: bytes, what: str) -> tuple[int, ...] | None:
    fields = _proto_fields(buf, what)
    if _field(fields, 3, 0, 0, what):
        return None
    dims = []
    for dim in _repeated_messages(fields, 2, what):
        dims.append(_as_int64(_field(_proto_fields(dim, what), 1, 0, 0, what)))
    return tuple(dims)


def _parse_entry(buf: bytes, what: str) -> _Entry:
    fields = _proto_fields(buf, what)
    return _Entry(
        dtype=_field(fields, 1, 0, 0, what),
        dims=_parse_shape(_field(fields, 2, 2, b"", what), what),
        shard_id=_as_int64(_field(fields, 3, 0, 0, what)),
        offset=_as_int64(_field(fields, 4, 0, 0, what)),
        size=_as_int64(_field(fields, 5, 0, 0, what)),
        masked_crc32c=_field(fields, 6, 5, 0, what),
        partitioned=bool(_repeated_messages(fields, 7, what)),
    )


def _parse_header(buf: bytes, what: str) -> int:
    """Validate a BundleHeaderProto; return its number of shards."""
    fields = _proto_fields(buf, what)
    num_shards = _as_int64(_field(fields, 1, 0, 0, what))
    endianness = _field(fields, 2, 0, 0, what)
    min_consumer = _as_int64(_field(_proto_fields(_field(fields, 3, 2, b"", what), what), 2, 0, 0, what))
    if num_shards < 1:
        raise TFCheckpointError(f"{what}: num_shards is {num_shards}")
    if endianness != 0:
        raise TFCheckpointError(f"{what}: the checkpoint is big-endian; only little-endian is supported")
    if min_consumer > 1:
        raise TFCheckpointError(f"{what}: needs bundle format version {min_consumer}; this reader knows 1")
    return num_shards


# --- Public API ------------------------------------------------------------


class TFCheckpoint:
    """A TensorFlow V2 checkpoint opened for reading one tensor at a time.

    The index is read and verified on opening; data shards are opened lazily and
    only the byte range of a requested tensor is read.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = Path(prefix)
        index_path = Path(f"{self.prefix}.index")
        try:
            table = index_path.read_bytes()
        except OSError as error:
            raise TFCheckpointError(f"cannot read checkpoint index {index_path}: {error}") from error
        entries = _table_entries(table, index_path)
        if not entries or entries[0][0] != b"":
            raise TFCheckpointError(f"{index_path}: no bundle header (empty key) in the index")
        self._num_shards = _parse_header(entries[0][1], f"{index_path}: bundle header")
        self._entries: dict[str, _Entry] = {}
        for key, value in entries[1:]:
            if key.startswith(b"\x00"):  # a slice of a partitioned variable, not a variable itself
                continue
            try:
                name = key.decode("utf-8")
            except UnicodeDecodeError as error:
                raise TFCheckpointError(f"{index_path}: variable name {key!r} is not UTF-8") from error
            self._entries[name] = _parse_entry(value, f"{index_path}: entry {name!r}")
        self._shards: dict[int, BinaryIO] = {}
        self._closed = False

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __enter__(self) -> TFCheckpoint:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()
        self._shards.clear()
        self._closed = True

    def dtype(self, name: str) -> torch.dtype:
        entry = self._entry(name)
        if entry.dtype not in _DTYPES:
            label = _UNSUPPORTED_DTYPE_NAMES.get(entry.dtype, "unknown")
            raise TFCheckpointError(f"{self._where(name)}: unsupported dtype {entry.dtype} ({label})")
        return _DTYPES[entry.dtype]

    def shape(self, name: str) -> tuple[int, ...]:
        dims = self._entry(name).dims
        if dims is None:
            raise TFCheckpointError(f"{self._where(name)}: shape has unknown rank")
        if len(dims) > _MAX_RANK or any(d < 0 for d in dims):
            raise TFCheckpointError(f"{self._where(name)}: invalid shape {list(dims)}")
        if math.prod(d for d in dims if d) > _MAX_ELEMENTS:
            raise TFCheckpointError(f"{self._where(name)}: absurd shape {list(dims)}")
        return dims

    def get_tensor(self, name: str) -> torch.Tensor:
        """Read one tensor, verify its checksum and return it (owning its memory)."""
        entry = self._entry(name)
        if entry.partitioned:
            raise TFCheckpointError(f"{self._where(name)}: partitioned variables are not supported")
        dtype, shape = self.dtype(name), self.shape(name)
        expected_size = math.prod(shape) * dtype.itemsize
        if entry.size != expected_size:
            raise TFCheckpointError(
                f"{self._where(name)}: size {entry.size} bytes does not match shape {list(shape)} "
                f"of {dtype} ({expected_size} bytes)"
            )
        data = self._read_checked(name, entry)
        return data.view(dtype).reshape(shape)

    # --- internals ---

    def _where(self, name: str) -> str:
        return f"{self.prefix}: variable {name!r}"

    def _entry(self, name: str) -> _Entry:
        if self._closed:
            raise TFCheckpointError(f"{self.prefix}: checkpoint is closed")
        if name not in self._entries:
            raise KeyError(f"no variable {name!r} in checkpoint {self.prefix}")
        return self._entries[name]

    def _shard_path(self, shard_id: int) -> Path:
        return Path(f"{self.prefix}.data-{shard_id:05d}-of-{self._num_shards:05d}")

    def _open_shard(self, name: str, shard_id: int) -> BinaryIO:
        if not 0 <= shard_id < self._num_shards:
            raise TFCheckpointError(f"{self._where(name)}: shard_id {shard_id} not in [0, {self._num_shards})")
        if shard_id not in self._shards:
            path = self._shard_path(shard_id)
            try:
                self._shards[shard_id] = open(path, "rb")  # noqa: SIM115  (kept open until close())
            except OSError as error:
                message = f"{self._where(name)}: cannot open data shard {path}: {error}"
                raise TFCheckpointError(message) from error
        return self._shards[shard_id]

    def _read_checked(self, name: str, entry: _Entry) -> torch.Tensor:
        shard = self._open_shard(name, entry.shard_id)
        path = self._shard_path(entry.shard_id)
        shard_size = os.fstat(shard.fileno()).st_size
        if entry.offset < 0 or entry.offset + entry.size > shard_size:
            raise TFCheckpointError(
                f"{self._where(name)}: bytes [{entry.offset}, {entry.offset + entry.size}) "
                f"lie outside data shard {path} ({shard_size} bytes)"
            )
        data = torch.empty(entry.size, dtype=torch.uint8)
        view, crc, done = data.numpy(), 0, 0
        shard.seek(entry.offset)
        # google_crc32c takes only bytes: read in chunks so that no second full-size copy exists
        while done < entry.size:
            chunk = shard.read(min(_READ_CHUNK, entry.size - done))
            if not chunk:
                raise TFCheckpointError(
                    f"{self._where(name)}: data shard {path} ended after {done} of {entry.size} bytes"
                )
            view[done : done + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            crc = google_crc32c.extend(crc, chunk)
            done += len(chunk)
        masked = _mask(crc)
        if masked != entry.masked_crc32c:
            raise TFCheckpointError(
                f"{self._where(name)}: checksum mismatch for bytes [{entry.offset}, "
                f"{entry.offset + entry.size}) of {path}: stored {entry.masked_crc32c:#010x}, "
                f"computed {masked:#010x}"
            )
        return data


def find_checkpoint_prefix(path: str | os.PathLike) -> Path | None:
    """The checkpoint prefix in a folder, or the prefix ``path`` itself; None if there is none."""
    path = Path(path)
    if path.is_dir():
        if (path / "bert_model.ckpt.index").is_file():
            return path / "bert_model.ckpt"
        indexes = [p for p in path.glob("*.index") if p.is_file()]
        prefixes = sorted(p.with_name(p.name[: -len(".index")]) for p in indexes)
        if len(prefixes) > 1:
            listing = ", ".join(p.name for p in prefixes)
            raise TFCheckpointError(f"{path} holds several TensorFlow checkpoints: {listing}; name one")
        return prefixes[0] if prefixes else None
    if Path(f"{path}.index").is_file():
        return path
    if path.name.endswith(".index") and path.is_file():
        return path.with_name(path.name[: -len(".index")])
    return None
