"""Weight messages: a small JSON header plus raw tensor bytes, chunked and checksummed. Never pickled.

Pure (numpy + stdlib; torch never required). Transports move bytes; this module alone says what they mean.
Header wire form: b"TOPSDW1\\0" (magic), u32 n (JSON length), u32 crc32(JSON) (header checksum), all
little-endian, then n bytes of UTF-8 JSON::

    {"magic": "TOPSDW1", "format": 1, "version": 7, "checksum": "crc32", "align": 64,
     "total_bytes": T, "chunk_size": C, "num_chunks": ceil(T / C), "chunk_crc32": [one per chunk],
     "tensors": [{"name", "dtype", "shape", "offset", "nbytes", "crc32"}, ...]}

A header may also carry the layout alone: ``"checksum": "none"``, ``"chunk_crc32": []`` and every tensor's
``"crc32": 0``. Such a header proves nothing about the bytes, so it is only good for a payload that cannot
differ from what the publisher wrote (a memfd sealed against writes after the copy): the publisher announces
that first and, when a subscriber needs them, the same version with checksums (`add_checksums` over the copy).
WeightAssembler refuses to verify chunks or a buffer against it unless told the buffer is trusted.

Payload: T bytes. Tensor i occupies [offset, offset + nbytes), offsets ascending and 64-byte aligned (zero
padding between), so decoded arrays are aligned views. Chunk k is payload[k*C : (k+1)*C] (the last may be
shorter); a tensor may span chunks. dtype is a numpy name or "bfloat16" (2 raw bytes each).

Checksums cost one pass: the payload is cut at every chunk and tensor boundary into pieces, each hashed once
(zlib.crc32); chunk and tensor checksums are folded from those (crc32_combine, no second pass). That pass
runs while copying (`encode_weights`) or later over the copy (`encode_weights(checksums=False)`, then
`add_checksums`).

Usage::

    header, chunks = encode_weights(model.state_dict(), version=7, chunk_bytes=4 << 20)
    asm = WeightAssembler(header)
    for c in chunks:
        asm.add_chunk(c)              # length and checksum checked per chunk
    arrays = asm.finish()             # name -> np.ndarray (views of one buffer), every tensor verified
"""

from __future__ import annotations

import itertools
import json
import math
import struct
import sys
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

MAGIC = b"TOPSDW1\0"
FORMAT = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sII")  # magic, JSON length, crc32(JSON)
# dtype name -> the numpy dtype its bytes decode to (numpy has no bfloat16: its raw bits come back as uint16)
_NUMPY_NAMES = "bool int8 uint8 int16 uint16 int32 uint32 int64 uint64 float16 float32 float64"
DTYPES: dict[str, np.dtype] = {n: np.dtype(n).newbyteorder("<") for n in _NUMPY_NAMES.split()}
DTYPES["bfloat16"] = np.dtype("<u2")
MapFn = Callable[[Callable[[Any], Any], Iterable[Any]], Iterable[Any]]


class WeightMessageError(ValueError):
    """A weight message is malformed, truncated, incomplete or corrupted (the message says which part)."""


# ---- crc32_combine (zlib's multmodp/x2nmodp, reflected CRC-32 polynomial) --------------------------------
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) mod p for k = 0..31, starting from x^1
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


@lru_cache(maxsize=8192)  # piece lengths repeat (chunk size, same-shaped layers): most folds are one multmodp
def _x8nmodp(nbytes: int) -> int:
    p, k = 1 << 31, 3  # x^0; x^(8 * nbytes) = x^(nbytes * 2^3)
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_X2N[k & 31], p)
        nbytes >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32(a + b) from crc32(a), crc32(b) and len(b), without touching the bytes."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


# ---- header ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class WeightHeader:
    version: int
    tensors: tuple[TensorSpec, ...]
    total_bytes: int
    chunk_size: int
    chunk_crc32: tuple[int, ...]
    checksum: str = "crc32"  # or "none": the layout alone (no chunk checksums, every tensor crc32 0)

    @property
    def has_checksums(self) -> bool:
        return self.checksum == "crc32"

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.total_bytes / self.chunk_size)

    def chunk_range(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.total_bytes)

    def to_bytes(self) -> bytes:
        doc = {
            "magic": "TOPSDW1", "format": FORMAT, "version": self.version, "checksum": self.checksum,
            "align": ALIGN, "total_bytes": self.total_bytes, "chunk_size": self.chunk_size,
            "num_chunks": self.num_chunks, "chunk_crc32": list(self.chunk_crc32),
            "tensors": [asdict(t) for t in self.tensors],  # name, dtype, shape, offset, nbytes, crc32
        }  # fmt: skip
        body = json.dumps(doc, separators=(",", ":")).encode()
        return _PREFIX.pack(MAGIC, len(body), zlib.crc32(body)) + body

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> WeightHeader:
        data = bytes(data)
        if len(data) < _PREFIX.size:
            raise WeightMessageError(f"header truncated: {len(data)} bytes, its prefix alone is 16")
        magic, n, crc = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise WeightMessageError(f"bad magic {magic!r}, expected {MAGIC!r}")
        body = data[_PREFIX.size :]
        if len(body) != n:
            raise WeightMessageError(f"header JSON is {len(body)} bytes, its prefix says {n} (truncated?)")
        if zlib.crc32(body) != crc:
            raise WeightMessageError(f"header checksum mismatch: crc32 {zlib.crc32(body)}, prefix says {crc}")
        try:
            doc = json.loads(body.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightMessageError(f"header is not UTF-8 JSON: {e}") from e
        return _header_from_doc(doc)


def _field(doc: Mapping[str, Any], key: str, kind: type, where: str = "header") -> Any:
    value = doc.get(key) if isinstance(doc, Mapping) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WeightMessageError(f"{where}: field {key!r} missing or not {kind.__name__} (got {value!r:.60})")
    return value


def _header_from_doc(doc: Any) -> WeightHeader:
    if not isinstance(doc, dict) or doc.get("magic") != "TOPSDW1":
        raise WeightMessageError("header JSON: 'magic' is not 'TOPSDW1'")
    checksum = doc.get("checksum")
    if doc.get("format") != FORMAT or checksum not in ("crc32", "none"):
        raise WeightMessageError(f"unsupported format {doc.get('format')!r}/{checksum!r}")
    version, total = _field(doc, "version", int), _field(doc, "total_bytes", int)
    chunk, crcs = _field(doc, "chunk_size", int), _field(doc, "chunk_crc32", list)
    if version < 0 or total < 0 or chunk <= 0:
        raise WeightMessageError(f"header: version {version}, total {total}, chunk_size {chunk} invalid")
    n = math.ceil(total / chunk)
    if _field(doc, "num_chunks", int) != n or len(crcs) != (n if checksum == "crc32" else 0):
        raise WeightMessageError(f"header: num_chunks/chunk_crc32 disagree with ceil({total} / {chunk})")
    if not all(isinstance(c, int) and 0 <= c < 2**32 for c in crcs):
        raise WeightMessageError("header: chunk_crc32 holds a value that is not a u32")
    specs = tuple(_spec_from_doc(t, i) for i, t in enumerate(_field(doc, "tensors", list)))
    if checksum == "none" and any(t.crc32 for t in specs):
        raise WeightMessageError("header: checksum 'none' but a tensor carries a crc32")
    _check_layout(specs, total)
    return WeightHeader(version, specs, total, chunk, tuple(crcs), checksum)


def _spec_from_doc(t: Any, i: int) -> TensorSpec:
    where = f"tensor #{i}"
    name, dtype = _field(t, "name", str, where), _field(t, "dtype", str, where)
    shape = _field(t, "shape", list, where)
    offset, nbytes, crc = (_field(t, k, int, f"{where} {name!r}") for k in ("offset", "nbytes", "crc32"))
    if dtype not in DTYPES:
        raise WeightMessageError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise WeightMessageError(f"tensor {name!r}: bad shape {shape!r}")
    if nbytes != math.prod(shape) * DTYPES[dtype].itemsize:
        raise WeightMessageError(f"tensor {name!r}: nbytes {nbytes} != prod({shape}) * itemsize of {dtype}")
    return TensorSpec(name, dtype, tuple(shape), offset, nbytes, crc)


def _check_layout(specs: tuple[TensorSpec, ...], total: int) -> None:
    seen: set[str] = set()
    end = 0
    for t in specs:
        if not t.name or t.name in seen:
            raise WeightMessageError(f"duplicate or empty tensor name {t.name!r}")
        seen.add(t.name)
        if t.offset < end or t.end > total:
            raise WeightMessageError(f"tensor {t.name!r}: [{t.offset}, {t.end}) overlaps or passes {total}")
        end = t.end


# ---- pieces: the payload cut at every chunk and tensor boundary -------------------------------------------
Piece = tuple[int, int, int, int]  # start, end, chunk index, tensor index (-1: padding)


def _pieces(specs: tuple[TensorSpec, ...], total: int, chunk: int) -> list[Piece]:
    bounds = set(range(0, total, chunk)) | {total}
    for t in specs:
        bounds.update((t.offset, t.end))
    cuts = sorted(bounds)
    out: list[Piece] = []
    ti = 0
    for a, b in itertools.pairwise(cuts):
        while ti < len(specs) and specs[ti].end <= a:
            ti += 1
        owner = ti if ti < len(specs) and specs[ti].offset <= a else -1
        out.append((a, b, a // chunk, owner))
    return out


def _fold(pieces: list[Piece], crcs: list[int], key: int, n: int) -> list[int]:
    """Checksum of each group (key 2: chunks, 3: tensors) from its pieces' checksums, in payload order."""
    out = [0] * n  # crc32 of no bytes; combine(0, c, len) == c
    for p, c in zip(pieces, crcs, strict=True):
        if p[key] >= 0:
            out[p[key]] = crc32_combine(out[p[key]], c, p[1] - p[0])
    return out


# ---- encode ---------------------------------------------------------------------------------------------
def _as_numpy(x: Any) -> tuple[np.ndarray, str]:
    """Array or tensor -> (little-endian contiguous numpy array, dtype name). torch is duck-typed."""
    if type(x).__module__.split(".")[0] == "torch":  # a torch.Tensor: torch is imported already
        t = x.detach().cpu()  # no-op on CPU tensors
        name = str(t.dtype).removeprefix("torch.")
        if name == "bfloat16":  # numpy cannot hold bf16: carry its bits
            t = t.view(sys.modules["torch"].int16)
        arr = t.contiguous().numpy()
    else:
        arr = np.asarray(x)
        name = arr.dtype.name  # "bfloat16" too, for ml_dtypes arrays
    if name not in DTYPES:
        raise TypeError(f"unsupported dtype {name!r} (supported: {sorted(DTYPES)})")
    # Little-endian and C-contiguous, copying only if needed (ascontiguousarray would make 0-d arrays 1-d).
    return arr.astype(arr.dtype.newbyteorder("<"), order="C", copy=False), name


def encode_weights(
    named: Mapping[str, Any],
    version: int,
    chunk_bytes: int = 4 << 20,
    *,
    sink: Callable[[int], Any] | None = None,
    map_fn: MapFn = map,
    checksums: bool = True,
) -> tuple[bytes, list[memoryview]]:
    """-> (header bytes, chunks). A chunk inside one tensor is a memoryview of the caller's memory (no copy);
    one that straddles tensors is a small copy. `sink(total_bytes)` may return a writable buffer: the payload
    is copied into it while it is hashed (one cache-hot pass) and the chunks view it. `map_fn` (a thread
    pool's map) spreads the pieces over threads; zlib and numpy copies release the GIL. `checksums=False`
    only lays out (and copies): the header has checksum "none" (see the module docstring; `add_checksums`).
    """
    if not named:
        raise ValueError("encode_weights: no tensors")
    if chunk_bytes <= 0 or not isinstance(version, int) or version < 0:
        raise ValueError(f"encode_weights: bad chunk_bytes {chunk_bytes} or version {version!r}")
    specs, flats, end = [], [], 0
    for name, value in named.items():
        arr, dtype = _as_numpy(value)
        offset = -(-end // ALIGN) * ALIGN
        specs.append(TensorSpec(str(name), dtype, tuple(arr.shape), offset, arr.nbytes))
        flats.append(arr.reshape(-1).view(np.uint8))
        end = offset + arr.nbytes
    total, specs_t = end, tuple(specs)
    _check_layout(specs_t, total)
    pieces = _pieces(specs_t, total, chunk_bytes)
    out = None if sink is None else np.frombuffer(sink(total), np.uint8, count=total)

    def copy_and_hash(p: Piece) -> int:
        src = _piece_bytes(p, specs_t, flats)
        if out is not None:
            np.copyto(out[p[0] : p[1]], src)
            src = out[p[0] : p[1]]  # hash the copy (cache-hot): the checksums describe the sink
        return zlib.crc32(src) if checksums else 0  # type: ignore[arg-type]  # numpy arrays are buffers

    crcs = list(map_fn(copy_and_hash, pieces)) if out is not None or checksums else []
    num_chunks = math.ceil(total / chunk_bytes)
    header = WeightHeader(version, specs_t, total, chunk_bytes, (), "none")
    if checksums:
        header = _with_checksums(header, pieces, crcs)
    if out is not None:
        return header.to_bytes(), [memoryview(out[slice(*header.chunk_range(k))]) for k in range(num_chunks)]  # type: ignore[arg-type]  # numpy arrays are buffers
    chunks = []
    for _, group in itertools.groupby(pieces, key=lambda p: p[2]):
        parts = [_piece_bytes(q, specs_t, flats) for q in group]
        chunks.append(memoryview(parts[0] if len(parts) == 1 else np.concatenate(parts)))  # type: ignore[arg-type]  # numpy arrays are buffers
    return header.to_bytes(), chunks


def _with_checksums(header: WeightHeader, pieces: list[Piece], crcs: list[int]) -> WeightHeader:
    tcrcs = _fold(pieces, crcs, 3, len(header.tensors))
    specs = tuple(replace(t, crc32=c) for t, c in zip(header.tensors, tcrcs, strict=True))
    chunk_crcs = tuple(_fold(pieces, crcs, 2, header.num_chunks))
    return replace(header, tensors=specs, chunk_crc32=chunk_crcs, checksum="crc32")


def add_checksums(
    header: WeightHeader | bytes | memoryview, payload: Any, map_fn: MapFn = map
) -> WeightHeader:
    """The same header with the checksums of `payload` (≥ total_bytes, read in place, one pass). For a header
    written with `checksums=False` once its payload can no longer change (a sealed memfd)."""
    h = header if isinstance(header, WeightHeader) else WeightHeader.from_bytes(header)
    size = memoryview(payload).nbytes
    if size < h.total_bytes:
        raise WeightMessageError(f"v{h.version}: payload truncated: {size} of {h.total_bytes} bytes")
    buf = np.frombuffer(payload, np.uint8, count=h.total_bytes)
    pieces = _pieces(h.tensors, h.total_bytes, h.chunk_size)
    crcs = list(map_fn(lambda p: zlib.crc32(buf[p[0] : p[1]]), pieces))  # type: ignore[arg-type]  # numpy arrays are buffers
    return _with_checksums(h, pieces, crcs)


def _piece_bytes(p: Piece, specs: tuple[TensorSpec, ...], flats: list[np.ndarray]) -> np.ndarray:
    a, b, _, owner = p
    if owner < 0:
        return np.zeros(b - a, np.uint8)  # alignment padding
    off = specs[owner].offset
    return flats[owner][a - off : b - off]


# ---- decode ---------------------------------------------------------------------------------------------
class WeightAssembler:
    """Collects one message's chunks (in order, or by index), checks each on arrival, verifies every tensor
    in `finish`; any defect raises WeightMessageError naming the chunk or tensor. `buffer` (≥ total_bytes):
    where the payload lives; when it already holds it (mapped shared memory), `verify_buffer()` checks it in
    place and `finish` returns views of it. A header without checksums admits only
    `verify_buffer(trusted=True)`.
    """

    def __init__(self, header: WeightHeader | bytes | memoryview, buffer: Any = None) -> None:
        self.header = header if isinstance(header, WeightHeader) else WeightHeader.from_bytes(header)
        h = self.header
        if buffer is None:
            raw = np.empty(h.total_bytes + ALIGN, np.uint8)  # aligned start, so tensors are aligned too
            self._buf = raw[-raw.ctypes.data % ALIGN :][: h.total_bytes]
        else:
            size = memoryview(buffer).nbytes
            if size < h.total_bytes:
                raise WeightMessageError(f"v{h.version}: payload truncated: {size} of {h.total_bytes} bytes")
            self._buf = np.frombuffer(buffer, np.uint8, count=h.total_bytes)
        self._pieces = _pieces(h.tensors, h.total_bytes, h.chunk_size)
        self._piece_crc = [0] * len(self._pieces)
        by_chunk = itertools.groupby(range(len(self._pieces)), lambda i: self._pieces[i][2])
        self._by_chunk = [list(g) for _, g in by_chunk]  # piece indices of each chunk
        self._have, self._next, self._trusted = [False] * h.num_chunks, 0, False

    @property
    def missing(self) -> list[int]:
        return [i for i, have in enumerate(self._have) if not have]

    @property
    def complete(self) -> bool:
        return all(self._have)

    def add_chunk(self, data: Any, index: int | None = None) -> None:
        """Copy chunk `index` (default: the one after the last added) into place and check it."""
        h = self.header
        i = self._next if index is None else index
        if not 0 <= i < h.num_chunks:
            raise WeightMessageError(f"v{h.version}: chunk index {i} outside [0, {h.num_chunks})")
        if self._have[i]:
            raise WeightMessageError(f"v{h.version}: chunk {i} received twice")
        self._need_checksums(f"chunk {i}")
        a, b = h.chunk_range(i)
        view = np.frombuffer(data, np.uint8)
        if view.size != b - a:
            raise WeightMessageError(f"v{h.version}: chunk {i} has {view.size} bytes, expected {b - a}")
        self._buf[a:b] = view
        self._check_chunk(i)
        self._have[i], self._next = True, i + 1

    def verify_buffer(self, map_fn: MapFn = map, trusted: bool = False) -> None:
        """Check, in place, every chunk not added yet (the buffer already holds the payload). `trusted` skips
        hashing, for bytes that cannot differ from the ones the publisher wrote (a memfd sealed after it)."""
        todo = self.missing
        if not trusted:
            self._need_checksums("the payload")
            list(map_fn(self._check_chunk, todo))  # raises on the first bad chunk
        for i in todo:
            self._have[i] = True
        self._trusted = trusted

    def _need_checksums(self, what: str) -> None:
        if not self.header.has_checksums:
            raise WeightMessageError(
                f"v{self.header.version}: header has no checksums, {what} cannot be verified"
            )

    def _check_chunk(self, i: int) -> None:
        h = self.header
        idx = self._by_chunk[i]
        for j in idx:
            a, b = self._pieces[j][:2]
            self._piece_crc[j] = zlib.crc32(self._buf[a:b])  # type: ignore[arg-type]  # numpy arrays are buffers
        got = 0
        for j in idx:
            got = crc32_combine(got, self._piece_crc[j], self._pieces[j][1] - self._pieces[j][0])
        if got != (want := h.chunk_crc32[i]):
            raise WeightMessageError(
                f"v{h.version}: chunk {i} {h.chunk_range(i)} checksum mismatch {got}!={want}"
            )

    def finish(self, bfloat16: str = "uint16") -> dict[str, Any]:
        """name -> array (views of the payload) once every chunk is in and every tensor verifies. bfloat16
        comes back as raw bits (uint16), or as torch.bfloat16 tensors with `bfloat16="torch"` (zero-copy)."""
        h = self.header
        if not self.complete:
            miss = self.missing
            raise WeightMessageError(f"v{h.version}: incomplete, missing chunks {miss[:8]} of {h.num_chunks}")
        # Trusted: nothing was hashed, so there is nothing to fold (and no checksum to compare).
        crcs = (
            [t.crc32 for t in h.tensors]
            if self._trusted
            else _fold(self._pieces, self._piece_crc, 3, len(h.tensors))
        )
        out: dict[str, Any] = {}
        for t, got in zip(h.tensors, crcs, strict=True):
            if got != t.crc32:
                raise WeightMessageError(f"v{h.version}: tensor {t.name!r} checksum mismatch: {got}")
            arr = self._buf[t.offset : t.end].view(DTYPES[t.dtype]).reshape(t.shape)
            if t.dtype == "bfloat16" and bfloat16 == "torch":
                import torch  # only a caller that asks for torch tensors pays for the import

                arr = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)  # type: ignore[assignment]
            out[t.name] = arr
        return out
