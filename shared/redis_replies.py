"""redis-py's reply types, narrowed to what this project's clients receive.

redis-py types every reply that holds keys, members or values as `bytes | str` (str only for a client made with
`decode_responses=True`), a sorted-set range as members or (member, score) pairs whatever `withscores` says, and a
stream entry's id and fields as optional (XAUTOCLAIM's deleted entries). No client here decodes responses
(`progress.connect` and every `Redis.from_url` leave it off), and the streams are read with XRANGE, XREVRANGE and
XREAD only, so these helpers say once, for the type checker, what the replies are instead of at every call site.
"""

from collections.abc import Mapping
from typing import cast

from redis.typing import StreamRangeResponse, XReadResponse, ZSetRangeResponse

StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]


def text(reply: bytes | str) -> str:
    """A key, member or value as text."""
    return reply.decode() if isinstance(reply, bytes) else reply


def text_hash(reply: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    """An HGETALL reply as text."""
    return {text(k): text(v) for k, v in reply.items()}


def members(reply: ZSetRangeResponse) -> list[bytes | str]:
    """A ZRANGE or ZREVRANGE reply without `withscores`."""
    # redis-py gives both forms one return type; without scores the reply is the members alone.
    return cast(list[bytes | str], reply)


def scored_members(reply: ZSetRangeResponse) -> list[tuple[bytes | str, float]]:
    """A ZRANGE or ZREVRANGE reply with `withscores=True` (and the default score_cast_func, float)."""
    # redis-py gives both forms one return type; with scores it pairs each member with its score.
    return cast(list[tuple[bytes | str, float]], reply)


def stream_entries(reply: StreamRangeResponse | None) -> StreamEntries:
    """An XRANGE or XREVRANGE reply: (id, fields) of each entry, in the order asked."""
    # redis-py types these replies as optional, and each entry's id and fields as optional too (the type is shared
    # with XAUTOCLAIM, whose deleted entries have neither); XRANGE and XREVRANGE return a list, empty when nothing
    # matches, of whole entries, as bytes since no client here decodes responses.
    return cast(StreamEntries, reply)


def read_streams(reply: XReadResponse | None) -> list[tuple[bytes, StreamEntries]]:
    """An XREAD reply: (stream, its new entries) per stream read; empty when a blocking read timed out."""
    # redis-py types the dict that a RESP3 client gets too; these clients speak RESP2, which sends a list of pairs.
    return cast(list[tuple[bytes, StreamEntries]], reply or [])
