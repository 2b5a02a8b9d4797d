"""Opening GGUF files and reading their metadata into plain Python values.

Parsing is done by the ``gguf`` package (llama.cpp's reference reader); this
module only makes its metadata parsing fast, turns its errors into ``kvgen``
errors and its fields into a dict.
"""

from __future__ import annotations

import os
import struct
import warnings
from collections.abc import Sequence
from typing import Any, overload

import numpy as np
from gguf import GGUFEndian, GGUFReader, GGUFValueType, ReaderField
from gguf.gguf_reader import ReaderTensor

from kvgen.errors import ModelFormatError, ModelNotFoundError

GGUF_MAGIC = b"GGUF"


class ArrayParts(Sequence[np.ndarray]):
    """A metadata field's ``ReaderField.parts`` with its array elements made on demand.

    ``head`` holds the parts before the elements (key length, key bytes, value type, item type, count); element ``i``
    is ``[length (uint64[1]), bytes (uint8[len])]`` of a string (``spans[i]`` = its length field's offset and end) or
    a ``values[i : i + 1]`` view of a scalar array. Indexing gives the same arrays as ``gguf.GGUFReader``'s list.
    """

    def __init__(self, head: list[np.ndarray], buf: np.ndarray, u64: np.dtype, spans: list[tuple[int, int]] | None,
                 values: np.ndarray | None) -> None:
        self.head, self.buf, self.u64, self.spans, self.values = head, buf, u64, spans, values
        self._len = len(head) + (2 * len(spans) if spans is not None else len(values) if values is not None else 0)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, i: slice) -> list[np.ndarray]: ...
    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"part {i} of {self._len}")
        j = i - len(self.head)
        if j < 0:
            return self.head[i]
        if self.spans is None:
            assert self.values is not None  # an element index exists only with spans or values
            return self.values[j : j + 1]
        start, end = self.spans[j // 2]
        return self.buf[start : start + 8].view(self.u64) if j % 2 == 0 else self.buf[start + 8 : end]

    def strings(self) -> list[str]:
        """The string elements decoded as UTF-8 (invalid bytes replaced), without making their arrays."""
        assert self.spans is not None, "a scalar array has no strings"
        view = self.buf.data
        return [str(view[start + 8 : end], "utf-8", "replace") for start, end in self.spans]


class FastGGUFReader(GGUFReader):
    """``gguf.GGUFReader`` with the same ``fields`` and ``tensors``, parsed in ~0.1 s instead of ~3.5 s.

    The base reader slices an ``np.memmap`` once per array element, and each
    memmap slice pays ``memmap.__array_finalize__`` (~10 us): 3.5 s for a
    49k-token vocabulary. Here parsing reads a plain ``ndarray`` view of the
    same mapping, string lengths come from one ``struct.unpack_from`` loop, and a
    field's parts are an :class:`ArrayParts` that makes an element's arrays only
    when indexed (``gguf_metadata`` decodes strings straight from the mapping).
    ``ReaderField.parts``/``data``/``types`` index as the base class's do (a test
    checks it on the default model).
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._buf

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self.mmap = value  # the np.memmap, kept so the mapping lives as long as the reader
        self._buf = value.view(np.ndarray)

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None
    ) -> np.ndarray:
        dt = np.dtype(dtype)
        order = self.byte_order if override_order is None else override_order
        if order != "I":
            dt = dt.newbyteorder(order)
        count = int(count)
        return self._buf[offset : offset + dt.itemsize * count].view(dt)[:count]

    def _build_fields(self, offs: int, count: int) -> int:
        for _ in range(count):
            key_len, key = self._get_str(offs)
            value_type = self._get(offs + 8 + int(key_len[0]), np.uint32)
            if len(value_type) != 1:
                raise ValueError(f"metadata key at offset {offs} runs past the end of the file")
            head: list[np.ndarray] = [key_len, key, value_type]
            start = offs + 12 + int(key_len[0])
            size, parts, data_idxs, types = self._field_parts(start, int(value_type[0]), head)
            name, data = bytes(key).decode("utf-8"), [i + 3 for i in data_idxs]
            self._push_field(ReaderField(offs, name, parts, data, types), skip_sum=True)  # type: ignore[arg-type]
            offs = start + size
        return offs

    def _field_parts(self, offs: int, raw_type: int, head: list[np.ndarray]
                     ) -> tuple[int, Sequence[np.ndarray], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY:
            size, parts, data_idxs, types = super()._get_field_parts(offs, raw_type)
            return size, head + parts, data_idxs, types
        raw_itype = self._get(offs, np.uint32)
        alen = self._get(offs + 4, np.uint64)
        if len(raw_itype) != 1 or len(alen) != 1:
            raise ValueError(f"array header at offset {offs} runs past the end of the file")
        itype, n = GGUFValueType(int(raw_itype[0])), int(alen[0])
        nptype = self.gguf_scalar_to_np.get(itype)
        if itype != GGUFValueType.STRING and nptype is None:  # nested arrays: rare, small
            size, parts, data_idxs, types = super()._get_field_parts(offs, raw_type)
            return size, head + parts, data_idxs, types
        types = [GGUFValueType.ARRAY, itype] if n else [GGUFValueType.ARRAY]
        u64 = np.dtype(np.uint64).newbyteorder(self.byte_order) if self.byte_order != "I" else np.dtype(np.uint64)
        if itype == GGUFValueType.STRING:
            spans = self._string_spans(offs + 12, n)
            end = spans[-1][1] if spans else offs + 12
            strings = ArrayParts([*head, raw_itype, alen], self._buf, u64, spans, None)
            return end - offs, strings, list(range(3, 2 + 2 * n, 2)), types  # [len, bytes] per element
        values = self._get(offs + 12, nptype, n)
        if len(values) != n:
            raise ValueError(f"array of {n} {itype.name} at offset {offs + 12} runs past the end of the file")
        scalars = ArrayParts([*head, raw_itype, alen], self._buf, u64, None, values)
        return 12 + int(values.nbytes), scalars, list(range(2, 2 + n)), types

    def _string_spans(self, offs: int, n: int) -> list[tuple[int, int]]:
        """(offset of the length field, end of the bytes) of n strings from offs."""
        size, view, spans = len(self._buf), self._buf.data, []
        unpack = struct.Struct("<Q" if self.endianess == GGUFEndian.LITTLE else ">Q").unpack_from
        for _ in range(n):
            if offs + 8 > size:
                raise ValueError(f"string array runs past the end of the file at offset {offs}")
            end = offs + 8 + unpack(view, offs)[0]
            if end > size:
                raise ValueError(f"string at offset {offs} runs past the end of the file")
            spans.append((offs, end))
            offs = end
        return spans


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Open a GGUF file (memory-mapped, read-only) with :class:`FastGGUFReader`.

    Raises ``ModelNotFoundError`` if the path does not exist and
    ``ModelFormatError`` if the file is not GGUF, is truncated or is corrupt.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelNotFoundError(f"model file not found: {path}")
    if not os.path.isfile(path):
        raise ModelFormatError(f"not a file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFormatError(f"{path} is not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        with warnings.catch_warnings():  # an offset near 2^64 overflows numpy's uint64 sum: _check_offsets names it
            warnings.simplefilter("ignore", RuntimeWarning)
            reader = FastGGUFReader(path, "r")
    except Exception as e:  # the gguf package raises ValueError, struct/numpy errors, IndexError...
        size = os.path.getsize(path)
        raise ModelFormatError(f"{path} is truncated or corrupt ({size} bytes): {type(e).__name__}: {e}") from None
    _check_offsets(reader, path)
    return reader


def _check_offsets(reader: GGUFReader, path: str) -> None:
    """``ModelFormatError`` naming a tensor whose offset (from the start of the data section) is not a multiple of
    the alignment, whose data runs past the end of the file, or that does not start where the tensor before it ends
    (padded to the alignment), as llama.cpp's ``gguf_init_from_file`` refuses them: the gguf package wraps an offset
    near 2^64 around to bytes before the data section, and a tensor whose type or shape was changed in its info
    reads its neighbours' bytes."""
    room, alignment = len(reader.data) - reader.data_offset, int(reader.alignment)
    end, before = 0, None  # the tensors lie back to back, in the order of their infos, each padded to the alignment
    for t in reader.tensors:
        offset = int(t.field.parts[-1][0])
        if offset % alignment or offset + int(t.n_bytes) > room:
            raise ModelFormatError(f"{path}: tensor {t.name!r} has data offset {offset}, which is not a multiple of "
                                   f"the alignment {reader.alignment} or runs past the end of the file")
        if offset != end:
            what = ("the first tensor's data starts at offset 0" if before is None else
                    f"the tensor before it, {before.name!r} ({before.tensor_type.name}, shape {_torch_shape(before)}: "
                    f"{before.n_bytes} bytes), ends at offset {end}")
            raise ModelFormatError(f"{path}: tensor {t.name!r} has data offset {offset}, but {what}: a tensor's type "
                                   f"or shape does not match its data")
        end, before = offset + -(-int(t.n_bytes) // alignment) * alignment, t


def _torch_shape(t: ReaderTensor) -> list[int]:
    return [int(d) for d in reversed(t.shape.tolist())]  # GGUF lists dims fastest first


def _field_value(field: Any) -> Any:
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        sub = types[-1] if len(types) > 1 else None
        if isinstance(parts := field.parts, ArrayParts):  # FastGGUFReader: no per-element arrays
            return parts.strings() if parts.values is None else parts.values.tolist()
        if sub == GGUFValueType.STRING:
            return [field.parts[i].tobytes().decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return field.parts[field.data[0]].tobytes().decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]


def gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata of an open GGUF file as plain Python values.

    Strings are ``str``, numbers ``int``/``float``/``bool``, arrays ``list``.
    """
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = _field_value(field)
    return meta
