"""MindSpore's ``.ckpt`` files, written one tensor at a time and read back by their table of contents.

A ``.ckpt`` file is protobuf: a ``Checkpoint`` message whose repeated field 1 holds one ``Value`` per
tensor -- field 1 its name, field 2 a ``TensorProto`` with ``dims`` (1), ``tensor_type`` (2, MindSpore's
name of the dtype, e.g. ``Float32``) and ``tensor_content`` (3, the raw bytes).  A tensor above
SLICE_BYTES is written as several Values of the same name, each with the whole tensor's dims and part of
its bytes, as ``mindspore.save_checkpoint`` does; ``mindspore.load_checkpoint`` joins them.

:func:`write` streams the tensors: each is copied to host memory, written and let go before the next, so a
save holds one tensor beside the model instead of a copy of the whole state (``save_checkpoint`` is given
Tensors, so a caller must first make one per entry).  :func:`entries` walks a file with ``seek`` past every
``tensor_content``: checking a checkpoint just written (names, shapes, byte counts, a file cut short) reads
a few kilobytes instead of loading a second copy of the model, as ``load_checkpoint`` would; :func:`read`
then reads one tensor by the offsets it found, so a conversion can hold one tensor at a time.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, BinaryIO, Iterable, Iterator, List, Mapping, Tuple

import numpy as np

from naohai.errors import UserError


SLICE_BYTES = 512 << 20     # mindspore.train.serialization.SLICE_SIZE (512 MiB)
#: numpy dtype -> the name MindSpore writes for it (``str`` of the MindSpore dtype)
NUMPY_TYPES = {np.dtype(np.float32): "Float32", np.dtype(np.float16): "Float16", np.dtype(np.float64): "Float64",
               np.dtype(np.int8): "Int8", np.dtype(np.int32): "Int32", np.dtype(np.int64): "Int64",
               np.dtype(np.uint8): "UInt8", np.dtype(np.bool_): "Bool"}
_NUMPY_OF = {name: dtype for dtype, name in NUMPY_TYPES.items()}


def shape_of(tensors: Mapping[str, Any], name: str) -> Tuple[int, ...]:
    """A tensor's shape, without reading it when ``tensors`` can tell (a lazy mapping's ``shape``, as
    :class:`Tensors` has), else from the tensor."""
    shape = getattr(tensors, "shape", None)
    return tuple(shape(name)) if callable(shape) else tuple(tensors[name].shape)


class MalformedCheckpoint(ValueError):
    """The file is not a complete ``.ckpt`` (cut short, or not protobuf of that shape)."""


@dataclasses.dataclass
class Entry:
    name: str
    dims: Tuple[int, ...]
    dtype: str
    nbytes: int         # of the tensor's content, over all its Values
    #: (file offset, length) of each Value's content, in order (read from a file only; not compared)
    parts: List[Tuple[int, int]] = dataclasses.field(default_factory=list, compare=False, repr=False)

    @property
    def size(self) -> int:
        """The number of values (1 for a scalar)."""
        return int(np.prod(self.dims, dtype=np.int64))


_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


class _Reader:
    def __init__(self, fh: BinaryIO, size: int):
        self.fh, self.size = fh, size

    def pos(self) -> int:
        return self.fh.tell()

    def varint(self, end: int) -> int:
        value, shift = 0, 0
        while True:
            if self.pos() >= end:
                raise MalformedCheckpoint(f"a number runs past its field's end (byte {end})")
            byte = self.fh.read(1)[0]
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise MalformedCheckpoint(f"a number longer than 10 bytes at byte {self.pos()}")

    def length(self, end: int) -> int:
        """A length prefix, checked to end within ``end``; returns the end of the field it prefixes."""
        n = self.varint(end)
        stop = self.pos() + n
        if stop > end:
            raise MalformedCheckpoint(f"a field of {n} bytes at byte {self.pos()} runs past byte {end}"
                                      + (" (the file is cut short)" if end == self.size else ""))
        return stop

    def skip(self, wire: int, end: int) -> None:
        if wire == _VARINT:
            self.varint(end)
        elif wire in (_FIXED64, _FIXED32):
            stop = self.pos() + (8 if wire == _FIXED64 else 4)
            if stop > end:
                raise MalformedCheckpoint(f"a fixed-size field runs past byte {end}")
            self.fh.seek(stop)
        elif wire == _BYTES:
            self.fh.seek(self.length(end))
        else:
            raise MalformedCheckpoint(f"wire type {wire} at byte {self.pos()} is not protobuf's")


def _tensor(r: _Reader, end: int) -> Tuple[Tuple[int, ...], str, List[Tuple[int, int]]]:
    dims: List[int] = []
    dtype, content = "", []
    while r.pos() < end:
        key = r.varint(end)
        field, wire = key >> 3, key & 7
        if field == 1 and wire == _VARINT:
            dims.append(r.varint(end))
        elif field == 1 and wire == _BYTES:            # packed dims
            stop = r.length(end)
            while r.pos() < stop:
                dims.append(r.varint(stop))
        elif field == 2 and wire == _BYTES:
            stop = r.length(end)
            dtype = r.fh.read(stop - r.pos()).decode("utf-8", "replace")
        elif field == 3 and wire == _BYTES:
            stop = r.length(end)
            content.append((r.pos(), stop - r.pos()))
            r.fh.seek(stop)
        else:
            r.skip(wire, end)
    return tuple(dims), dtype, content


def _value(r: _Reader, end: int) -> Tuple[str, Tuple[int, ...], str, List[Tuple[int, int]]]:
    name, tensor = None, None
    while r.pos() < end:
        key = r.varint(end)
        field, wire = key >> 3, key & 7
        if field == 1 and wire == _BYTES:
            stop = r.length(end)
            name = r.fh.read(stop - r.pos()).decode("utf-8", "replace")
        elif field == 2 and wire == _BYTES:
            tensor = _tensor(r, r.length(end))
        else:
            r.skip(wire, end)
    if name is None or tensor is None:
        raise MalformedCheckpoint(f"a value ending at byte {end} has no {'name' if name is None else 'tensor'}")
    return (name,) + tensor


def entries(path: str) -> List[Entry]:
    """The tensors of the ``.ckpt`` file ``path`` in file order (a tensor written in several Values is one
    entry, its bytes summed); :class:`MalformedCheckpoint` when the file is cut short or is not a checkpoint."""
    size = os.path.getsize(path)
    out: List[Entry] = []
    with open(path, "rb") as fh:
        r = _Reader(fh, size)
        while r.pos() < size:
            key = r.varint(size)
            if key != (1 << 3 | _BYTES):
                raise MalformedCheckpoint(f"byte {r.pos()}: field {key >> 3} (wire {key & 7}) where a checkpoint "
                                          "holds only values (field 1)")
            name, dims, dtype, parts = _value(r, r.length(size))
            nbytes = sum(n for _, n in parts)
            if out and out[-1].name == name and out[-1].dims == dims and out[-1].dtype == dtype:
                out[-1].nbytes += nbytes
                out[-1].parts.extend(parts)
            else:
                out.append(Entry(name, dims, dtype, nbytes, list(parts)))
    return out


def read(path: str, entry: Entry) -> np.ndarray:
    """The tensor ``entry`` (from :func:`entries` of ``path``) as a numpy array of its shape, its Values'
    contents joined; :class:`MalformedCheckpoint` when its type is not one of :data:`NUMPY_TYPES` or its bytes
    are not its shape's."""
    if entry.dtype not in _NUMPY_OF:
        raise MalformedCheckpoint(f"tensor '{entry.name}' has type {entry.dtype}, which is read here only as "
                                  f"one of {', '.join(_NUMPY_OF)}")
    dtype = _NUMPY_OF[entry.dtype]
    if entry.size * dtype.itemsize != entry.nbytes:
        raise MalformedCheckpoint(f"tensor '{entry.name}': {entry.nbytes} bytes for shape {list(entry.dims)} "
                                  f"of {entry.dtype}")
    out = np.empty(entry.dims, dtype)
    view = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(b"")
    at = 0
    with open(path, "rb") as fh:
        for offset, n in entry.parts:
            fh.seek(offset)
            if fh.readinto(view[at:at + n]) != n:
                raise MalformedCheckpoint(f"tensor '{entry.name}' is cut short (byte {offset + n})")
            at += n
    return out


class LazyTensors(Mapping):
    """A mapping of tensors each read (or made) when asked: ``in``, ``get``, order and size come from ``_keys``
    (the names, set by the subclass), never from reading a tensor, as Mapping's own ``in`` and ``get`` would."""

    _keys: Mapping[str, Any]

    def __contains__(self, name: object) -> bool:
        return name in self._keys

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self._keys else default

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class Tensors(LazyTensors):
    """The tensors of a ``.ckpt`` file by name, found by its table of contents and each read when asked
    (:func:`entries`, :func:`read`), so a reader holds the ones it keeps and no more; a file that is not a
    checkpoint, or a name it lacks, exits 2 naming it (``in`` and ``get`` ask the table only)."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._entries = {e.name: e for e in entries(path)}
            self._keys = self._entries
        except (OSError, MalformedCheckpoint) as exc:
            raise UserError(f"is not a readable MindSpore checkpoint ({exc})", where=path) from None

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._entries:
            raise UserError(f"has no tensor '{name}', which its recipe's model needs", where=self.path)
        try:
            return read(self.path, self._entries[name])
        except (OSError, MalformedCheckpoint) as exc:
            raise UserError(f"is not a readable MindSpore checkpoint ({exc})", where=self.path) from None

    def shape(self, name: str) -> Tuple[int, ...]:
        """A tensor's shape by the table, without reading it."""
        return self._entries[name].dims


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | _BYTES) + _varint(len(payload)) + payload


def write(path: str, tensors: Iterable[Tuple[str, Any]]) -> List[Entry]:
    """Write ``(name, tensor)`` pairs to ``path`` as a ``.ckpt`` file, in order; a tensor is a numpy array (of
    :data:`NUMPY_TYPES`) or anything with ``shape``, ``dtype`` (a MindSpore dtype) and ``asnumpy()``, read when
    its turn comes (``tensors`` may be a generator that makes each one then).  Values are laid out as
    ``mindspore.save_checkpoint`` lays them out (dims unpacked, then the type, then the bytes: the same file,
    byte for byte, except that it leaves out empty tensors).  No fsync.  Returns what was written, as
    :func:`entries` reads it."""
    written: List[Entry] = []
    with open(path, "wb") as fh:
        for name, tensor in tensors:
            dims = tuple(int(d) for d in tensor.shape)
            if isinstance(tensor, np.ndarray):
                if tensor.dtype not in NUMPY_TYPES:
                    raise ValueError(f"{name}: numpy dtype {tensor.dtype} has no MindSpore checkpoint type here")
                dtype, data = NUMPY_TYPES[tensor.dtype], tensor
            else:
                dtype, data = str(tensor.dtype), np.asarray(tensor.asnumpy())
            if not data.flags.c_contiguous:
                data = np.ascontiguousarray(data)
            if data.shape != dims:
                raise ValueError(f"{name}: asnumpy() gave shape {data.shape}, the tensor's shape is {dims}")
            raw = memoryview(data.reshape(-1).view(np.uint8)) if data.size else memoryview(b"")
            head = b"".join(_varint(1 << 3 | _VARINT) + _varint(d) for d in dims) + _field(2, dtype.encode())
            for start in range(0, max(1, len(raw)), SLICE_BYTES):
                part = raw[start:start + SLICE_BYTES]
                content_key = _varint(3 << 3 | _BYTES) + _varint(len(part))
                tensor_len = len(head) + len(content_key) + len(part)
                value_head = _field(1, name.encode()) + _varint(2 << 3 | _BYTES) + _varint(tensor_len)
                fh.write(_varint(1 << 3 | _BYTES) + _varint(len(value_head) + tensor_len) + value_head + head
                         + content_key)
                fh.write(part)
            written.append(Entry(name, dims, dtype, len(raw)))
            del data, raw
    return written
