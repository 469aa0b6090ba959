"""A checkpoint's tensors as numpy arrays, read from torch's zip format without importing torch.

``torch.save`` writes a zip archive: ``<name>/data.pkl`` (the pickled object, each tensor a call of
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` whose storage is a persistent id
``("storage", <dtype>Storage, key, location, numel)``) and each storage's bytes, uncompressed, in
``<name>/data/<key>``. ``load`` unpickles data.pkl with an Unpickler that builds nothing but plain
containers, numbers and strings: each tensor becomes a read-only numpy view of the file's bytes (mapped,
not copied), and every other class (optimizer and scheduler state, numpy scalars, torch.Size ...) an
inert ``Opaque`` placeholder. So ``splat-metal-export`` reads a run's six gaussian tensors in a fraction
of the ~2-3 s that importing torch takes. What it cannot read (the legacy non-zip format, a compressed
member, a dtype numpy lacks) raises ``Unsupported``; the caller then loads with torch.
"""

from __future__ import annotations

import mmap
import pickle
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

# torch's typed storage classes -> numpy dtypes (bfloat16: read as uint16, widened to float32 by ``as_float32``)
STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16, "BFloat16Storage": "bfloat16",
    "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8,
    "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}  # fmt: skip


class Unsupported(Exception):
    """The file is not a checkpoint this reader handles; the message says why (load it with torch)."""


class Opaque:
    """Any object of a class this reader does not build (its arguments and state are kept, unused)."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state

    def __call__(self, *args, **kwargs):  # a reduce of a stubbed callable (e.g. a numpy scalar)
        return Opaque(*args, **kwargs)


class BFloat16Array(np.ndarray):
    """bfloat16 bits as uint16 (numpy has no bfloat16); ``as_float32`` widens them."""


def as_float32(a: np.ndarray) -> np.ndarray:
    """float32 values of any array this reader returns (bfloat16 bits widened exactly)."""
    if isinstance(a, BFloat16Array):
        return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(a, dtype=np.float32)


class _Storage:
    def __init__(self, dtype, array: np.ndarray):
        self.dtype, self.array = dtype, array


def _rebuild_tensor(storage: _Storage, offset: int, size, stride, *_ignored) -> np.ndarray:  # [size]
    base = storage.array
    n = 1
    for s in size:
        n *= s
    if n == 0:
        out = np.zeros(tuple(size), dtype=base.dtype)
    else:
        end = offset + 1 + sum((s - 1) * st for s, st in zip(size, stride))
        if offset < 0 or end > base.shape[0] or any(st < 0 for st in stride):
            raise Unsupported(
                f"a tensor of size {tuple(size)} stride {tuple(stride)} at {offset} lies outside its storage"
            )
        item = base.itemsize
        out = np.lib.stride_tricks.as_strided(base[offset:], shape=tuple(size),
                                              strides=tuple(st * item for st in stride), writeable=False)  # fmt: skip
    return out.view(BFloat16Array) if storage.dtype == "bfloat16" else out


def _rebuild_parameter(data, requires_grad=None, backward_hooks=None, *_ignored):
    return data


_BUILT = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
}


def load(path: Path) -> Any:
    """The object ``torch.load(path)`` would return, tensors as read-only numpy arrays over the mapped file.
    The file stays mapped while any of them is alive."""
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise Unsupported(f"not a zip checkpoint ({e})") from None
    with archive, open(path, "rb") as f:
        pkl = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise Unsupported("no single <name>/data.pkl in the archive")
        prefix = pkl[0][: -len("data.pkl")]
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size else None
        byteorder = prefix + "byteorder"
        if byteorder in archive.namelist() and archive.read(byteorder).strip() != sys.byteorder.encode():
            raise Unsupported(f"stored {archive.read(byteorder).decode()}-endian on a {sys.byteorder}-endian machine")

        def storage(dtype_name: str, key: str, numel: int) -> _Storage:
            dtype = STORAGE_DTYPES.get(dtype_name)
            if dtype is None:
                raise Unsupported(f"storage type {dtype_name}")
            info = archive.getinfo(f"{prefix}data/{key}")
            if info.compress_type != zipfile.ZIP_STORED:
                raise Unsupported(f"storage {key} is compressed")
            f.seek(info.header_offset)
            header = f.read(30)  # the local file header: its name and extra field lengths at 26 and 28
            start = (
                info.header_offset
                + 30
                + int.from_bytes(header[26:28], "little")
                + int.from_bytes(header[28:30], "little")
            )
            np_dtype = np.uint16 if dtype == "bfloat16" else dtype
            if numel * np.dtype(np_dtype).itemsize > info.file_size:
                raise Unsupported(f"storage {key} is shorter than its {numel} elements")
            return _Storage(dtype, np.frombuffer(mapped, dtype=np_dtype, count=numel, offset=start))

        class Reader(pickle.Unpickler):
            def find_class(self, module, name):
                if (module, name) in _BUILT:
                    return _BUILT[(module, name)]
                if module == "torch" and name in STORAGE_DTYPES:
                    return name
                return Opaque

            def persistent_load(self, pid):
                if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
                    raise Unsupported(f"persistent id {pid!r:.80}")
                _, dtype_name, key, _location, numel = pid
                if not isinstance(dtype_name, str):
                    raise Unsupported(f"storage type {dtype_name!r:.80}")
                return storage(dtype_name, str(key), int(numel))

        try:
            return Reader(archive.open(pkl[0])).load()
        except Unsupported:
            raise
        except Exception as e:  # noqa: BLE001 - a pickle this reader does not understand
            raise Unsupported(f"{type(e).__name__}: {e}") from None
