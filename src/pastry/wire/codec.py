"""Pickle-free wire encoding of engine batches, results and :class:`EngineInfo`.

A message is a list of frames (ZeroMQ multipart): frame 0 is a msgpack header, the others
are raw array buffers, sent zero-copy (``send_multipart(frames, copy=False)``) and read back
with ``np.frombuffer`` over the received frame, so decoded arrays are views of the message.

Header: ``[VERSION, kind, payload]``. A batch or a result list is a list of *runs*, one per
stretch of consecutive objects of one type: ``[tag, n, columns]`` with one column per
dataclass field (in the constructor's order, keyword-only fields last; plain
``None``/``int`` results form a one-column run of tag 0). A column is ``[kind, payload]``:

- ``VALUES``: the ``n`` field values themselves (``None``, ints, floats, strings);
- ``ARRAYS``: ``[dtype, lengths]`` — ``n`` 1-D arrays of one dtype, concatenated into the
  next frame (one frame per field per run, not one per array: tens of µs per 128 calls);
- ``EACH``: ``n`` items, each ``None`` or ``[dtype, shape]`` taking the next frame (masks
  and other N-D or mixed-dtype arrays);
- ``EMPTIES``: ``dtype`` — ``n`` empty 1-D arrays, no frame (the optional array fields a
  call leaves at their default, e.g. a ``Sample`` without logit processing).

Frames are consumed in order; every one must be used. Decoding never executes anything
(no pickle, no msgpack ext hooks) and checks every tag, field count, value type (against
the dataclass annotations), dtype (only :data:`SUPPORTED_DTYPES`) and size; anything
malformed raises :class:`CodecError`.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, is_dataclass
from itertools import accumulate, groupby
from operator import attrgetter
from types import NoneType, UnionType
from typing import Any, Final

import msgpack
import numpy as np

from pastry.wire.calls import (
    CALL_TYPES,
    Call,
    CallError,
    CopyKv,
    Dist,
    EmbedImg,
    EmbedTxt,
    EngineInfo,
    Forward,
    Logprobs,
    MaskKv,
    NextDist,
    Result,
    Sample,
    Sampled,
    SendKv,
    SwapIn,
    SwapOut,
)

VERSION: Final = 3  # 2: logit processing, logprobs; 3: Sample's logprobs before processing
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(d) for d in ("|b1", "|u1", "<i4", "<i8", "<f2", "<f4")
)

# A frame is anything with the buffer protocol: bytes, numpy arrays, zmq.Frame.
Frames = list[Any]


class CodecError(ValueError):
    """A message cannot be encoded or decoded; the text says which part and why."""


_KIND_BATCH, _KIND_RESULTS, _KIND_INFO = 1, 2, 3
_VALUES, _ARRAYS, _EACH, _EMPTIES = 0, 1, 2, 3
_DTYPE_CODE = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}
_NDARRAY_ONLY = frozenset({np.ndarray})
_NP_INTS = frozenset(t for t in set(np.sctypeDict.values()) if issubclass(t, np.integer))
_NP_FLOATS = frozenset(t for t in set(np.sctypeDict.values()) if issubclass(t, np.floating))


def _allowed_types(hint: Any) -> frozenset[type]:
    """The concrete types a field annotated ``hint`` may hold (numpy scalars encode too)."""
    if isinstance(hint, UnionType):
        return frozenset().union(*map(_allowed_types, typing.get_args(hint)))
    origin = typing.get_origin(hint) or hint
    table: dict[Any, frozenset[type]] = {
        np.ndarray: _NDARRAY_ONLY,
        int: frozenset({int}) | _NP_INTS,
        float: frozenset({float, int}) | _NP_FLOATS | _NP_INTS,
        bool: frozenset({bool, np.bool_}),
        str: frozenset({str}),
        NoneType: frozenset({NoneType}),
        None: frozenset({NoneType}),
        tuple: frozenset({tuple, list}),
        dict: frozenset({dict}),
    }
    assert origin in table, f"codec cannot carry fields annotated {hint!r}"
    return table[origin]


@dataclass(frozen=True)
class _Spec:
    """How one message type is laid out on the wire."""

    tag: int
    cls: type | None  # None: plain values (None / int results)
    name: str
    names: tuple[str, ...]
    allowed: tuple[frozenset[type], ...]
    build: Callable[..., Any] | None = None  # the fields' values, in ``names`` order -> object

    @classmethod
    def of(cls, tag: int, klass: type) -> _Spec:
        hints = typing.get_type_hints(klass)
        own = [f.name for f in fields(klass) if not f.kw_only]  # the constructor's order:
        names = (*own, *(f.name for f in fields(klass) if f.kw_only))  # keyword-only last
        allowed = tuple(_allowed_types(hints[n]) for n in names)
        return cls(tag, klass, klass.__name__, names, allowed, _builder(klass, names))

    def columns(self, group: tuple) -> Sequence[tuple]:
        if self.cls is None:
            return (group,)
        if len(self.names) == 1:
            return (tuple(map(attrgetter(self.names[0]), group)),)
        return tuple(zip(*map(attrgetter(*self.names), group), strict=True))


def _builder(klass: type, names: tuple[str, ...]) -> Callable[..., Any]:
    """A function from the values of ``names`` to a ``klass`` holding them, generated as
    ``dataclasses`` generates ``__init__``: it stores the decoded fields (every one is on
    the wire) without the constructor's defaults, so keyword-only fields cost nothing (a
    frozen result type is built by its ``__init__``, which has none).
    Measured on a ``Sample``: 0.27 us, vs 0.9 us through its ``__init__`` (1.6 us with the
    keyword-only processing fields passed by name)."""
    if klass.__dataclass_params__.frozen:  # results: no keyword-only fields, few rows
        return klass
    if hasattr(klass, "__post_init__"):  # a wire type is plain data: nothing to run
        raise TypeError(f"{klass.__name__} has a __post_init__: decode it with its __init__")
    args = [f"v{i}" for i in range(len(names))]
    body = "".join(f"    o.{name} = {arg}\n" for name, arg in zip(names, args, strict=True))
    source = f"def build({', '.join(args)}):\n    o = new(klass)\n{body}    return o\n"
    scope: dict[str, Any] = {"klass": klass, "new": object.__new__}
    exec(source, scope)  # the field names of our own dataclasses: nothing received runs
    return scope["build"]


_PLAIN = _Spec(0, None, "result", ("value",), (frozenset({NoneType, int}) | _NP_INTS,))
_CALL_TAGS = {
    EmbedTxt: 1,
    Forward: 2,
    NextDist: 3,
    Sample: 4,
    CopyKv: 5,
    MaskKv: 6,
    SwapOut: 7,
    SwapIn: 8,
    SendKv: 9,
    EmbedImg: 10,
}
assert set(_CALL_TAGS) == set(CALL_TYPES), "every call type needs a wire tag"
_CALL_SPECS = {t: _Spec.of(tag, t) for t, tag in _CALL_TAGS.items()}
_RESULT_SPECS: dict[type, _Spec] = {
    Dist: _Spec.of(16, Dist),
    CallError: _Spec.of(17, CallError),
    Sampled: _Spec.of(18, Sampled),
    Logprobs: _Spec.of(19, Logprobs),
}
_RESULT_SPECS |= {t: _PLAIN for t in (NoneType, int, *_NP_INTS)}
_CALLS_BY_TAG = {s.tag: s for s in _CALL_SPECS.values()}
_RESULTS_BY_TAG = {s.tag: s for s in _RESULT_SPECS.values()}
_INFO_HINTS = typing.get_type_hints(EngineInfo)
_INFO_NAMES = tuple(f.name for f in fields(EngineInfo))


# --- public API -------------------------------------------------------------------------


def encode_batch(calls: Sequence[Call]) -> Frames:
    """Frames for a batch of calls (header first; arrays are not copied more than once)."""
    return _encode(_KIND_BATCH, calls, _CALL_SPECS, "call")


def decode_batch(frames: Sequence[Any]) -> list[Call]:
    """The calls of a batch message; raises :class:`CodecError` for anything malformed."""
    return _decode(_KIND_BATCH, frames, _CALLS_BY_TAG)


def encode_results(results: Sequence[Result]) -> Frames:
    """Frames for the results of a batch (``None`` | ``int`` | ``Dist`` | ``Sampled`` |
    ``Logprobs`` | ``CallError``)."""
    return _encode(_KIND_RESULTS, results, _RESULT_SPECS, "result")


def decode_results(frames: Sequence[Any]) -> list[Result]:
    """The results of a result message; raises :class:`CodecError` for anything malformed."""
    return _decode(_KIND_RESULTS, frames, _RESULTS_BY_TAG)


def encode_info(info: EngineInfo) -> Frames:
    """Frames for an :class:`EngineInfo` (a single msgpack frame)."""
    values = [_flat(getattr(info, n)) for n in _INFO_NAMES]
    for name, value in zip(_INFO_NAMES, values, strict=True):
        if not _conforms(value, _INFO_HINTS[name]):
            raise CodecError(f"EngineInfo.{name}: cannot encode {value!r}")
    return [_pack([VERSION, _KIND_INFO, values])]


def decode_info(frames: Sequence[Any]) -> EngineInfo:
    """The :class:`EngineInfo` of an info message; raises :class:`CodecError` if malformed."""
    values = _unpack_header(frames, _KIND_INFO)
    if len(frames) != 1:
        raise CodecError(f"an info message has 1 frame, got {len(frames)}")
    if type(values) is not tuple or len(values) != len(_INFO_NAMES):
        raise CodecError(f"EngineInfo needs {len(_INFO_NAMES)} fields, got {_count(values)}")
    for name, value in zip(_INFO_NAMES, values, strict=True):
        if not _conforms(value, _INFO_HINTS[name]):
            raise CodecError(f"EngineInfo.{name}: unexpected value {value!r:.80}")
    return EngineInfo(
        *(_built(v, _INFO_HINTS[n]) for n, v in zip(_INFO_NAMES, values, strict=True))
    )


def _flat(value: Any) -> Any:
    """A dataclass field value of an :class:`EngineInfo` as msgpack carries it (a nested
    dataclass, e.g. :class:`~pastry.wire.images.ImageLayout`, as its fields' values)."""
    if is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, f.name) for f in fields(value)]
    return value


def _built(value: Any, hint: Any) -> Any:
    """The value :func:`_flat` made, back (``hint``: the field's annotation)."""
    for cls in typing.get_args(hint) if isinstance(hint, UnionType) else (hint,):
        if is_dataclass(cls) and isinstance(value, tuple | list):
            return cls(*value)
    return value


# --- encoding ---------------------------------------------------------------------------


def _encode(
    kind: int, objs: Sequence[Any], specs: dict[type, _Spec], what: str, checked: bool = False
) -> Frames:
    frames: Frames = [b""]
    runs = []
    for typ, items in groupby(objs, type):
        spec = specs.get(typ)
        if spec is None:
            raise CodecError(f"cannot encode a {typ.__name__} as a {what}")
        group = tuple(items)
        columns = [
            _encode_column(spec, i, c, frames, checked) for i, c in enumerate(spec.columns(group))
        ]
        runs.append([spec.tag, len(group), columns])
    try:
        frames[0] = _pack([VERSION, kind, runs])
    except CodecError:
        if checked:
            raise
        _encode(kind, objs, specs, what, checked=True)  # raises naming the bad field
        raise
    return frames


def _encode_column(spec: _Spec, i: int, values: tuple, frames: Frames, checked: bool) -> list:
    if not checked and np.ndarray not in spec.allowed[i]:
        # Scalar field: msgpack rejects what it cannot carry (then we re-run checked) and
        # the decoder checks types, so skip the per-value check on the hot path.
        return [_VALUES, values]
    types = set(map(type, values))
    if not types <= spec.allowed[i]:
        bad = sorted(t.__name__ for t in types - spec.allowed[i])
        raise CodecError(
            f"{spec.name}.{spec.names[i]}: cannot encode a value of type {', '.join(bad)} "
            f"(expected {_describe(spec.allowed[i])})"
        )
    if np.ndarray not in types:
        return [_VALUES, values]
    if types == _NDARRAY_ONLY and not any(v.size for v in values):  # all empty: no frame
        dtypes = {v.dtype for v in values}
        if len(dtypes) == 1 and all(v.ndim == 1 for v in values):
            return [_EMPTIES, _dtype_code(values[0].dtype, spec, i)]
    if types == _NDARRAY_ONLY:  # fast path: all 1-D arrays of one dtype -> one frame
        try:
            data = np.concatenate(values, dtype=values[0].dtype, casting="no")
        except (TypeError, ValueError):  # mixed dtypes or dimensions, 0-d arrays
            data = None
        if data is not None and data.ndim == 1:
            frames.append(data)
            lengths = list(map(len, values))
            if lengths.count(lengths[0]) == len(lengths):  # all the same: send one number
                return [_ARRAYS, [_dtype_code(data.dtype, spec, i), lengths[0]]]
            return [_ARRAYS, [_dtype_code(data.dtype, spec, i), lengths]]
    items = []
    for v in values:
        if v is None:
            items.append(None)
        else:
            items.append([_dtype_code(v.dtype, spec, i), list(v.shape)])
            frames.append(np.ascontiguousarray(v))
    return [_EACH, items]


def _dtype_code(dtype: np.dtype, spec: _Spec, i: int) -> int:
    code = _DTYPE_CODE.get(dtype)
    if code is None:
        allowed = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise CodecError(
            f"{spec.name}.{spec.names[i]}: arrays of dtype {dtype} cannot be sent "
            f"(supported: {allowed}; convert with .astype())"
        )
    return code


def _pack(obj: Any) -> bytes:
    try:
        return msgpack.packb(obj, default=_np_scalar, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise CodecError(f"cannot encode message: {e}") from e


def _np_scalar(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _describe(allowed: frozenset[type]) -> str:
    names = {t.__name__ for t in allowed if not issubclass(t, np.generic)}
    return " | ".join(sorted(names))


# --- decoding ---------------------------------------------------------------------------


def _decode(kind: int, frames: Sequence[Any], by_tag: dict[int, _Spec]) -> list:
    runs = _unpack_header(frames, kind)
    if type(runs) is not tuple:
        raise CodecError(f"message body must be a list of runs, got {type(runs).__name__}")
    buffers = iter(frames[1:])
    out: list = []
    for run in runs:
        if type(run) is not tuple or len(run) != 3:
            raise CodecError(f"a run is [tag, count, columns], got {run!r:.80}")
        tag, n, columns = run
        spec = by_tag.get(tag) if type(tag) is int else None
        if spec is None:
            raise CodecError(f"unknown tag {tag!r:.20} (known: {sorted(by_tag)})")
        if type(n) is not int or n < 1:
            raise CodecError(f"{spec.name} run: count must be a positive int, got {n!r:.20}")
        if type(columns) is not tuple or len(columns) != len(spec.names):
            raise CodecError(
                f"{spec.name}: expected {len(spec.names)} fields, got {_count(columns)}"
            )
        cols = [_decode_column(spec, i, c, n, buffers) for i, c in enumerate(columns)]
        out.extend(cols[0] if spec.build is None else map(spec.build, *cols))
    extra = sum(1 for _ in buffers)
    if extra:
        raise CodecError(f"{extra} frame(s) left over after the last array")
    return out


def _decode_column(spec: _Spec, i: int, column: Any, n: int, buffers) -> Sequence[Any]:
    where = f"{spec.name}.{spec.names[i]}"
    if type(column) is not tuple or len(column) != 2:
        raise CodecError(f"{where}: a column is [kind, payload], got {column!r:.80}")
    kind, payload = column
    allowed = spec.allowed[i]
    if kind == _VALUES:
        _check_len(payload, n, where)
        types = set(map(type, payload))
        if not types <= allowed:
            bad = sorted(t.__name__ for t in types - allowed)
            raise CodecError(f"{where}: unexpected value type {', '.join(bad)}")
        return payload
    if np.ndarray not in allowed:
        raise CodecError(f"{where}: this field does not hold arrays")
    if kind == _ARRAYS:
        if type(payload) is not tuple or len(payload) != 2:
            raise CodecError(f"{where}: an array column is [dtype, lengths]")
        return _split(_frombuffer(buffers, _dtype(payload[0], where), where), payload[1], n, where)
    if kind == _EACH:
        _check_len(payload, n, where)
        return [_decode_array(item, allowed, buffers, where) for item in payload]
    if kind == _EMPTIES:
        return [np.zeros(0, _dtype(payload, where))] * n
    raise CodecError(f"{where}: unknown column kind {kind!r:.20}")


def _split(data: np.ndarray, lengths: Any, n: int, where: str) -> list[np.ndarray]:
    """``n`` consecutive views of ``data``: all of one length (an int) or of ``lengths``."""
    if type(lengths) is int:  # uniform: rows of a 2-D view, sliced in C
        if lengths < 0 or lengths * n != data.size:
            raise CodecError(f"{where}: {n} arrays of {lengths} do not fill {data.size} elements")
        return list(data.reshape(n, lengths))
    _check_len(lengths, n, where)
    if set(map(type, lengths)) != {int} or min(lengths) < 0:
        raise CodecError(f"{where}: lengths must be non-negative ints")
    ends = list(accumulate(lengths))
    if ends[-1] != data.size:
        raise CodecError(f"{where}: lengths add up to {ends[-1]} but the frame holds {data.size}")
    starts = [0, *ends[:-1]]
    return list(map(data.__getitem__, map(slice, starts, ends)))


def _decode_array(item: Any, allowed: frozenset[type], buffers, where: str) -> np.ndarray | None:
    if item is None:
        if NoneType not in allowed:
            raise CodecError(f"{where}: None is not allowed here")
        return None
    if type(item) is not tuple or len(item) != 2 or type(item[1]) is not tuple:
        raise CodecError(f"{where}: an array is [dtype, shape], got {item!r:.80}")
    dtype, shape = _dtype(item[0], where), item[1]
    if len(shape) > 8 or any(type(d) is not int or d < 0 for d in shape):
        raise CodecError(f"{where}: bad array shape {shape!r:.80}")
    data = _frombuffer(buffers, dtype, where)
    if data.size != math.prod(shape):
        raise CodecError(f"{where}: shape {list(shape)} does not match {data.size} elements")
    return data.reshape(shape)


def _dtype(code: Any, where: str) -> np.dtype:
    if type(code) is not int or not 0 <= code < len(SUPPORTED_DTYPES):
        raise CodecError(f"{where}: unknown dtype code {code!r:.20}")
    return SUPPORTED_DTYPES[code]


def _frombuffer(buffers, dtype: np.dtype, where: str) -> np.ndarray:
    frame = next(buffers, None)
    if frame is None:
        raise CodecError(f"{where}: missing array frame")
    try:
        data = np.frombuffer(frame, dtype)
    except (TypeError, ValueError) as e:
        raise CodecError(f"{where}: bad array frame ({e})") from e
    if not data.flags.aligned:  # ZeroMQ packs small messages into a shared receive buffer
        data = data.copy()
    if dtype == np.bool_ and data.size and data.view(np.uint8).max() > 1:
        raise CodecError(f"{where}: bool array holds bytes other than 0 and 1")
    return data


def _unpack_header(frames: Sequence[Any], kind: int) -> Any:
    if not frames:
        raise CodecError("empty message (no header frame)")
    try:
        header = msgpack.unpackb(frames[0], use_list=False, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise CodecError(f"header is not valid msgpack ({e})") from e
    if type(header) is not tuple or len(header) != 3:
        raise CodecError(f"header must be [version, kind, body], got {header!r:.80}")
    if header[0] != VERSION:
        raise CodecError(
            f"unsupported codec version {header[0]!r:.20} (this side speaks {VERSION})"
        )
    if header[1] != kind:
        raise CodecError(f"expected message kind {kind}, got {header[1]!r:.20}")
    return header[2]


def _check_len(payload: Any, n: int, where: str) -> None:
    if type(payload) is not tuple or len(payload) != n:
        raise CodecError(f"{where}: expected {n} items, got {_count(payload)}")


def _count(obj: Any) -> str:
    return str(len(obj)) if type(obj) is tuple else f"a {type(obj).__name__}"


def _conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` matches the annotation ``hint`` (unions, tuple[X, ...], dict[K, V])."""
    if isinstance(hint, UnionType):
        return any(_conforms(value, h) for h in typing.get_args(hint))
    if hint is None or hint is NoneType:
        return value is None
    if is_dataclass(hint):  # a nested dataclass travels as its fields' values (_flat)
        own = fields(hint)
        hints = typing.get_type_hints(hint)
        return (
            isinstance(value, tuple | list)
            and len(value) == len(own)
            and all(_conforms(v, hints[f.name]) for v, f in zip(value, own, strict=True))
        )
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        return isinstance(value, tuple | list) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items()
        )
    if hint is float:
        return type(value) in (float, int)
    return type(value) is hint
