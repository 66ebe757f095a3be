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

import json
import os
import shutil
from typing import Any, Dict, List, Optional

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


def read_safetensors(path: str) -> Dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file; floating ones as float32 (``BF16`` included).  A header
    that does not describe its bytes (a wrong dtype, shape or offsets) exits 2 naming the file and tensor."""
    try:
        with open(path, "rb") as fh:
            size = int(np.frombuffer(fh.read(8), "<u8")[0])
            if size > os.path.getsize(path) - 8:
                raise ValueError(f"its header length {size} is beyond the file's end")
            header = json.loads(fh.read(size).decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
    except (OSError, ValueError, IndexError, UnicodeDecodeError, OverflowError) as exc:
        raise UserError(f"is not a readable safetensors file ({exc})", where=path) from None
    data = np.memmap(path, np.uint8, mode="r", offset=8 + size) if os.path.getsize(path) > 8 + size else \
        np.zeros(0, np.uint8)
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(v) for v in entry["data_offsets"])
            dtype, shape = entry["dtype"], tuple(int(n) for n in entry["shape"])
            if not 0 <= start <= end <= data.size:
                raise ValueError(f"data_offsets [{start}, {end}] outside the file's {data.size} data bytes")
            raw = data[start:end]
            if dtype == "BF16":
                value = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
            elif dtype in _DTYPES:
                value = raw.view(np.dtype(_DTYPES[dtype]).newbyteorder("<"))
            else:
                raise UserError(f"tensor '{name}' has dtype {dtype}, which naohai does not read", where=path)
            value = value.reshape(shape)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"tensor '{name}': its header entry does not describe its bytes ({exc})",
                            where=path, rule="dtype, shape and data_offsets of each tensor") from None
        if value.dtype.kind == "f":
            with np.errstate(over="ignore"):        # float64 beyond float32's range: inf, for the caller to refuse
                out[name] = value.astype(np.float32)
        else:
            out[name] = np.array(value)
    return out


def read_weights(folder: str) -> Dict[str, np.ndarray]:
    """All tensors of the folder: the index's shards (each one must exist), or ``model.safetensors``."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"is not a safetensors index with a 'weight_map' ({exc})", where=index) from None
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not os.path.isfile(os.path.join(folder, shard)):
                example = next(k for k, v in weight_map.items() if v == shard)
                raise UserError(f"names shard '{shard}' (for e.g. '{example}'),"
                                f" which is missing from {folder}", where=index, key="weight_map")
        out: Dict[str, np.ndarray] = {}
        for shard in shards:
            tensors = read_safetensors(os.path.join(folder, shard))
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
    return read_safetensors(single)


def write_weights(folder: str, tensors: Dict[str, np.ndarray], shard_bytes: int = DEFAULT_SHARD_BYTES) -> List[str]:
    """Write float32 tensors as ``model.safetensors``, or as shards plus the index when larger than
    ``shard_bytes``; returns the files written."""
    from safetensors.numpy import save_file

    groups: List[Dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors.items():
        value = np.ascontiguousarray(value, np.float32)
        if groups[-1] and size + value.nbytes > shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = value
        size += value.nbytes
    meta = {"format": "pt"}
    if len(groups) == 1:
        save_file(groups[0], os.path.join(folder, SINGLE), metadata=meta)
        return [SINGLE]
    files = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    weight_map = {}
    for name, group in zip(files, groups):
        save_file(group, os.path.join(folder, name), metadata=meta)
        weight_map.update({k: name for k in group})
    total = sum(v.nbytes for g in groups for v in g.values())
    with open(os.path.join(folder, INDEX), "w", encoding="utf-8") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    return files + [INDEX]


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
