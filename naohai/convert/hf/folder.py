"""Reading and writing a Hugging Face model folder's files (no torch, no transformers).

A folder holds ``config.json``, the weights as one ``model.safetensors`` or as shards
``model-0000k-of-0000n.safetensors`` listed by ``model.safetensors.index.json``
(``weight_map``: tensor name -> shard file), and the tokenizer files.  Safetensors are
read here with numpy from the file layout (an 8-byte little-endian header length, a JSON
header of ``dtype`` / ``shape`` / ``data_offsets`` per tensor, then the raw bytes), so
``BF16`` tensors, which numpy has no type for, are read too: every floating tensor is
upcast to float32, the master weights' type.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import struct
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from naohai.errors import UserError
from naohai.validate import read_json_object

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: files copied with the weights: the tokenizer (fast and slow forms) and the generation defaults
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")
DEFAULT_SHARD_BYTES = 5 * 1024 ** 3          # transformers' save_pretrained default (max_shard_size 5GB)

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG)) and (
        os.path.isfile(os.path.join(path, SINGLE)) or os.path.isfile(os.path.join(path, INDEX)))


def read_config(folder: str) -> Dict[str, Any]:
    path = os.path.join(folder, CONFIG)
    if not os.path.isdir(folder):
        raise UserError("is not a folder (a Hugging Face model is a folder with config.json and safetensors)",
                        where=folder)
    if not os.path.isfile(path):
        raise UserError(f"is not a Hugging Face model folder: it has no {CONFIG}", where=folder)
    return read_json_object(path)


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor of a ``.safetensors`` file, known by its header; :meth:`read` reads its bytes then."""

    path: str
    name: str
    dtype: str                  # safetensors' name: F32, BF16, I64, ...
    shape: Tuple[int, ...]
    offset: int                 # of its first byte in the file
    nbytes: int

    def read(self) -> np.ndarray:
        """The tensor; a floating one as float32 (``BF16`` included), as the master weights are kept."""
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            raw = np.fromfile(fh, np.uint8, self.nbytes)
        if raw.size != self.nbytes:
            raise UserError(f"ends inside tensor '{self.name}' (the file changed or was cut short while read)",
                            where=self.path)
        if self.dtype == "BF16":
            value = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            value = raw.view(np.dtype(_DTYPES[self.dtype]).newbyteorder("<"))
        value = value.reshape(self.shape)
        if value.dtype.kind == "f":
            with np.errstate(over="ignore"):        # float64 beyond float32's range: inf, for the caller to refuse
                return value.astype(np.float32, copy=value.dtype != np.float32)
        return value.astype(value.dtype.newbyteorder("="))


def safetensors_header(path: str) -> Dict[str, StoredTensor]:
    """The tensors of one ``.safetensors`` file by name, from its header alone (no tensor is read).  A header
    that does not describe its bytes (an unknown dtype, a shape that is not its byte count, offsets outside
    the file) exits 2 naming the file and tensor."""
    try:
        total = os.path.getsize(path)
        with open(path, "rb") as fh:
            size = int(np.frombuffer(fh.read(8), "<u8")[0])
            if size > total - 8:
                raise ValueError(f"its header length {size} is beyond the file's end")
            header = json.loads(fh.read(size).decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
    except (OSError, ValueError, IndexError, UnicodeDecodeError, OverflowError) as exc:
        raise UserError(f"is not a readable safetensors file ({exc})", where=path) from None
    data_bytes = total - 8 - size
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(v) for v in entry["data_offsets"])
            dtype, shape = entry["dtype"], tuple(int(n) for n in entry["shape"])
            if not 0 <= start <= end <= data_bytes:
                raise ValueError(f"data_offsets [{start}, {end}] outside the file's {data_bytes} data bytes")
            if dtype not in _DTYPES and dtype != "BF16":
                raise UserError(f"tensor '{name}' has dtype {dtype}, which naohai does not read", where=path)
            itemsize = 2 if dtype == "BF16" else np.dtype(_DTYPES[dtype]).itemsize
            if any(n < 0 for n in shape) or math.prod(shape) * itemsize != end - start:
                raise ValueError(f"shape {list(shape)} of {dtype} is not its {end - start} bytes")
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"tensor '{name}': its header entry does not describe its bytes ({exc})",
                            where=path, rule="dtype, shape and data_offsets of each tensor") from None
        out[name] = StoredTensor(path, name, dtype, shape, 8 + size + start, end - start)
    return out


def read_safetensors(path: str) -> Dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file, read (see :meth:`StoredTensor.read`)."""
    return {name: stored.read() for name, stored in safetensors_header(path).items()}


def stored_weights(folder: str) -> Dict[str, StoredTensor]:
    """Every tensor of the folder by name, from the headers of the index's shards (each one must exist and
    hold what the index places there) or of ``model.safetensors``; nothing is read yet."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError("has no 'weight_map' object of tensor name -> shard file", where=index,
                            key="weight_map")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not os.path.isfile(os.path.join(folder, shard)):
                example = next(k for k, v in weight_map.items() if v == shard)
                raise UserError(f"names shard '{shard}' (for e.g. '{example}'),"
                                f" which is missing from {folder}", where=index, key="weight_map")
        out: Dict[str, StoredTensor] = {}
        for shard in shards:
            tensors = safetensors_header(os.path.join(folder, shard))
            for name in (k for k, v in weight_map.items() if v == shard):
                if name not in tensors:
                    raise UserError(f"does not hold '{name}', which {INDEX} places there",
                                    where=os.path.join(folder, shard))
            out.update(tensors)
        return out
    single = os.path.join(folder, SINGLE)
    if not os.path.isfile(single):
        raise UserError(f"has no {SINGLE} and no {INDEX} (only safetensors weights are read; convert "
                        f"pytorch_model.bin with transformers first)", where=folder)
    return safetensors_header(single)


#: a tensor to write: (name, its float32 byte count, a function that makes it when its turn comes)
Planned = Tuple[str, int, Callable[[], np.ndarray]]


def write_weights(folder: str, tensors: Sequence[Planned], shard_bytes: int = DEFAULT_SHARD_BYTES) -> List[str]:
    """Write float32 tensors as ``model.safetensors``, or as shards plus the index when larger than
    ``shard_bytes``; returns the files written.  Each tensor is made, written and let go in turn (one is held
    at a time; see :func:`write_safetensors`)."""
    groups: List[List[Planned]] = [[]]
    size = 0
    for item in tensors:
        if groups[-1] and size + item[1] > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item[1]
    meta = {"format": "pt"}
    if len(groups) == 1:
        write_safetensors(os.path.join(folder, SINGLE), groups[0], meta)
        return [SINGLE]
    files = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    weight_map = {}
    for name, group in zip(files, groups):
        write_safetensors(os.path.join(folder, name), group, meta)
        weight_map.update({item[0]: name for item in group})
    total = sum(item[1] for group in groups for item in group)
    with open(os.path.join(folder, INDEX), "w", encoding="utf-8") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    return files + [INDEX]


def write_safetensors(path: str, tensors: Sequence[Planned], metadata: Dict[str, str]) -> None:
    """One ``.safetensors`` file of float32 tensors, made one at a time.  Their byte counts fix every offset
    before any is made, but a shape is known only once its tensor is; so the data is written first, after
    room left for the header, and the header last, padded with spaces to fill that room (the format allows
    trailing whitespace; the room is a multiple of 8, so the data stays aligned as the safetensors library
    aligns it)."""
    offsets, at = [], 0
    for _, nbytes, _ in tensors:
        offsets.append((at, at + nbytes))
        at += nbytes

    def header(shapes: Sequence[Sequence[int]]) -> bytes:
        entries: Dict[str, Any] = {"__metadata__": metadata}
        for (name, _, _), shape, span in zip(tensors, shapes, offsets):
            entries[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": list(span)}
        return json.dumps(entries, separators=(",", ":")).encode("utf-8")

    # the widest shape text a tensor of n values could have: up to 8 dimensions of at most n each
    room = len(header([[max(1, nbytes // 4)] * 8 for _, nbytes, _ in tensors]))
    room += -room % 8
    shapes = []
    with open(path, "wb") as fh:
        fh.seek(8 + room)
        for name, nbytes, make in tensors:
            value = np.ascontiguousarray(make(), np.float32)
            if value.nbytes != nbytes or value.ndim > 8:
                raise ValueError(f"{name}: made {value.nbytes} bytes of shape {value.shape}, planned {nbytes}")
            fh.write(memoryview(value.reshape(-1)).cast("B") if value.size else b"")
            shapes.append(value.shape)
            del value
        text = header(shapes)
        fh.seek(0)
        fh.write(struct.pack("<Q", room) + text + b" " * (room - len(text)))


def write_config(folder: str, config: Dict[str, Any]) -> None:
    write_config_as(folder, CONFIG, config)


def write_config_as(folder: str, name: str, config: Dict[str, Any]) -> None:
    with open(os.path.join(folder, name), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
        fh.write("\n")


def copy_tokenizer_files(src: Optional[str], dst: str) -> List[str]:
    """Copy the tokenizer / generation files ``src`` has into ``dst``; returns their names."""
    copied = []
    if src and os.path.isdir(src):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(src, name)):
                shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
                copied.append(name)
    return copied
