"""Component-model values between Wasmtime's C structs and Python, fast.

A host import of a component receives its arguments and writes its result as
``wasmtime_component_val_t`` structs. wasmtime-py's generic converters rebuild type
objects through ctypes on every value (an ``option``, a ``result`` or a ``variant`` asks
Wasmtime for its case types each time), which made a trivial host call cost ~25 µs. This
module compiles one converter per WIT type, once, from the import's type (the first call
of each import): integers and strings read or write the struct's fields directly, and
``list<u32>`` / ``list<f32>`` / ``list<bool>`` / ``list<u8>`` (handles, tokens, masks,
probabilities, bytes) move as one block of memory instead of one ctypes access per element.
Anything else falls back to wasmtime-py's converter of that type, so a new import works
whatever its types (only slower until a fast path is added here).

Conventions (those of wasmtime-py, so both paths agree): ``list<u8>`` is ``bytes``, a
``variant`` is ``wasmtime.component.Variant(tag, payload)``, a ``tuple`` is a Python tuple,
an ``option`` is the payload or ``None``; a lifted ``record`` is the tuple of its fields in
declaration order (the request table's records take them positionally). A ``result`` is
read as a ``Variant`` (``"ok"`` or ``"err"``) and written by :func:`result_writer` from
``(ok, payload)``. Strings that are already UTF-8 may be passed as ``bytes``.

Ownership: arguments stay owned by Wasmtime (they are only read); a written result owns
what it points to (strings, lists, boxed payloads), which Wasmtime takes over.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Callable
from typing import Any

from wasmtime import component as t

from pastry.runtime.wasmtime_raw import ffi

Val = ffi.wasmtime_component_val_t
VAL_SIZE = ctypes.sizeof(Val)
OF = Val.of.offset  # where the payload starts in a val (8)
assert VAL_SIZE % 4 == 0 and OF % 4 == 0

Lift = Callable[[Any], Any]  # a Val (or a view of one) -> Python
Lower = Callable[[Any, Any], None]  # (Python value, Val to fill) -> None

_KIND = {
    t.Bool: ffi.WASMTIME_COMPONENT_BOOL.value,
    t.S8: ffi.WASMTIME_COMPONENT_S8.value,
    t.U8: ffi.WASMTIME_COMPONENT_U8.value,
    t.S16: ffi.WASMTIME_COMPONENT_S16.value,
    t.U16: ffi.WASMTIME_COMPONENT_U16.value,
    t.S32: ffi.WASMTIME_COMPONENT_S32.value,
    t.U32: ffi.WASMTIME_COMPONENT_U32.value,
    t.S64: ffi.WASMTIME_COMPONENT_S64.value,
    t.U64: ffi.WASMTIME_COMPONENT_U64.value,
    t.F32: ffi.WASMTIME_COMPONENT_F32.value,
    t.F64: ffi.WASMTIME_COMPONENT_F64.value,
}
_FIELD = {
    t.Bool: "boolean", t.S8: "s8", t.U8: "u8", t.S16: "s16", t.U16: "u16", t.S32: "s32",
    t.U32: "u32", t.S64: "s64", t.U64: "u64", t.F32: "f32", t.F64: "f64",
}  # fmt: skip
# array typecode of a scalar at offset OF of each val, for block copies of lists
_BLOCK = {t.U32: "I", t.S32: "i", t.F32: "f", t.U64: "Q", t.S64: "q", t.F64: "d"}
STRING = ffi.WASMTIME_COMPONENT_STRING.value
LIST = ffi.WASMTIME_COMPONENT_LIST.value
TUPLE = ffi.WASMTIME_COMPONENT_TUPLE.value
VARIANT = ffi.WASMTIME_COMPONENT_VARIANT.value
OPTION = ffi.WASMTIME_COMPONENT_OPTION.value
RESULT = ffi.WASMTIME_COMPONENT_RESULT.value
BOOL = ffi.WASMTIME_COMPONENT_BOOL.value

_string_at = ctypes.string_at
_memmove = ctypes.memmove
_byref = ctypes.byref
# wasm_byte_vec_new(out, size, data) with the data as plain bytes (wasmtime-py declares an
# array of c_uint8, which would need a copy to build); a private function object.
_byte_vec_new = ffi.dll["wasm_byte_vec_new"]
_byte_vec_new.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_byte_vec_new.restype = None
_vallist_new_uninit = ffi.wasmtime_component_vallist_new_uninit
_val_new = ffi.wasmtime_component_val_new


def _bytes_of(vec) -> bytes:
    return _string_at(vec.data, vec.size) if vec.size else b""


def _raw_list(v) -> tuple[bytes, int]:
    lst = v.of.list
    n = lst.size
    return (_string_at(lst.data, n * VAL_SIZE) if n else b""), n


# ---------------------------------------------------------------------------- lifting


def lifter(ty: t.ValType) -> Lift:
    """A function reading a value of component type ``ty`` from a Val."""
    cls = type(ty)
    if cls in _FIELD:
        field = _FIELD[cls]
        if cls is t.Bool:
            return lambda v: bool(v.of.boolean)
        return lambda v: getattr(v.of, field)
    if cls is t.String:
        return lambda v: _bytes_of(v.of.string).decode()
    if isinstance(ty, t.ListType):
        return _list_lifter(ty.element)
    if isinstance(ty, t.OptionType):
        inner = lifter(ty.payload)
        return lambda v: inner(v.of.option.contents) if v.of.option else None
    if isinstance(ty, t.TupleType):
        items = [lifter(e) for e in ty.elements]

        def tup(v):
            data = v.of.tuple.data
            return tuple(f(data[i]) for i, f in enumerate(items))

        return tup
    if isinstance(ty, t.ResultType):
        ok = None if ty.ok is None else lifter(ty.ok)
        err = None if ty.err is None else lifter(ty.err)

        def result(v):
            r = v.of.result
            inner = ok if r.is_ok else err
            payload = None if inner is None else inner(r.val.contents)
            return t.Variant("ok" if r.is_ok else "err", payload)

        return result
    if isinstance(ty, t.VariantType):
        cases = {name: None if p is None else lifter(p) for name, p in ty.cases}

        def variant(v):
            var = v.of.variant
            tag = _bytes_of(var.discriminant).decode()
            inner = cases[tag]
            return t.Variant(tag, None if inner is None else inner(var.val.contents))

        return variant
    if isinstance(ty, t.RecordType):  # a tuple of its fields, in declaration order
        fields = [lifter(f) for _, f in ty.fields]

        def record(v):
            data = v.of.record.data
            return tuple(f(data[i].val) for i, f in enumerate(fields))

        return record
    return ty.convert_from_c  # enums, flags, ...: wasmtime-py's (frees as it reads)


def _list_lifter(elem: t.ValType) -> Lift:
    cls = type(elem)
    if cls in _BLOCK:
        code, step = _BLOCK[cls], VAL_SIZE // array(_BLOCK[cls]).itemsize
        first = OF // array(code).itemsize

        def block(v):
            raw, n = _raw_list(v)
            return memoryview(raw).cast(code)[first::step].tolist() if n else []

        return block
    if cls is t.U8 or cls is t.Bool:
        flag = cls is t.Bool

        def small(v):
            raw, _ = _raw_list(v)
            b = raw[OF::VAL_SIZE]
            return [x != 0 for x in b] if flag else bytes(b)

        return small
    each = lifter(elem)

    def generic(v):
        lst = v.of.list
        data = lst.data
        return [each(data[i]) for i in range(lst.size)]

    return generic


# ---------------------------------------------------------------------------- lowering


def lowerer(ty: t.ValType) -> Lower:
    """A function writing a Python value of component type ``ty`` into a Val."""
    cls = type(ty)
    if cls in _FIELD:
        kind, field = _KIND[cls], _FIELD[cls]

        def scalar(value, v):
            v.kind = kind
            setattr(v.of, field, value)

        return scalar
    if cls is t.String:
        return _lower_string
    if isinstance(ty, t.ListType):
        return _list_lowerer(ty.element)
    if isinstance(ty, t.OptionType):
        inner = lowerer(ty.payload)

        def option(value, v):
            box = None if value is None else _boxed(inner, value)
            v.kind = OPTION
            v.of.option = box

        return option
    if isinstance(ty, t.TupleType):
        items = [lowerer(e) for e in ty.elements]
        n = len(items)

        def tup(value, v):
            if len(value) != n:
                raise ValueError(f"expected a tuple of {n}, got {len(value)} items")
            lst = ffi.wasmtime_component_vallist_t()  # tuples share the list layout
            _vallist_new_uninit(_byref(lst), n)
            _fill(lst, items, value)
            v.kind = TUPLE
            v.of.tuple.size, v.of.tuple.data = lst.size, lst.data

        return tup
    if isinstance(ty, t.VariantType):
        cases = {name: (name.encode(), None if p is None else lowerer(p)) for name, p in ty.cases}

        def variant(value, v):
            name, inner = cases[value.tag]
            box = None if inner is None else _boxed(inner, value.payload)
            _byte_vec_new(_byref(v.of.variant.discriminant), len(name), name)
            v.of.variant.val = box
            v.kind = VARIANT

        return variant
    if isinstance(ty, t.ResultType):
        write = result_writer(ty)
        return lambda value, v: write(value.tag == "ok", value.payload, v)

    def fallback(value, v):
        ty.convert_to_c(None, value, ctypes.pointer(v))

    return fallback


def result_writer(ty: t.ResultType) -> Callable[[bool, Any, Any], None]:
    """``write(ok, payload, val)`` for a ``result`` type (no payload for ``_``)."""
    ok = None if ty.ok is None else lowerer(ty.ok)
    err = None if ty.err is None else lowerer(ty.err)

    def write(is_ok, payload, v):
        inner = ok if is_ok else err
        box = None if inner is None else _boxed(inner, payload)
        v.of.result.is_ok = is_ok
        v.of.result.val = box
        v.kind = RESULT

    return write


def _lower_string(value, v) -> None:
    data = value if isinstance(value, bytes) else value.encode()
    v.kind = STRING
    _byte_vec_new(_byref(v.of.string), len(data), data)


def _boxed(lower: Lower, value):
    raw = Val()
    lower(value, raw)
    return _val_new(_byref(raw))  # moves raw's contents into a Wasmtime-owned box


def _fill(lst, lowers, values) -> None:
    """Fill the fresh (uninitialised) list ``lst``: ``lowers[i](values[i])``. If one
    fails, the list is freed (its unfilled slots made harmless first) and it re-raises:
    Wasmtime never sees uninitialised values."""
    data = lst.data
    i = 0
    try:
        for i, (f, x) in enumerate(zip(lowers, values, strict=True)):
            f(x, data[i])
    except BaseException:
        for j in range(i, lst.size):
            data[j].kind = BOOL
            data[j].of.boolean = False
        ffi.wasmtime_component_vallist_delete(_byref(lst))
        raise


def _template(kind: int) -> bytes:
    return bytes([kind]) + bytes(VAL_SIZE - 1)


def _list_lowerer(elem: t.ValType) -> Lower:
    cls = type(elem)
    if cls in _BLOCK:
        code, tmpl = _BLOCK[cls], _template(_KIND[cls])
        step = VAL_SIZE // array(code).itemsize
        first = OF // array(code).itemsize

        def block(value, v):
            values = array(code, value)  # raises before anything is allocated
            n = len(values)
            buf = bytearray(tmpl * n)
            if n:
                memoryview(buf).cast(code)[first::step] = values
            lst = v.of.list
            _vallist_new_uninit(_byref(lst), n)
            if n:
                _memmove(lst.data, bytes(buf), n * VAL_SIZE)
            v.kind = LIST

        return block
    if cls is t.U8 or cls is t.Bool:
        tmpl = _template(_KIND[cls])

        def small(value, v):
            values = bytes(bytearray(value))  # raises before anything is allocated
            n = len(values)
            buf = bytearray(tmpl * n)
            buf[OF::VAL_SIZE] = values
            lst = v.of.list
            _vallist_new_uninit(_byref(lst), n)
            if n:
                _memmove(lst.data, bytes(buf), n * VAL_SIZE)
            v.kind = LIST

        return small
    each = lowerer(elem)

    def generic(value, v):
        values = list(value)
        lst = v.of.list
        _vallist_new_uninit(_byref(lst), len(values))
        _fill(lst, [each] * len(values), values)
        v.kind = LIST

    return generic
