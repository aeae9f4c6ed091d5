"""Weight messages: a small JSON header plus raw tensor bytes, chunked and checksummed. Never pickled.

Pure (numpy + stdlib; torch never required). Transports move bytes; this module says what they mean. The
layout (header prefix, header JSON format 2, payload, chunks) is tabled in system/weight_wire.py.

Checksums: one zlib.crc32 per chunk, and nothing else: the chunks cover every byte of the payload, so a
message whose chunks all match is the one that was written. Chunks are hashed independently, over a thread
pool's `map` when one is given (zlib releases the GIL), either while the payload is copied (`encode_weights`:
each chunk hashed right after it is copied, cache-hot) or later (`encode_weights(checksums=False)`, then
`add_checksums`).

A header may carry the layout alone (``"checksum": "none"``, ``"chunk_crc32": []``). It proves nothing
about the bytes, so it is only good for a payload that cannot differ from what the publisher wrote (a memfd
sealed against writes after the copy): WeightAssembler refuses to verify chunks or a buffer against it unless
told the buffer is trusted.

Usage::

    header, chunks = encode_weights(model.state_dict(), version=7, chunk_bytes=4 << 20)
    asm = WeightAssembler(header)
    for c in chunks:
        asm.add_chunk(c)              # length and checksum checked per chunk
    arrays = asm.finish()             # name -> np.ndarray (views of one buffer), once every chunk is in
"""

from __future__ import annotations

import bisect
import json
import math
import sys
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from system.weight_wire import ALIGN, FORMAT, HEADER_PREFIX, MAGIC, MAGIC_JSON, NamedWeights

__all__ = ["DTYPES", "MAGIC", "NamedWeights", "TensorSpec", "WeightAssembler", "WeightHeader"]
__all__ += ["WeightMessageError", "add_checksums", "encode_weights"]

# dtype name -> the numpy dtype its bytes decode to (numpy has no bfloat16: its raw bits come back as uint16)
_NUMPY_NAMES = "bool int8 uint8 int16 uint16 int32 uint32 int64 uint64 float16 float32 float64"
DTYPES: dict[str, np.dtype] = {n: np.dtype(n).newbyteorder("<") for n in _NUMPY_NAMES.split()}
DTYPES["bfloat16"] = np.dtype("<u2")
MapFn = Callable[[Callable[[Any], Any], Iterable[Any]], Iterable[Any]]


class WeightMessageError(ValueError):
    """A weight message is malformed, truncated, incomplete or corrupted (the message says which part)."""


# ---- header ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

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
    checksum: str = "crc32"  # or "none": the layout alone (no chunk checksums)
    meta: dict[str, Any] = field(default_factory=dict, hash=False)  # what the tensors are ({}: full weights)

    @property
    def has_checksums(self) -> bool:
        return self.checksum == "crc32"

    @property
    def num_chunks(self) -> int:
        return -(-self.total_bytes // self.chunk_size)  # exact: a float quotient rounds past 2**53

    def chunk_range(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.total_bytes)

    def to_bytes(self) -> bytes:
        doc = {
            "magic": MAGIC_JSON,
            "format": FORMAT,
            "version": self.version,
            "checksum": self.checksum,
            "align": ALIGN,
            "total_bytes": self.total_bytes,
            "chunk_size": self.chunk_size,
            "num_chunks": self.num_chunks,
            "chunk_crc32": list(self.chunk_crc32),
            "tensors": [asdict(t) for t in self.tensors],  # name, dtype, shape, offset, nbytes
            **({"meta": self.meta} if self.meta else {}),
        }
        body = json.dumps(doc, separators=(",", ":")).encode()
        return HEADER_PREFIX.pack(MAGIC, len(body), zlib.crc32(body)) + body

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> WeightHeader:
        data = bytes(data)
        if len(data) < HEADER_PREFIX.size:
            raise WeightMessageError(f"header truncated: {len(data)} bytes, its prefix alone is 16")
        magic, n, crc = HEADER_PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise WeightMessageError(f"bad magic {magic!r}, expected {MAGIC!r}")
        body = data[HEADER_PREFIX.size :]
        if len(body) != n:
            raise WeightMessageError(f"header JSON is {len(body)} bytes, its prefix says {n} (truncated?)")
        if zlib.crc32(body) != crc:
            raise WeightMessageError(f"header checksum mismatch: crc32 {zlib.crc32(body)}, prefix says {crc}")
        try:
            doc = json.loads(body.decode())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # nested past the stack
            raise WeightMessageError(f"header is not UTF-8 JSON: {e}") from e
        return _header_from_doc(doc)


def _field(doc: Mapping[str, Any], key: str, kind: type, where: str = "header") -> Any:
    value = doc.get(key) if isinstance(doc, Mapping) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise WeightMessageError(f"{where}: field {key!r} missing or not {kind.__name__} (got {value!r:.60})")
    return value


def _header_from_doc(doc: Any) -> WeightHeader:
    if not isinstance(doc, dict) or doc.get("magic") != MAGIC_JSON:
        raise WeightMessageError(f"header JSON: 'magic' is not {MAGIC_JSON!r}")
    if (fmt := doc.get("format")) != FORMAT:
        raise WeightMessageError(
            f"header format {fmt!r} is not supported: this reader takes format {FORMAT} only (one crc32 per"
            " chunk; format 1 had per-tensor checksums): publisher and subscriber must run the same release"
        )
    if (checksum := doc.get("checksum")) not in ("crc32", "none"):
        raise WeightMessageError(f"header: unsupported checksum {checksum!r} (expected 'crc32' or 'none')")
    version, total = _field(doc, "version", int), _field(doc, "total_bytes", int)
    chunk, crcs = _field(doc, "chunk_size", int), _field(doc, "chunk_crc32", list)
    if not 0 <= version < 2**64 or total < 0 or chunk <= 0:  # the wire carries versions as u64 (META)
        raise WeightMessageError(f"header: version {version}, total {total}, chunk_size {chunk} invalid")
    n = -(-total // chunk)  # ceil, exact for any size
    if _field(doc, "num_chunks", int) != n or len(crcs) != (n if checksum == "crc32" else 0):
        raise WeightMessageError(f"header: num_chunks/chunk_crc32 disagree with ceil({total} / {chunk})")
    if not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 2**32 for c in crcs):
        raise WeightMessageError("header: chunk_crc32 holds a value that is not a u32")
    specs = tuple(_spec_from_doc(t, i) for i, t in enumerate(_field(doc, "tensors", list)))
    _check_layout(specs, total)
    meta = _field(doc, "meta", dict) if "meta" in doc else {}
    return WeightHeader(version, specs, total, chunk, tuple(crcs), checksum, meta)


def _spec_from_doc(t: Any, i: int) -> TensorSpec:
    where = f"tensor #{i}"
    name, dtype = _field(t, "name", str, where), _field(t, "dtype", str, where)
    shape = _field(t, "shape", list, where)
    offset, nbytes = (_field(t, k, int, f"{where} {name!r}") for k in ("offset", "nbytes"))
    if dtype not in DTYPES:
        raise WeightMessageError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise WeightMessageError(f"tensor {name!r}: bad shape {shape!r}")
    if nbytes != math.prod(shape) * DTYPES[dtype].itemsize:
        raise WeightMessageError(f"tensor {name!r}: nbytes {nbytes} != prod({shape}) * itemsize of {dtype}")
    return TensorSpec(name, dtype, tuple(shape), offset, nbytes)


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


class _Source:
    """The tensors to encode, laid out: which bytes of which tensor (or padding) make up [a, b)."""

    def __init__(self, named: Mapping[str, Any]) -> None:
        specs, self.flats, end = [], [], 0
        for name, value in named.items():
            arr, dtype = _as_numpy(value)
            offset = -(-end // ALIGN) * ALIGN
            specs.append(TensorSpec(str(name), dtype, tuple(arr.shape), offset, arr.nbytes))
            self.flats.append(arr.reshape(-1).view(np.uint8))
            end = offset + arr.nbytes
        self.specs, self.total = tuple(specs), end
        _check_layout(self.specs, self.total)
        self._starts = [t.offset for t in self.specs]

    def parts(self, a: int, b: int) -> list[tuple[int, int, np.ndarray | None]]:
        """[a, b) in order as (start, end, those bytes of one tensor, or None: zero padding)."""
        out: list[tuple[int, int, np.ndarray | None]] = []
        i, pos = max(0, bisect.bisect_right(self._starts, a) - 1), a
        while pos < b:
            while self.specs[i].end <= pos:  # passed, or empty (pos < total: some tensor ends after it)
                i += 1
            t = self.specs[i]
            if t.offset > pos:  # alignment padding before it
                out.append((pos, min(b, t.offset), None))
            else:
                end = min(b, t.end)
                out.append((pos, end, self.flats[i][pos - t.offset : end - t.offset]))
            pos = out[-1][1]
        return out

    def chunk(self, a: int, b: int) -> np.ndarray:
        """Bytes [a, b): a view of the tensor when one holds them all, else a small copy."""
        parts = self.parts(a, b)
        if len(parts) == 1 and parts[0][2] is not None:
            return parts[0][2]
        return np.concatenate([np.zeros(hi - lo, np.uint8) if x is None else x for lo, hi, x in parts])

    def copy_into(self, out: np.ndarray, a: int, b: int) -> None:
        for lo, hi, x in self.parts(a, b):
            out[lo:hi] = 0 if x is None else x


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
    is copied into it, each chunk hashed right after its copy (cache-hot), and the chunks view it. `map_fn` (a
    thread pool's map) spreads the chunks over threads; zlib and numpy copies release the GIL.
    `checksums=False` only lays out (and copies): the header has checksum "none" (see `add_checksums`). A
    NamedWeights' `meta` goes into the header."""
    if not named:
        raise ValueError("encode_weights: no tensors")
    if chunk_bytes <= 0 or not isinstance(version, int) or version < 0:
        raise ValueError(f"encode_weights: bad chunk_bytes {chunk_bytes} or version {version!r}")
    src = _Source(named)
    header = WeightHeader(version, src.specs, src.total, chunk_bytes, (), "none", getattr(named, "meta", {}))
    out = None if sink is None else np.frombuffer(sink(src.total), np.uint8, count=src.total)

    def one(k: int) -> tuple[np.ndarray, int]:
        a, b = header.chunk_range(k)
        if out is None:
            data = src.chunk(a, b)
        else:
            src.copy_into(out, a, b)
            data = out[a:b]  # hash the copy: the checksums describe the sink
        return data, (zlib.crc32(data) if checksums else 0)  # type: ignore[arg-type]  # numpy arrays are buffers

    done = list(map_fn(one, range(header.num_chunks)))
    if checksums:
        header = replace(header, chunk_crc32=tuple(c for _, c in done), checksum="crc32")
    return header.to_bytes(), [memoryview(data) for data, _ in done]


def _chunk_crcs(header: WeightHeader, buf: np.ndarray, indices: Iterable[int], map_fn: MapFn) -> list[int]:
    def crc(k: int) -> int:
        a, b = header.chunk_range(k)
        return zlib.crc32(buf[a:b])  # type: ignore[arg-type]  # numpy arrays are buffers

    return list(map_fn(crc, indices))


def _payload_view(header: WeightHeader, payload: Any) -> np.ndarray:
    size, total = memoryview(payload).nbytes, header.total_bytes
    if size < total:
        raise WeightMessageError(f"v{header.version}: payload truncated: {size} of {total} bytes")
    return np.frombuffer(payload, np.uint8, count=total)


def add_checksums(
    header: WeightHeader | bytes | memoryview, payload: Any, map_fn: MapFn = map
) -> WeightHeader:
    """The same header with the checksums of `payload` (≥ total_bytes, read in place, one pass, chunks over
    `map_fn`). For a header written with `checksums=False` once its payload can no longer change (a sealed
    memfd)."""
    h = header if isinstance(header, WeightHeader) else WeightHeader.from_bytes(header)
    crcs = _chunk_crcs(h, _payload_view(h, payload), range(h.num_chunks), map_fn)
    return replace(h, chunk_crc32=tuple(crcs), checksum="crc32")


# ---- decode ---------------------------------------------------------------------------------------------
class WeightAssembler:
    """Collects one message's chunks (in order, or by index) and checks each on arrival; any defect raises
    WeightMessageError naming the chunk or field. `buffer` (≥ total_bytes): where the payload lives; when it
    already holds it (mapped shared memory), `verify_buffer()` checks it in place and `finish` returns views
    of it. A header without checksums admits only `verify_buffer(trusted=True)`.
    """

    def __init__(self, header: WeightHeader | bytes | memoryview, buffer: Any = None) -> None:
        self.header = header if isinstance(header, WeightHeader) else WeightHeader.from_bytes(header)
        h = self.header
        try:  # the header's sizes are its sender's word: one that cannot be held is a bad message
            if buffer is None:
                raw = np.empty(h.total_bytes + ALIGN, np.uint8)  # aligned start, so tensors are aligned too
                self._buf = raw[-raw.ctypes.data % ALIGN :][: h.total_bytes]
            else:
                self._buf = _payload_view(h, buffer)
            self._have, self._next = [False] * h.num_chunks, 0
        except (MemoryError, ValueError, OverflowError) as e:
            if isinstance(e, WeightMessageError):
                raise
            msg = f"v{h.version}: cannot hold a payload of {h.total_bytes} bytes in {h.num_chunks} chunks"
            raise WeightMessageError(f"{msg} ({type(e).__name__}: {e})") from None

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
        self._check(i, zlib.crc32(self._buf[a:b]))  # type: ignore[arg-type]  # hash the copy: what is kept
        self._have[i], self._next = True, i + 1

    def verify_buffer(self, map_fn: MapFn = map, trusted: bool = False) -> None:
        """Check, in place, every chunk not added yet (the buffer already holds the payload; chunks hashed
        over `map_fn`). `trusted` skips hashing, for bytes that cannot differ from the ones the publisher
        wrote (a memfd sealed after it)."""
        todo = self.missing
        if not trusted:
            self._need_checksums("the payload")
            for i, crc in zip(todo, _chunk_crcs(self.header, self._buf, todo, map_fn), strict=True):
                self._check(i, crc)  # raises on the first bad chunk
        for i in todo:
            self._have[i] = True

    def _need_checksums(self, what: str) -> None:
        if not self.header.has_checksums:
            raise WeightMessageError(
                f"v{self.header.version}: header has no checksums, {what} cannot be verified"
            )

    def _check(self, i: int, got: int) -> None:
        h = self.header
        if got != (want := h.chunk_crc32[i]):
            raise WeightMessageError(
                f"v{h.version}: chunk {i} {h.chunk_range(i)} checksum mismatch {got}!={want}"
            )

    def finish(self, bfloat16: str = "uint16") -> dict[str, Any]:
        """NamedWeights (header's meta), name -> array (payload views), once every chunk is in and verified.
        bfloat16 comes back as raw bits (uint16), or as torch.bfloat16 tensors with `bfloat16="torch"`."""
        h = self.header
        if not self.complete:
            miss = self.missing
            raise WeightMessageError(f"v{h.version}: incomplete, missing chunks {miss[:8]} of {h.num_chunks}")
        out = NamedWeights(meta=h.meta)
        for t in h.tensors:
            arr = self._buf[t.offset : t.end].view(DTYPES[t.dtype]).reshape(t.shape)
            if t.dtype == "bfloat16" and bfloat16 == "torch":
                import torch  # only a caller that asks for torch tensors pays for the import

                arr = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)  # type: ignore[assignment]
            out[t.name] = arr
        return out
