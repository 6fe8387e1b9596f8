"""The protobuf wire format, by hand: tests craft files protobuf's own encoder would not write
(corrupt, lenient or deeply nested encodings)."""

from __future__ import annotations

VARINT_WT, I64_WT, LEN_WT, SGROUP_WT, EGROUP_WT, I32_WT = 0, 1, 2, 3, 4, 5


def varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64 two's complement, as protobuf encodes negative int64
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def key(field: int, wire_type: int) -> bytes:
    return varint((field << 3) | wire_type)


def f_varint(field: int, n: int) -> bytes:
    return key(field, VARINT_WT) + varint(n)


def f_len(field: int, payload: bytes) -> bytes:
    return key(field, LEN_WT) + varint(len(payload)) + payload


def f_str(field: int, s: str) -> bytes:
    return f_len(field, s.encode())
