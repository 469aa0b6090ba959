"""Readers for .splat and .spz written from the formats' own sources, not from our writers, so that
the tests read the files the way the viewers do.

- .splat: antimatter15/splat main.js ``generateTexture``: the file viewed as float32 (f_buffer) and
  as uint8 (u_buffer), 32 bytes = 8 floats per gaussian; position f[0:3], scale f[3:6],
  rgba u[24:28] / 255, quaternion (w, x, y, z) = (u[28:32] - 128) / 128.
- .spz: nianticlabs/spz load-spz.cc (legacy gzip path, versions 1-3): 16-byte header, then
  positions (24-bit fixed point), alphas, colors, scales, rotations, sh; ``unpackGaussians``,
  ``unpackQuaternionSmallestThree`` (v3) and ``unpackQuaternionFirstThree`` (v2). Version 4 (the
  NGSP container): a plain 32-byte header (numStreams at byte 15, tocByteOffset at 16), extension
  records up to tocByteOffset, a TOC of (compressed, uncompressed) uint64 pairs, then one ZSTD
  frame per array in the same order; the arrays are read as in version 3.
- .glb: the glTF 2.0 specification's binary container (12-byte header "glTF", version 2, length;
  a JSON chunk and a BIN chunk, each an 8-byte length/type header) and its accessors (bufferView,
  byteOffset, componentType, type, normalized, byteStride), each attribute of the mesh's first
  primitive read as the specification defines it.
"""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path
from typing import Dict

import numpy as np
import zstandard

SPZ_MAGIC = 0x5053474E


def read_splat(path: Path) -> Dict[str, np.ndarray]:
    data = Path(path).read_bytes()
    assert len(data) % 32 == 0, f"{path}: {len(data)} bytes is not a whole number of 32-byte gaussians"
    f = np.frombuffer(data, dtype="<f4").reshape(-1, 8)
    u = np.frombuffer(data, dtype=np.uint8).reshape(-1, 32)
    return {
        "means": f[:, 0:3].copy(),  # [N, 3]
        "scales": f[:, 3:6].copy(),  # [N, 3] activated
        "rgba": u[:, 24:28].astype(np.float32) / 255,  # [N, 4]
        "quats": (u[:, 28:32].astype(np.float32) - 128) / 128,  # [N, 4] wxyz
    }


def _sh_dim(degree: int) -> int:
    return (degree + 1) ** 2 - 1


def read_spz(path: Path) -> Dict[str, np.ndarray]:
    """Header fields and decoded values; quats are returned as wxyz (the file stores xyzw)."""
    data = Path(path).read_bytes()
    container = {}
    if data[:2] == b"\x1f\x8b":  # versions 1-3: one gzip stream
        raw = gzip.decompress(data)
        magic, version, n, sh_degree, frac_bits, flags, reserved = struct.unpack_from("<IIIBBBB", raw, 0)
        start = 16
    else:  # version 4
        magic, version, n, sh_degree, frac_bits, flags, streams, toc = struct.unpack_from("<IIIBBBBI", data, 0)
        assert version == 4, f"version {version}"
        assert data[20:32] == bytes(12), "reserved header bytes are not zero"
        entries = [struct.unpack_from("<QQ", data, toc + 16 * i) for i in range(streams)]
        offset = toc + 16 * streams
        arrays = []
        for compressed, size in entries:
            arrays.append(zstandard.ZstdDecompressor().decompress(data[offset : offset + compressed], size))
            assert len(arrays[-1]) == size, "a stream decompresses to another size than its TOC entry"
            offset += compressed
        assert offset == len(data), f"{len(data) - offset} bytes after the last stream"
        raw, start, reserved = b"".join(arrays), 0, 0
        container = {"num_streams": streams, "toc_byte_offset": toc, "toc": entries}
    assert magic == SPZ_MAGIC, f"bad magic {magic:#x}"
    assert version in (2, 3, 4), f"version {version}"
    d = _sh_dim(sh_degree)
    rot_bytes = 4 if version >= 3 else 3
    sizes = [n * 9, n, n * 3, n * 3, n * rot_bytes, n * d * 3]
    assert len(raw) == start + sum(sizes), f"payload is {len(raw)} bytes, the header implies {start + sum(sizes)}"
    parts, offset = [], start
    for size in sizes:
        parts.append(np.frombuffer(raw, dtype=np.uint8, count=size, offset=offset))
        offset += size
    pos, alpha, color, scale, rot, sh = parts

    p = pos.reshape(n * 3, 3).astype(np.int32)
    fixed = p[:, 0] | (p[:, 1] << 8) | (p[:, 2] << 16)
    fixed = np.where(fixed & 0x800000, fixed - (1 << 24), fixed)  # sign extension
    means = (fixed.astype(np.float32) / (1 << frac_bits)).reshape(n, 3)

    if version >= 3:
        r = rot.reshape(n, 4).astype(np.uint32)
        comp = r[:, 0] | (r[:, 1] << 8) | (r[:, 2] << 16) | (r[:, 3] << 24)
        largest = comp >> 30
        xyzw = np.zeros((n, 4), np.float32)
        for i in range(3, -1, -1):  # the last stored component sits in the low bits
            use = largest != i
            mag = comp & 511
            neg = (comp >> 9) & 1
            value = np.sqrt(0.5) * mag.astype(np.float32) / 511
            xyzw[:, i] = np.where(use, np.where(neg == 1, -value, value), 0)
            comp = np.where(use, comp >> 10, comp)
        rest = (xyzw**2).sum(axis=1)
        xyzw[np.arange(n), largest] = np.sqrt(np.maximum(0, 1 - rest))
    else:
        xyz = rot.reshape(n, 3).astype(np.float32) / 127.5 - 1
        xyzw = np.concatenate([xyz, np.sqrt(np.maximum(0, 1 - (xyz**2).sum(1)))[:, None]], axis=1)

    with np.errstate(divide="ignore"):
        a = alpha.astype(np.float32) / 255
        logits = np.log(a / (1 - a))
    return {
        **container,
        "version": version,
        "num_points": n,
        "sh_degree": sh_degree,
        "fractional_bits": frac_bits,
        "flags": flags,
        "reserved": reserved,
        "means": means,  # [N, 3]
        "log_scales": (scale.reshape(n, 3).astype(np.float32) / 16 - 10),  # [N, 3]
        "quats": np.roll(xyzw, 1, axis=1),  # [N, 4] wxyz
        "opacity_logits": logits,  # [N]
        "sh_dc": ((color.reshape(n, 3).astype(np.float32) / 255) - 0.5) / 0.15,  # [N, 3]
        "sh_rest": (sh.reshape(n, d, 3).astype(np.float32) - 128) / 128,  # [N, D, 3] coefficient-major
    }


GLB_COMPONENTS = {5120: "i1", 5121: "u1", 5122: "<i2", 5123: "<u2", 5125: "<u4", 5126: "<f4"}
GLB_TYPES = {"SCALAR": 1, "VEC2": 2, "VEC3": 3, "VEC4": 4, "MAT4": 16}


def read_glb(path: Path) -> Dict:
    """{"json": the glTF JSON, "attributes": {semantic: float32 [N, k] (normalized integers scaled to
    0..1 / -1..1 as the specification does)}} of the first mesh's first primitive."""
    data = Path(path).read_bytes()
    magic, version, length = struct.unpack_from("<III", data, 0)
    assert magic == 0x46546C67 and version == 2, f"not a GLB version 2 (magic {magic:#x}, version {version})"
    assert length == len(data), f"header says {length} bytes, the file has {len(data)}"
    json_length, json_type = struct.unpack_from("<II", data, 12)
    assert json_type == 0x4E4F534A and json_length % 4 == 0, "the first chunk is not a padded JSON chunk"
    gltf = json.loads(data[20 : 20 + json_length])
    bin_length, bin_type = struct.unpack_from("<II", data, 20 + json_length)
    assert bin_type == 0x004E4942, "the second chunk is not BIN"
    binary = data[28 + json_length : 28 + json_length + bin_length]
    assert 28 + json_length + bin_length == len(data), "bytes after the BIN chunk"
    assert gltf["buffers"][0]["byteLength"] <= bin_length

    def accessor(index: int) -> np.ndarray:
        a = gltf["accessors"][index]
        view = gltf["bufferViews"][a["bufferView"]]
        dtype = np.dtype(GLB_COMPONENTS[a["componentType"]])
        k = GLB_TYPES[a["type"]]
        stride = view.get("byteStride", dtype.itemsize * k)
        start = view.get("byteOffset", 0) + a.get("byteOffset", 0)
        assert start % dtype.itemsize == 0, "a misaligned accessor"
        rows = np.ndarray((a["count"], k), dtype, binary, start, (stride, dtype.itemsize))
        assert start + stride * (a["count"] - 1) + dtype.itemsize * k <= view.get("byteOffset", 0) + view["byteLength"]
        values = rows.astype(np.float32)
        if a.get("normalized"):
            info = np.iinfo(dtype)
            values = np.maximum(values / info.max, -1.0) if info.min < 0 else values / info.max
        return values

    primitive = gltf["meshes"][0]["primitives"][0]
    return {"json": gltf, "attributes": {name: accessor(i) for name, i in primitive["attributes"].items()}}
