""".spz: Niantic's compressed gaussian splat format (github.com/nianticlabs/spz), version 3 (default)
or 4 (``--spz-version 4``).

Written here from the format's README and its reference packer (src/cc/load-spz.cc
``packGaussians``/``serializePackedGaussians``, with its float32 arithmetic and rounding); no PyPI
package was sound to depend on (the ``spz`` name is a one-release Rust source package, ``alspz``
a one-release C++ source build, ``gsply`` pulls numba and clamps positions silently).

Version 3 is the gzip container every spz reader loads (Niantic's current library reads 1-3 as
"legacy" and writes 4, a zstd container older readers do not know). The whole file is one gzip
stream of, little-endian:

    header (16 bytes)  uint32 magic 0x5053474e ("NGSP"), uint32 version 3, uint32 numPoints,
                       uint8 shDegree, uint8 fractionalBits, uint8 flags (0x1: antialiased), uint8 0
    positions  N*9     x, y, z as 24-bit signed fixed point, round(p * 2^fractionalBits)
    alphas     N       round(sigmoid(opacity) * 255)
    colors     N*3     round(dc * 0.15 * 255 + 127.5): the DC SH coefficient, range about [-3.3, 3.3]
    scales     N*3     round((log scale + 10) * 16): log scales in [-10, 5.94]
    rotations  N*4     "smallest three": the unit quaternion (x, y, z, w order), sign chosen so the
                       largest |component| is positive; its index in the top 2 bits of a uint32, then
                       the other three in order, each a sign bit and 9 bits of |c| / sqrt(1/2)
    sh         N*D*3   bands 1.. of SH, coefficient-major with the colour channel inner (our
                       features_rest [N, D, 3] as is), each round(c * 128) + 128 snapped to buckets:
                       5 significant bits for band 1, 4 for higher bands (Niantic's defaults; the
                       reader needs no bit counts), range [-1, 1]

Rounding is half away from zero and every byte is clamped to 0..255, as in the reference packer.
Coordinates are stored as the run has them, without axis conversion (Niantic's ply_to_spz does the
same with its default "unspecified" coordinate system).

Version 4 (Niantic's current writer's default; Spark 2.2 and other gzip-only readers cannot open it)
holds the same six arrays, each its own ZSTD frame, compressed in parallel, after a plain header:

    header (32 bytes)  uint32 magic, uint32 version 4, uint32 numPoints, uint8 shDegree,
                       uint8 fractionalBits, uint8 flags (0x1: antialiased, 0x2: extension records
                       follow the header; none are written here), uint8 numStreams (5, 6 with SH),
                       uint32 tocByteOffset (32: no extension records), 12 bytes 0
    TOC                numStreams x (uint64 compressed size, uint64 uncompressed size)
    streams            the ZSTD frames in the arrays' order, back to back
"""

from __future__ import annotations

import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict

import numpy as np

from .gaussians import ExportGaussians

MAGIC = 0x5053474E
VERSION = 3  # the default: the version every reader opens
VERSIONS = (3, 4)
FLAG_ANTIALIASED = 0x1
FLAG_EXTENSIONS = 0x2  # version 4: extension records between the header and the TOC
FRACTIONAL_BITS = 12  # Niantic's packer always uses 12; fewer only when positions need the range
COLOR_SCALE = 0.15
SH1_BITS, SH_REST_BITS = 5, 4
HEADER = struct.Struct("<IIIBBBB")
HEADER_V4 = struct.Struct("<IIIBBBBI12x")  # ... numStreams, tocByteOffset, reserved
TOC_ENTRY = struct.Struct("<QQ")
ZSTD_LEVEL = 12  # Niantic's writer's level (the same frames from the same arrays)
GZIP_LEVEL = 6  # zlib's default, as the reference packer
GZIP_BLOCK = 1 << 22  # bytes deflated per task
BLOCK = 1 << 16  # rows of SH packed at a time
WINDOW = 1 << 15  # deflate's window: each block is primed with the 32 KiB before it
_F = np.float32


def _round(x: np.ndarray) -> np.ndarray:
    """std::round of float32 values (half away from zero), exactly (done in float64)."""
    x = x.astype(np.float64)
    return np.trunc(x + np.copysign(0.5, x))


def _to_u8(x: np.ndarray, clamped: Dict[str, int], name: str) -> np.ndarray:
    r = _round(x)
    clamped[name] = clamped.get(name, 0) + int(((r < 0) | (r > 255)).sum())
    return np.clip(r, 0, 255).astype(np.uint8)


def fractional_bits_for(means: np.ndarray) -> int:  # means [N, 3]
    """12, or fewer when a coordinate would not fit in 24 bits at 12."""
    largest = float(np.abs(means).max(initial=0.0))
    for bits in range(FRACTIONAL_BITS, -1, -1):
        if _round(np.array([largest * (1 << bits)], np.float32))[0] <= (1 << 23) - 1:
            return bits
    raise ValueError(f"[spz] positions up to {largest:.3g} do not fit the format's 24-bit fixed point")


def _pack_quats(quats_wxyz: np.ndarray) -> np.ndarray:  # [N, 4] -> [N, 4] uint8
    q = np.roll(quats_wxyz.astype(_F), -1, axis=1)  # xyzw
    norm = np.sqrt((q * q).sum(axis=1, dtype=_F), dtype=_F)[:, None]
    identity = np.array([0, 0, 0, 1], _F)
    q = np.where(norm > 0, q / np.where(norm > 0, norm, _F(1)), identity)  # a zero quaternion: identity
    largest = np.argmax(np.abs(q), axis=1)  # first of equals, as the reference's strict '>'
    negate = np.take_along_axis(q, largest[:, None], axis=1)[:, 0] < 0
    comp = largest.astype(np.uint32)
    for i in range(4):
        mag = np.minimum((_F(511) * (np.abs(q[:, i]) / _F(np.sqrt(0.5))) + _F(0.5)).astype(np.uint32), 511)
        negbit = ((q[:, i] < 0) ^ negate).astype(np.uint32)
        comp = np.where(largest != i, (comp << np.uint32(10)) | (negbit << np.uint32(9)) | mag, comp)
    return comp.astype("<u4").view(np.uint8).reshape(-1, 4)


def _pack_sh(sh_rest: np.ndarray, clamped: Dict[str, int]) -> np.ndarray:  # [N, D, 3] -> [N*D*3] uint8
    """round(c * 128) + 128 snapped to its band's bucket, clamped to 0..255. In float32, exactly:
    c * 128 and the bucket arithmetic (powers of two, integers below 2^24) are exact, and adding 0.5
    is exact below 2^23, beyond which the value is clamped whatever the rounding. Blocks of rows on
    every core (numpy releases the GIL)."""
    bucket = np.full(sh_rest.shape[1], 1 << (8 - SH_REST_BITS), np.float32)
    bucket[:3] = 1 << (8 - SH1_BITS)  # band 1: coefficients 0..2
    bucket = bucket[None, :, None]
    half, inverse = bucket / 2, 1 / bucket
    out = np.empty(sh_rest.shape, np.uint8)

    def block(s: int) -> int:
        x = sh_rest[s : s + BLOCK].astype(_F) * _F(128)  # [B, D, 3]
        q = np.trunc(x + np.copysign(_F(0.5), x)) + _F(128)
        q = np.floor((q + half) * inverse) * bucket
        out[s : s + BLOCK] = np.clip(q, 0, 255)
        return int(np.count_nonzero((q < 0) | (q > 255)))

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        clamped["sh"] = sum(pool.map(block, range(0, len(sh_rest), BLOCK)))
    return out.reshape(-1)


@dataclass
class SpzEncoding:
    data: bytes  # the .spz file
    fractional_bits: int
    payload_bytes: int  # size before gzip / ZSTD
    clamped: Dict[str, int] = field(default_factory=dict)  # values outside a field's range, per field


def gzip_blocks(payload: bytes) -> bytes:
    """One gzip member of ``payload``, deflated in 4 MiB blocks on every core, as pigz does: each
    block primed with the 32 KiB before it (so matches reach back across blocks as in one stream)
    and ended with a sync flush, the last with the final block. Any gzip reader reads it as one
    stream; the bytes do not depend on the number of cores; within 0.1% of gzip.compress's size."""
    view = memoryview(payload)
    starts = range(0, max(len(payload), 1), GZIP_BLOCK)

    def deflate(start: int) -> bytes:
        dictionary = bytes(view[max(0, start - WINDOW) : start])
        z = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, -15, **({"zdict": dictionary} if dictionary else {}))
        last = start + GZIP_BLOCK >= len(payload)
        return z.compress(view[start : start + GZIP_BLOCK]) + z.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # zlib releases the GIL
        body = b"".join(pool.map(deflate, starts))
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # gzip, deflate, no flags, mtime 0, unknown OS
    return header + body + struct.pack("<II", zlib.crc32(payload), len(payload) & 0xFFFFFFFF)


def zstd_streams(header: bytes, arrays) -> bytes:
    """Version 4's container: ``header`` (32 bytes), the TOC, then one ZSTD frame per array,
    compressed on every core (zstandard releases the GIL)."""
    import zstandard

    def compress(array: bytes) -> bytes:
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(array)

    with ThreadPoolExecutor(max_workers=min(len(arrays), os.cpu_count() or 1)) as pool:
        frames = list(pool.map(compress, arrays))
    toc = b"".join(TOC_ENTRY.pack(len(f), len(a)) for f, a in zip(frames, arrays))
    return b"".join([header, toc, *frames])


def encode_spz(g: ExportGaussians, version: int = VERSION) -> SpzEncoding:
    n = g.count
    if version not in VERSIONS:
        raise ValueError(f"[spz] version must be one of {', '.join(map(str, VERSIONS))}, got {version}")
    if not 0 <= g.sh_degree <= 4:
        raise ValueError(f"[spz] SH degree must be 0..4, got {g.sh_degree}")
    if g.sh_rest.shape != (n, (g.sh_degree + 1) ** 2 - 1, 3):
        raise ValueError(f"[spz] sh_rest must be [N, {(g.sh_degree + 1) ** 2 - 1}, 3], got {g.sh_rest.shape}")
    clamped: Dict[str, int] = {}
    bits = fractional_bits_for(g.means)
    fixed = _round(g.means.astype(_F) * _F(1 << bits)).astype("<i4")  # [N, 3]
    positions = fixed.view(np.uint8).reshape(n, 3, 4)[:, :, :3]  # low 3 bytes: 24-bit two's complement
    alphas = _to_u8(_F(1) / (_F(1) + np.exp(-g.opacity_logits.astype(_F))) * _F(255), clamped, "alpha")
    colors = _to_u8(g.sh_dc.astype(_F) * _F(COLOR_SCALE * 255) + _F(0.5 * 255), clamped, "color")
    scales = _to_u8((g.log_scales.astype(_F) + _F(10)) * _F(16), clamped, "scale")
    flags = FLAG_ANTIALIASED if g.antialiased else 0
    arrays = [positions.tobytes(), alphas.tobytes(), colors.tobytes(), scales.tobytes(), _pack_quats(g.quats).tobytes()]
    if g.sh_degree > 0:
        arrays.append(_pack_sh(g.sh_rest, clamped).tobytes())
    payload_bytes = sum(map(len, arrays))
    if version == 3:
        data = gzip_blocks(b"".join([HEADER.pack(MAGIC, 3, n, g.sh_degree, bits, flags, 0), *arrays]))
    else:
        header = HEADER_V4.pack(MAGIC, 4, n, g.sh_degree, bits, flags, len(arrays), HEADER_V4.size)
        data = zstd_streams(header, arrays)
    return SpzEncoding(data, bits, payload_bytes, {k: v for k, v in clamped.items() if v})
