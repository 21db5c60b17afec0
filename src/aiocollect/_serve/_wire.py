"""The serve wire: one message per WebSocket binary frame, a JSON header and raw array bytes.

A message is ``MAGIC`` (4 bytes), the header's length (``uint32``, little-endian), the header (UTF-8 JSON,
an object) and the arrays' bytes, back to back. The header lists the arrays as ``[dtype, shape]`` pairs
in ``"arrays"``; a dtype is one of :data:`DTYPES` (plain little-endian numbers and bools). Nothing from
the network is ever unpickled: a frame that does not start with ``MAGIC``, lists a dtype outside the
table, or whose sizes do not add up is refused with :class:`ProtocolError`.

Every input is bounded before it is parsed: a message by :data:`MAX_MESSAGE`, the JSON nesting by
:data:`MAX_DEPTH` (so that no reader of a tree recurses past Python's limit), and for what a server reads
(``decode(message, request=True)``) the header by :data:`MAX_REQUEST_HEADER` bytes and the arrays by
:data:`MAX_REQUEST_ARRAYS`. A server parses on its event loop only a header of at most
:data:`LOOP_HEADER` bytes (:func:`small_header`); a bigger one is decoded in a worker thread.

Nested values (an observation dict, an ``info`` dict) travel as a JSON tree whose arrays are
``{"@": i}`` references to the ``i``-th array (:func:`pack_tree`, :func:`unpack_tree`).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "DTYPES",
    "LOOP_HEADER",
    "MAGIC",
    "MAX_DEPTH",
    "MAX_MESSAGE",
    "MAX_REQUEST_ARRAYS",
    "MAX_REQUEST_HEADER",
    "ProtocolError",
    "decode",
    "encode",
    "pack_tree",
    "small_header",
    "unpack_tree",
]

MAGIC = b"AIOC"
_LEN = struct.Struct("<I")
#: the largest message either side accepts (bytes): a bigger one is refused, not buffered
MAX_MESSAGE = 64 * 1024 * 1024
#: the deepest JSON nesting a header may have (a packed tree nests two levels per dict)
MAX_DEPTH = 64
#: the largest header (bytes) and the most arrays a server accepts in a client's message (a batch of
#: 1,024 env resets with options fits in a tenth of it)
MAX_REQUEST_HEADER = 1024 * 1024
MAX_REQUEST_ARRAYS = 65536
#: the largest header (bytes) a server parses on its event loop (well under a millisecond); a bigger
#: request is decoded in a worker thread
LOOP_HEADER = 16 * 1024

#: the dtypes that cross the wire, by their little-endian ``dtype.str``; nothing else is accepted
_NAMES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]
_NAMES += ["float16", "float32", "float64"]
DTYPES: dict[str, np.dtype[Any]] = {
    np.dtype(name).newbyteorder("<").str: np.dtype(name).newbyteorder("<") for name in _NAMES
}


class ProtocolError(ValueError):
    """A message that is not a valid serve message (not ours, malformed, or an unsupported dtype)."""


def encode(header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> bytes:
    """One message: ``header`` (JSON-able) plus ``arrays`` (listed in the header as ``"arrays"``)."""
    contiguous = []
    described = []
    for array in arrays:
        array = np.asarray(array)
        if not array.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
            array = array.copy(order="C")
        if array.dtype.str not in DTYPES:
            array = array.astype(array.dtype.newbyteorder("<"))
            if array.dtype.str not in DTYPES:
                raise TypeError(
                    f"arrays of dtype {array.dtype} cannot be sent (plain numbers and bools only)"
                )
        contiguous.append(array)
        described.append([array.dtype.str, list(array.shape)])
    head = json.dumps({**header, "arrays": described}, separators=(",", ":"), allow_nan=True).encode()
    return b"".join([MAGIC, _LEN.pack(len(head)), head, *(a.tobytes() for a in contiguous)])


def small_header(message: bytes) -> bool:
    """Whether ``message``'s header is small enough (:data:`LOOP_HEADER`) to parse on an event loop."""
    return len(message) >= 8 and _LEN.unpack_from(message, 4)[0] <= LOOP_HEADER


def decode(message: bytes, *, request: bool = False) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The header and arrays of ``message`` (arrays are fresh, writable copies); ``request``: a client's
    message read by a server, whose header and array count are bounded too (see the module docs)."""
    if message[:4] != MAGIC:
        raise ProtocolError(
            "not an aiocollect serve message (bad magic: pickles and other formats are refused)"
        )
    if len(message) < 8:
        raise ProtocolError("truncated message")
    (size,) = _LEN.unpack_from(message, 4)
    end = 8 + size
    if end > len(message):
        raise ProtocolError("truncated message header")
    if request and size > MAX_REQUEST_HEADER:
        raise ProtocolError(f"message header of {size} bytes (at most {MAX_REQUEST_HEADER})")
    try:
        header = json.loads(message[8:end])
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"message header is not JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise ProtocolError("message header must be a JSON object with an 'op' string")
    _check_depth(header)
    arrays = []
    total = len(message)
    described = _described(header)
    if request and len(described) > MAX_REQUEST_ARRAYS:
        raise ProtocolError(f"message lists {len(described)} arrays (at most {MAX_REQUEST_ARRAYS})")
    for entry in described:
        dtype, shape = _array_meta(entry)
        count = math.prod(shape)
        nbytes = dtype.itemsize * count
        if end + nbytes > total:
            raise ProtocolError("message shorter than the arrays its header lists")
        # a fresh, writable (and aligned) copy of each array
        arrays.append(np.frombuffer(message, dtype=dtype, count=count, offset=end).reshape(shape).copy())
        end += nbytes
    if end != total:
        raise ProtocolError("message longer than the arrays its header lists")
    return header, arrays


def _check_depth(tree: Any) -> None:
    """``ProtocolError`` if ``tree`` nests deeper than :data:`MAX_DEPTH` (iterative: no recursion)."""
    level: list[Any] = [tree]
    for _ in range(MAX_DEPTH):
        below: list[Any] = []
        for node in level:
            if type(node) is dict:
                below += [v for v in node.values() if type(v) is dict or type(v) is list]
            elif type(node) is list:
                below += [v for v in node if type(v) is dict or type(v) is list]
        if not below:
            return
        level = below
    raise ProtocolError(f"message header nests deeper than {MAX_DEPTH} levels")


def _described(header: dict[str, Any]) -> list[Any]:
    listed = header.get("arrays", [])
    if not isinstance(listed, list):
        raise ProtocolError("'arrays' must be a list of [dtype, shape] pairs")
    return listed


def _array_meta(entry: Any) -> tuple[np.dtype[Any], list[int]]:
    if type(entry) is not list or len(entry) != 2 or type(shape := entry[1]) is not list:
        raise ProtocolError(f"array description {entry!r} is not a [dtype, shape] pair")
    dtype = DTYPES.get(entry[0]) if type(entry[0]) is str else None
    if dtype is None:
        raise ProtocolError(f"dtype {entry[0]!r} is not accepted (one of {sorted(DTYPES)})")
    if len(shape) > 32:
        raise ProtocolError(f"array shape {shape!r} has too many dimensions")
    for n in shape:  # (a bool is not an int here: type() is exact)
        if type(n) is not int or not 0 <= n < 2**31:
            raise ProtocolError(f"bad array shape {shape!r}")
    return dtype, shape


# -- trees of JSON values and arrays ----------------------------------------------------------------------
_EMPTY: dict[str, Any] = {"{}": {}}  # an empty dict (an env's usual info), packed


def pack_tree(value: Any, arrays: list[np.ndarray]) -> Any:
    """``value`` as JSON, its numpy arrays (and numpy scalars) appended to ``arrays`` as ``{"@": i}``.

    Dicts (string keys), lists, tuples, ``None``, bools, ints, floats and strings travel as themselves,
    a 1-d object array (a gymnasium vector env's info column, ``None`` where a sub-env had no entry) as
    its items; anything else (an object in an ``info`` dict) travels as its ``repr`` text."""
    kind = type(value)
    if kind is np.ndarray and value.dtype.kind in "biuf":  # the common case first
        arrays.append(value)
        return {"@": len(arrays) - 1}
    if kind is dict and not value:
        return _EMPTY
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.ndarray | np.generic) and np.asarray(value).dtype.kind in "biuf":
        arrays.append(np.asarray(value))
        return {"@": len(arrays) - 1}
    if hasattr(value, "numpy") and hasattr(value, "detach"):  # a torch tensor
        return pack_tree(value.detach().cpu().numpy(), arrays)
    if kind is np.ndarray and value.dtype == object and value.ndim == 1:  # a vector env's info column
        return {"[]": [pack_tree(v, arrays) for v in value.tolist()]}
    if isinstance(value, dict):
        return {"{}": {str(k): pack_tree(v, arrays) for k, v in value.items()}}
    if isinstance(value, list | tuple):
        return [pack_tree(v, arrays) for v in value]
    return repr(value)


def unpack_tree(tree: Any, arrays: list[np.ndarray]) -> Any:
    """The inverse of :func:`pack_tree` (a 0-d array comes back as a numpy scalar)."""
    if (
        type(tree) is dict
        and len(tree) == 1
        and type(index := tree.get("@")) is int
        and 0 <= index < len(arrays)
    ):
        array = arrays[index]  # the common case first
        return array[()] if array.ndim == 0 else array
    if isinstance(tree, list):
        return [unpack_tree(v, arrays) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if "@" in tree:
        index = tree["@"]
        if not isinstance(index, int) or not 0 <= index < len(arrays):
            raise ProtocolError(f"array reference {index!r} out of range")
        array = arrays[index]
        return array[()] if array.ndim == 0 else array
    inner = tree.get("{}")
    if not isinstance(inner, dict):
        items = tree.get("[]")
        if isinstance(items, list) and len(tree) == 1:
            column = np.empty(len(items), dtype=object)
            for k, item in enumerate(items):
                column[k] = unpack_tree(item, arrays)
            return column
        raise ProtocolError("a tree node must be {'@': index}, {'{}': {...}} or {'[]': [...]}")
    return {k: unpack_tree(v, arrays) for k, v in inner.items()}
