"""Wire format of mailbox messages and replies.

A call is one frame: a 4-byte header length, a small pickled header
`(kind, call_id, reply_ranks)` and the pickled body `(method, args, kwargs)`. The
header always unpickles, so an actor that cannot unpickle a body still knows
which call to fail. A broadcast is encoded once and the same bytes go to every
mailbox.

A reply is a pickled `(call_id, global_rank, ok, value_or_packed_exception)`.
The first message an actor sends has call_id READY_ID and carries either
`(pid, host)` or the packed exception that stopped it from starting.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any, Callable, Optional, Union

from actors.errors import SerializationError

CALL = 0
STOP = 1
READY_ID = -1

Method = Union[str, Callable[..., Any]]

_HEADER_LEN = struct.Struct("<I")
_WIRE_LEN = struct.Struct("!i")
_WIRE_BIG_LEN = struct.Struct("!Q")


def dumps(obj: Any) -> bytes:
    """pickle, falling back to cloudpickle for lambdas and local functions."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError):
        import cloudpickle  # only when plain pickle cannot do it: it is slower

        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def method_name(method: Method) -> str:
    if isinstance(method, str):
        return method
    return getattr(method, "__qualname__", None) or repr(method)


def encode_body(method: Method, args: tuple, kwargs: dict) -> bytes:
    """The pickled body of a call; done before the dispatch lock, since it may be large."""
    try:
        return dumps((method, args, kwargs))
    except Exception as exc:
        raise SerializationError(
            f"cannot pickle the arguments of {method_name(method)!r}: {type(exc).__name__}: {exc}"
        ) from exc


def encode_call(call_id: int, reply_ranks: Optional[frozenset], body: bytes) -> bytes:
    """A call's frame in wire form (`Connection.send_bytes` framing), built with one join."""
    header = pickle.dumps((CALL, call_id, reply_ranks), protocol=pickle.HIGHEST_PROTOCOL)
    size = _HEADER_LEN.size + len(header) + len(body)
    return b"".join((wire_prefix(size), _HEADER_LEN.pack(len(header)), header, body))


def wire_prefix(size: int) -> bytes:
    """The length prefix `Connection.send_bytes` writes before a frame of `size` bytes."""
    return _WIRE_LEN.pack(size) if size <= 0x7FFFFFFF else _WIRE_LEN.pack(-1) + _WIRE_BIG_LEN.pack(size)


def encode_stop() -> bytes:
    """The stop frame in wire form."""
    header = pickle.dumps((STOP, 0, None))
    return wire_prefix(_HEADER_LEN.size + len(header)) + _HEADER_LEN.pack(len(header)) + header


def decode_header(frame: bytes) -> tuple[tuple[int, int, Optional[frozenset]], memoryview]:
    """The header tuple and a view of the body, which the caller unpickles when it can."""
    view = memoryview(frame)
    (size,) = _HEADER_LEN.unpack_from(view)
    header = pickle.loads(view[_HEADER_LEN.size : _HEADER_LEN.size + size])
    return header, view[_HEADER_LEN.size + size :]
