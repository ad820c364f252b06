"""The safetensors file format, read and written with NumPy (no dependency).

A safetensors file is three parts::

    8 bytes     N, the header's length (unsigned 64-bit, little-endian)
    N bytes     a JSON object: name -> {"dtype": "F32", "shape": [3, 4], "data_offsets": [begin, end]},
                plus an optional "__metadata__": {str: str}; padded with spaces
    the rest    the tensors' bytes, little-endian, row-major, at [begin, end) from the start of this part

The tensors must cover the data part exactly (no gaps, no overlaps): that makes a truncated or padded
file detectable from its header alone. This module writes the header padded so the data starts at a
multiple of 8 bytes (as the reference implementation does) and checks all of the above when reading, so
a damaged file is a ``SafetensorsError`` whose one-line message names it. ``tests/test_interop.py``
checks files written here against the ``safetensors`` package when it is installed.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from .. import backend

# safetensors dtype names <-> NumPy dtypes (little-endian)
DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": backend.bfloat16,
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}  # fmt: skip
_NAME_OF = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit too


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file (one-line message naming it)."""


def _dtype_name(dt: np.dtype) -> str:
    dt = np.dtype(dt)
    key = dt.newbyteorder("<") if dt.byteorder == ">" else dt
    for d, name in _NAME_OF.items():
        if d == key:
            return name
    raise TypeError(f"safetensors cannot store dtype {dt}")


def save_file(path, arrays: dict, metadata: dict | None = None, *, fsync: bool = True) -> Path:
    """Write ``arrays`` (name -> NumPy array) to ``path``. ``metadata``: str -> str, stored in the header.

    ``fsync``: the file is on disk when this returns (what an atomic checkpoint needs before its rename)."""
    path = Path(path)
    host = {}
    for k, a in arrays.items():
        if not isinstance(k, str) or k == "__metadata__":
            raise ValueError(f"safetensors: bad tensor name {k!r}")
        a = np.asarray(backend.to_numpy(a))
        # np.require, not np.ascontiguousarray: that one makes a 0-d tensor (a scalar, shape ()) 1-d
        host[k] = np.require(a, dtype=a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype,
                             requirements="C")
    header, offset = {}, 0
    if metadata:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ValueError(f"safetensors metadata must map str to str: {bad[0]!r}")
        header["__metadata__"] = dict(metadata)
    for k, a in host.items():
        header[k] = {"dtype": _dtype_name(a.dtype), "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data part starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for a in host.values():
            if a.nbytes:
                f.write(a.reshape(-1).view(np.uint8).data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return path


def read_header(path) -> tuple[dict, dict, int]:
    """(tensors: name -> (dtype, shape, begin, end), metadata, start of the data part) of a safetensors file,
    after checking that the header is sound and the tensors cover the data part exactly."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path} is {size} bytes, too short for a safetensors file")
            n = int.from_bytes(head, "little")
            if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
                raise SafetensorsError(f"{path} is damaged or not a safetensors file (header length {n}, file "
                                       f"size {size})")
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsError(f"{path} cannot be read ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise SafetensorsError(f"{path} is damaged or not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise SafetensorsError(f"{path}: __metadata__ is not an object")
    tensors, spans = {}, []
    for k, h in header.items():
        try:
            dt = DTYPES[h["dtype"]]
            shape, offsets = tuple(h["shape"]), tuple(h["data_offsets"])
            if not all(type(x) is int for x in shape + offsets):  # 1.5 and true are no sizes (int() read them as 1)
                raise TypeError
            begin, end = offsets
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {k!r} has a bad header entry {h!r} (unknown dtype, shape or "
                                   "offsets)") from None
        if min(shape, default=1) < 0 or end - begin != dt.itemsize * math.prod(shape):  # Python ints: no wrapping
            raise SafetensorsError(f"{path}: tensor {k!r} holds {end - begin} bytes, not the {h['dtype']} {shape} "
                                   "its header says")
        tensors[k] = (dt, shape, begin, end)
        spans.append((begin, end, k))
    data_start, pos = 8 + n, 0
    for begin, end, k in sorted(spans):
        if begin != pos:
            raise SafetensorsError(f"{path}: tensor {k!r} starts at byte {begin} of the data, expected {pos} (a "
                                   "gap or an overlap: damaged file)")
        pos = end
    if data_start + pos != size:
        what = "truncated" if data_start + pos > size else "longer than its header says"
        raise SafetensorsError(f"{path} is damaged: {what} ({size} bytes, the header describes {data_start + pos})")
    return tensors, meta, data_start


def load_file(path, *, names=None) -> dict:
    """name -> NumPy array of a safetensors file (every tensor, or those in ``names``), read into memory."""
    path = Path(path)
    tensors, _, start = read_header(path)
    out = {}
    try:
        with open(path, "rb") as f:
            for k, (dt, shape, begin, end) in tensors.items():
                if names is not None and k not in names:
                    continue
                a = np.empty(shape, dtype=dt)
                f.seek(start + begin)
                if end > begin and f.readinto(a.reshape(-1).view(np.uint8)) != end - begin:
                    raise SafetensorsError(f"{path} is truncated (tensor {k!r})")
                out[k] = a
    except OSError as e:
        raise SafetensorsError(f"{path} cannot be read ({e.strerror or e})") from None
    return out


def read_metadata(path) -> dict:
    """The ``__metadata__`` of a safetensors file."""
    return read_header(path)[1]


__all__ = ["DTYPES", "SafetensorsError", "load_file", "read_header", "read_metadata", "save_file"]
