"""The inferlet API is defined once (``pastry.api``): the WIT file, the trusted API
(``InferletApi`` and the session's handlers), the sandbox's host dispatch and the guest
binding all agree with the request table on every name, field and type."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from pastry import api
from pastry.api import ALIASES, REQUESTS, SPECS, Sampling
from pastry.api.types import wit_text, wit_type
from pastry.api.wit import PATH as WIT
from pastry.api.wit import generate
from pastry.control.handlers import HANDLERS
from pastry.control.session import Session


def test_the_wit_file_is_what_the_table_writes():
    assert WIT.read_text() == generate(), "run `python -m pastry.api.wit` to regenerate it"


def _wit_functions(text: str) -> dict[str, tuple[list[tuple[str, str]], str]]:
    """name -> ([(param, type)], result) of interface ``api`` (a parser of its own)."""
    body = re.search(r"interface api \{(.*?)\n\}", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    out = {}
    for name, params, result in re.findall(r"([\w-]+): func\(([^)]*)\)([^;]*);", body):
        depth, parts, cur = 0, [], ""
        for c in params:
            depth += (c == "<") - (c == ">")
            if c == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += c
        parts = [p for p in (*parts, cur) if p.strip()]
        ps = [(p.split(":", 1)[0].strip(), p.split(":", 1)[1].strip()) for p in parts]
        out[name] = (ps, result.strip().removeprefix("->").strip())
    return out


def test_every_request_is_one_wit_function_with_its_fields():
    funcs = _wit_functions(WIT.read_text())
    assert set(funcs) == {s.wit for s in SPECS.values()} | {"wait", "take", "wait-take"}
    for spec in SPECS.values():
        params, result = funcs[spec.wit]
        want = [(p.name.replace("_", "-"), wit_text(p.tree)) for p in spec.params]
        assert params == want, spec.name
        if spec.queued:
            assert "pending" in result, spec.name
    record = re.search(r"record sampling \{(.*?)\}", WIT.read_text(), re.S).group(1)
    fields = re.findall(r"([\w-]+): (.+),\n", record)
    hints = typing.get_type_hints(Sampling, include_extras=True)
    assert fields == [
        (f.name.replace("_", "-"), wit_text(wit_type(hints[f.name])))
        for f in dataclasses.fields(Sampling)
    ]


class Recording(api.InferletApi):
    def call(self, request):
        return request


def _example(tree):
    """A value of WIT type ``tree`` (as the Python API takes it)."""
    if tree is None:
        return None
    if isinstance(tree, str):
        return {"bool": True, "string": "x", "f32": 0.5, "f64": 0.5, "bitmask": b"\xff" * 4,
                "s32": -1, "s64": -2}.get(tree, 1)  # fmt: skip
    kind, *parts = tree
    if kind == "list":
        return b"\x01" if parts[0] == "u8" else [_example(parts[0])]  # bytes: list<u8>
    if kind == "option":
        return _example(parts[0])
    if kind == "tuple":
        return tuple(_example(p) for p in parts)
    return Sampling(0.5, 2, 0.9, 0.1, 7, b"\xff" * 4, [(1, 0.5)], [1], [2], 1.1, 0.2, 0.3, 2, 3)


def test_inferlet_api_has_one_method_per_request_with_its_fields():
    a = Recording()
    for spec in SPECS.values():
        sig = inspect.signature(getattr(api.InferletApi, spec.name))
        names = [p for p in sig.parameters if p not in ("self", "options")]
        assert names == [p.name for p in spec.params], spec.name
        for p in spec.params:
            assert sig.parameters[p.name].default == (
                inspect.Parameter.empty if p.required else p.default
            ), (spec.name, p.name)
        args = [_example(p.tree) for p in spec.params]
        assert getattr(a, spec.name)(*args) == spec.cls(*args), spec.name
    assert set(api.API_FUNCTIONS) == set(SPECS) | set(ALIASES)
    fwd = Recording().forward_with_adapter(0, "lora", [1], 2, [3], [4], 5, [6])
    assert fwd == api.Forward(0, [1], 2, [3], [4], 5, [6], adapter="lora")
    assert Recording().sample(1, 2, temperature=0.5, seed=3) == api.Sample(
        1, 2, Sampling(temperature=0.5, seed=3)
    )
    assert Recording().step(1, [2], [3], [4], [], 0, [5], 0, 6).sampling is None


def test_every_request_has_exactly_one_handler():
    assert set(HANDLERS) == set(REQUESTS)
    assert all(callable(h) for h in HANDLERS.values())


def test_methods_answered_by_handlers_build_the_same_records():
    """``answered_by`` (what ``Session`` uses) has InferletApi's signatures and hands each
    handler exactly the record ``InferletApi.call`` would get; a missing kind is refused."""
    got: list = []
    methods = api.answered_by({cls: lambda self, r: got.append(r) or r for cls in REQUESTS})
    assert set(methods) == set(api.API_FUNCTIONS)
    for name, fn in methods.items():
        assert inspect.signature(fn) == inspect.signature(getattr(api.InferletApi, name)), name
    for spec in SPECS.values():
        args = [_example(p.tree) for p in spec.params]
        assert methods[spec.name](None, *args) == spec.cls(*args) == got[-1], spec.name
    sampled = methods["sample"](None, 1, 2, temperature=0.5, seed=3)
    assert sampled == api.Sample(1, 2, Sampling(temperature=0.5, seed=3))
    assert methods["sample"](None, 1, 2, Sampling(top_k=4)).sampling == Sampling(top_k=4)
    fwd = methods["forward_with_adapter"](None, 0, "lora", [1], 2, [3], [4], 5, [6])
    assert fwd == api.Forward(0, [1], 2, [3], [4], 5, [6], adapter="lora")
    partial = {cls: HANDLERS[cls] for cls in REQUESTS if cls is not api.Step}
    with pytest.raises(ValueError, match="Step"):
        api.answered_by(partial)
    assert Session.step is not api.InferletApi.step
    sig = inspect.signature
    assert all(sig(getattr(Session, n)) == sig(getattr(api.InferletApi, n)) for n in methods)


def _conforms(value, ann) -> bool:
    """Whether ``value`` is what a componentize-py binding annotated ``ann`` takes."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is int:
        return type(value) is int
    if ann in (float, str, bool, bytes):
        return type(value) is ann
    if origin is typing.Union:
        return (value is None and type(None) in args) or any(
            _conforms(value, a) for a in args if a is not type(None)
        )
    if origin is list:
        return type(value) is list and all(_conforms(v, args[0]) for v in value)
    if origin is tuple:
        return (
            type(value) is tuple
            and len(value) == len(args)
            and all(_conforms(v, a) for v, a in zip(value, args, strict=True))
        )
    if dataclasses.is_dataclass(ann):
        hints = typing.get_type_hints(ann)
        return type(value) is ann and all(
            _conforms(getattr(value, f.name), hints[f.name]) for f in dataclasses.fields(ann)
        )
    raise AssertionError(f"no rule for {ann!r}")


def _returned(ann):
    """A value of what a binding returns (annotated ``ann``)."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann in (int, float, str, bool, bytes):
        return ann()
    if ann is None or ann is type(None):
        return None
    if origin is typing.Union:
        return _returned(next(a for a in args if a is not type(None)))
    if origin is list:
        return [_returned(args[0])]
    if origin is tuple:
        return tuple(_returned(a) for a in args)
    raise AssertionError(f"no rule for {ann!r}")


@pytest.fixture(scope="module")
def bindings(tmp_path_factory):
    """componentize-py's own binding of the WIT file (what the guest runs against)."""
    exe = shutil.which("componentize-py", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("componentize-py is not installed")
    out = tmp_path_factory.mktemp("bindings")
    subprocess.run([exe, "-d", str(WIT), "-w", "python-runtime", "bindings", str(out)], check=True)
    sys.path.insert(0, str(out))
    try:
        yield importlib.import_module("wit_world.imports.api")
    finally:
        sys.path.remove(str(out))
        for name in [m for m in sys.modules if m.startswith(("wit_world", "componentize_py"))]:
            del sys.modules[name]


def test_the_guest_binding_calls_every_import_as_the_wit_declares(bindings):
    from componentize_py_types import Err

    from pastry.api.guest import binding

    calls: list[str] = []

    class Host:
        Sampling = bindings.Sampling

        def __getattr__(self, name):
            stub = getattr(bindings, name)
            hints = typing.get_type_hints(stub)
            params = list(inspect.signature(stub).parameters)

            def imported(*args):
                assert len(args) == len(params), name
                for p, v in zip(params, args, strict=True):
                    assert _conforms(v, hints[p]), (name, p, v, hints[p])
                calls.append(name)
                return _returned(hints["return"])

            return imported

    class Loop:
        def track(self, pid):
            assert type(pid) is int
            return ("pending", pid)

    guest = binding(Host(), Err)(Loop())
    for spec in SPECS.values():
        got = getattr(guest, spec.name)(*[_example(p.tree) for p in spec.params])
        assert calls[-1] == spec.name
        if spec.queued and spec.now is not None:
            assert got[1][0] == "pending"
        elif spec.queued:
            assert got[0] == "pending"
    guest.forward_with_adapter(0, "lora", [1], 2, [3], [4], 5, [6])
    assert calls[-1] == "forward"
    assert set(calls) == set(SPECS)


def test_the_host_dispatches_every_import_to_its_record():
    from pastry.runtime.wasm_imports import DERIVED, HOST

    assert set(DERIVED) == {s.wit for s in SPECS.values()}
    assert set(HOST) == {s.wit for s in SPECS.values()} | {"take"}
    seen = []

    class Session:
        def call(self, request):
            seen.append(request)
            spec = api.BY_CLASS[type(request)]
            if spec.queued and spec.now is not None:
                return [1], None
            return b"\0" * 4 if spec.now_tree == "bitmask" else None

    class G:
        session = Session()

        def track(self, fut, value=None):
            return 9

    def lifted(tree):  # what wasm_codec lifts: lists, tuples; a record as its fields
        value = _example(tree)
        if isinstance(value, Sampling):
            words = memoryview(value.mask).cast("I").tolist()  # the mask as WIT's words
            return tuple(words if f.name == "mask" else getattr(value, f.name)
                         for f in dataclasses.fields(value))  # fmt: skip
        return value

    for spec in SPECS.values():
        args = [lifted(p.tree) for p in spec.params]
        DERIVED[spec.wit](G(), *args)
        assert type(seen[-1]) is spec.cls
        assert seen[-1] == spec.cls(*[_example(p.tree) for p in spec.params]), spec.name
