"""The weight broadcast's wire format, defined once: the codec, the publisher and the subscriber import it.

A weight message is a header and a payload (system/weight_codec.py writes and checks both); the broadcast
carries them in ZeroMQ frames between one ROUTER (learner/weight_publisher.py) and one DEALER per subscriber
(actors/weight_subscriber.py). Integers outside the JSON are unsigned; every frame is bytes::

    part / kind   layout                                          meaning
    ------------  ----------------------------------------------  ----------------------------------------
    header        HEADER_PREFIX "<8sII": MAGIC b"TOPSDW1\\0",      16 bytes, little-endian, then the JSON
      prefix      u32 n = JSON length, u32 crc32 of the JSON
    header        n bytes of UTF-8 JSON: {"magic": "TOPSDW1",     FORMAT 2: one crc32 per chunk, none per
      JSON        "format": 2, "version": v, "checksum":          tensor (a format-1 header is refused).
                  "crc32" | "none", "align": 64,                  "none": the layout alone, chunk_crc32
                  "total_bytes": T, "chunk_size": C,              empty; only for a payload in a sealed
                  "num_chunks": ceil(T / C), "chunk_crc32":       memfd on the same host
                  [one u32 per chunk], "tensors": [{"name",       "meta" (optional, a JSON object): what
                  "dtype", "shape", "offset", "nbytes"}, ...],    the tensors are; absent for full weights,
                  "meta": {...}}                                  a LoRA adapter's: system/lora_sync.py
    payload       T raw bytes: tensor i at [offset, offset +      dtype: a numpy name or "bfloat16" (raw
                  nbytes), offsets ascending and ALIGN-aligned    2-byte bits). Chunk k is payload[k*C :
                  (64), zero bytes between                        (k+1)*C], the last maybe shorter
    LATEST        sub -> pub  [LATEST]                            hello, what is newest? -> ANNOUNCE/NONE
    ANNOUNCE      pub -> sub  [ANNOUNCE, header, locator]         also unasked, to every known subscriber,
                                                                  on each publish and each hashed NEED
    NONE          pub -> sub  [NONE]                              nothing published yet
    GET           sub -> pub  [GET, META]                         one chunk, please -> CHUNK or GONE
    CHUNK         pub -> sub  [CHUNK, META, chunk bytes]          META echoed
    GONE          pub -> sub  [GONE, META]                        that version is no longer held
    NEED          sub -> pub  [NEED, VERSION]                     its checksums, please -> ANNOUNCE with
                                                                  them (to every subscriber, once hashed)
    BYE           sub -> pub  [BYE]                               forget me (no answer)
    META          ">QII": u64 version, u32 chunk index,           the tag numbers the subscriber's fetches:
                  u32 fetch tag                                   replies to an abandoned one are dropped
    VERSION       ">Q": u64 version
    locator       UTF-8 JSON {"proc": "/proc/PID/fd/N" or "",     where the payload's memfd is, and the
                  "dev", "ino", "bytes", "sealed",                publisher's incarnation (a restarted one
                  "publisher"}                                    is followed even with lower versions)
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any

MAGIC = b"TOPSDW1\0"
MAGIC_JSON = "TOPSDW1"  # the header JSON's "magic"
FORMAT = 2
ALIGN = 64
HEADER_PREFIX = struct.Struct("<8sII")  # magic, JSON length, crc32 of the JSON

LATEST, ANNOUNCE, NONE, GET = b"LATEST", b"ANNOUNCE", b"NONE", b"GET"
CHUNK, GONE, NEED, BYE = b"CHUNK", b"GONE", b"NEED", b"BYE"

META = struct.Struct(">QII")  # version, chunk index, fetch tag
VERSION = struct.Struct(">Q")  # version


class NamedWeights(dict[str, Any]):
    """name -> tensor, with `meta`: the header's "meta" object (what the tensors are; {} for full weights).
    Given to a weight source, its meta goes into the header; a weight sink returns one with the header's."""

    def __init__(
        self,
        tensors: Mapping[str, Any] | Iterable[tuple[str, Any]] = (),
        meta: Mapping[str, Any] | None = None,
    ):
        super().__init__(tensors)
        self.meta: dict[str, Any] = dict(meta or {})
