"""The one door to the part of Wasmtime's C API that wasmtime-py keeps private.

The sandbox is built on Wasmtime's *async* C API: a guest runs as a call future (a fiber)
that the host polls, host imports can suspend it, and it yields at epoch ticks
(``docs/sandbox.md``). wasmtime-py (pinned ``wasmtime>=50,<51`` in ``pyproject.toml``)
binds that API only in its private ``wasmtime._ffi`` / ``wasmtime._bindings`` modules, and
turns raw pointers into its objects only through private methods (``Store._context``,
``WasmtimeError._from_ptr``, ``Func._func``, ``Instance._from_raw``, ...). Every such use in
Pastry goes through this module and no other: the runtime's modules
(:mod:`pastry.runtime.wasm` and its parts, :mod:`~pastry.runtime.wasm_core`,
:mod:`~pastry.runtime.wasm_codec`, :mod:`~pastry.runtime.wasm_host`) import these names
instead of wasmtime's privates (``tests/test_layout.py`` keeps it so). A new wasmtime-py
is checked here: each name below is exercised by ``tests/test_wasm*.py``.

Known defect handled here: wasmtime-py 50 declares
``wasmtime_context_epoch_deadline_async_yield_and_update`` as returning an error pointer;
the library returns void, and reading the garbage "error" segfaults (restype fixed).
"""

from __future__ import annotations

import ctypes
import operator

import wasmtime
from wasmtime import _bindings
from wasmtime import _ffi as ffi
from wasmtime.component import FuncType, Instance

__all__ = [
    "AsyncFn",
    "ErrorPtr",
    "SyncFn",
    "Val",
    "caller_context",
    "component_instance",
    "context",
    "dll",
    "error",
    "ffi",
    "func_ptr",
    "func_type",
    "poll",
    "set_deadline",
    "trap",
    "yield_at_ticks",
]

_bindings._wasmtime_context_epoch_deadline_async_yield_and_update.restype = None

Val = ffi.wasmtime_component_val_t  # one component-model value
ErrorPtr = ctypes.POINTER(ffi.wasmtime_error_t)
dll = ffi.dll  # the C library, for functions wasmtime-py does not declare

# A call future: poll(fut) runs it until it returns (true), blocks or yields (false).
poll = _bindings._wasmtime_call_future_poll
# set_deadline(ctx, ticks): the guest yields (or traps) that many epoch ticks from now.
set_deadline = _bindings._wasmtime_context_set_epoch_deadline
# yield_at_ticks(ctx, ticks): reaching the deadline yields the fiber (and re-arms it).
yield_at_ticks = ffi.wasmtime_context_epoch_deadline_async_yield_and_update

context = wasmtime.Store._context  # context(store): its wasmtime_context_t pointer
func_ptr = operator.attrgetter("_func")  # func_ptr(func): a component Func's raw struct
error = wasmtime.WasmtimeError._from_ptr  # error(ptr): the owned error, as an exception
trap = wasmtime.Trap._from_ptr  # trap(ptr): the owned trap, as an exception
func_type = FuncType._from_ptr  # func_type(ptr, owner): a component function's type
component_instance = Instance._from_raw  # component_instance(raw): a component Instance

# The caller's store context, with the caller as a plain address (wasmtime-py's binding
# builds a pointer object on every call).
caller_context = dll["wasmtime_caller_context"]
caller_context.argtypes = [ctypes.c_size_t]
caller_context.restype = ctypes.c_size_t

# The component host-function callback types, with the context and function type as plain
# addresses (ctypes then passes an int instead of building a pointer object on every call);
# cast to Wasmtime's declared types when registered.
SyncFn = ctypes.CFUNCTYPE(
    ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
    ctypes.POINTER(Val), ctypes.c_size_t, ctypes.POINTER(Val), ctypes.c_size_t,
)  # fmt: skip
AsyncFn = ctypes.CFUNCTYPE(
    None, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
    ctypes.POINTER(Val), ctypes.c_size_t, ctypes.POINTER(Val), ctypes.c_size_t,
    ctypes.POINTER(ErrorPtr), ctypes.POINTER(ffi.wasmtime_async_continuation_t),
)  # fmt: skip
