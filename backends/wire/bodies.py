"""Compressed request bodies, decompressed in bounded pieces off the event loop (issue 65).

aiohttp inflated a `Content-Encoding: gzip` body on the event loop as it arrived, and after a
413 drained the rest the same way: four 1 MB bombs (1 GiB of JSON each) stalled /health 6-9 s.
The server now reads the body as sent (MAX_BODY_BYTES bounds the compressed bytes), and `decoded`
inflates it on a pool at most `limit` + 1 bytes at a time, refusing it past `limit`.
"""

from __future__ import annotations

import zlib

GZIP, ZLIB, RAW_DEFLATE = 31, 15, -15  # zlib's wbits for each container
MEMBERS = 64  # gzip members one body may concatenate


class TooLarge(Exception):
    """The body decompresses past the limit."""


class Unreadable(Exception):
    """Not what its Content-Encoding says, or an encoding this server does not read; the message
    says which."""

    def __init__(self, message: str, unsupported: bool = False):
        super().__init__(message)
        self.unsupported = unsupported


def decoded(raw: bytes, encoding: str, limit: int) -> bytes:
    """`raw` decompressed by its Content-Encoding (gzip, deflate, or none), at most `limit` bytes
    (TooLarge past it); memory and work bounded by `limit` whatever the ratio."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding in ("gzip", "x-gzip"):
        wbits = GZIP
    elif encoding == "deflate":  # zlib-wrapped as RFC 9110 says, or raw as some clients send it
        wbits = ZLIB if raw[:1] and raw[0] & 0x0F == 8 else RAW_DEFLATE
    else:
        raise Unreadable(f"Content-Encoding {encoding!r} is not supported: send gzip, deflate or none", True)
    out = bytearray()
    data = raw
    try:
        for _ in range(MEMBERS):
            inflater = zlib.decompressobj(wbits)
            while data and not inflater.eof:
                out += inflater.decompress(data, limit + 1 - len(out))
                if len(out) > limit:
                    raise TooLarge
                data = inflater.unconsumed_tail
            if not inflater.eof:
                raise Unreadable(f"the {encoding} body ends before its end")
            data = inflater.unused_data
            if not data:
                return bytes(out)
    except zlib.error as exc:
        raise Unreadable(f"the body is not {encoding}: {exc}") from None
    raise Unreadable(f"the {encoding} body has more than {MEMBERS} members")
