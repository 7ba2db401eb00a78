"""SGLang's own frontend (``sgl.function``, ``gen``, ``select``, ``fork``, regex ``gen``)
driven through its ``RuntimeEndpoint`` against a Pastry server produces the same results
as ``pastry.lang`` does for the same program.

``scripts/setup.sh`` installs SGLang's frontend (``sglang==0.4.10.post2`` without its
runtime dependencies: the last release whose ``import sglang`` needs no torch/CUDA); the
test skips when it is absent.
"""

from __future__ import annotations

import pytest

from server_util import running_server

sgl = pytest.importorskip("sglang", reason="SGLang's frontend is not installed (scripts/setup.sh)")

import pastry.lang as pl  # noqa: E402


def make(lib):
    """The same program in either library."""

    @lib.function
    def review(s, essay):
        s += "Essay: " + essay + "\n"
        s += "Summary:" + lib.gen("summary", max_tokens=10, stop="\n")
        s += "\nGrade: " + lib.select("grade", choices=["A", "B", "C", "D"])
        forks = s.fork(3)
        for f, dim in zip(forks, ["clarity", "originality", "evidence"], strict=True):
            f += "\n" + dim + ":" + lib.gen("judgment", max_tokens=6, stop="END")
        for f in forks:
            s += "\n" + f["judgment"]
        s += "\nScore: " + lib.gen("score", regex=r"[1-9]/10", max_tokens=6)
        s += "\nFinal:" + lib.gen("final", max_tokens=8)

    @lib.function
    def judge(s, question):
        s += (
            "Q: "
            + question
            + "\nIs it true? "
            + lib.select("verdict", choices=["yes", "no", "it depends"])
        )
        s += "\nWhy:" + lib.gen("why", max_tokens=8)

    return review, judge


@pytest.fixture(scope="module", params=["sandboxed", "trusted"])
def server(request, make_tiny, tmp_path_factory):
    # pastry.lang's programs are uploads: sandboxed by default (the regex gen's grammar is
    # held by the host), or trusted
    if request.param == "sandboxed":
        from pastry.runtime import build_pyrt

        try:
            build_pyrt.build()
        except build_pyrt.BuildError as e:
            pytest.skip(f"cannot build the Python runtime component: {e}")
    with running_server(
        make_tiny("llama"),
        tmp_path_factory.mktemp("sgl"),
        trusted_uploads=request.param == "trusted",
    ) as s:
        yield s


def test_sglang_frontend_through_runtime_endpoint_equals_pastry_lang(server):
    url, _ = server
    ours = pl.Endpoint(url)
    try:
        theirs = sgl.RuntimeEndpoint(url)
        for (s_prog, p_prog), kwargs in zip(
            zip(make(sgl), make(pl), strict=True),
            [{"essay": "Cats are better than dogs."}, {"question": "Is water wet?"}],
            strict=True,
        ):
            a = s_prog.run(**kwargs, temperature=0, backend=theirs)
            b = p_prog.run(**kwargs, temperature=0, backend=ours)
            assert a.text() == b.text()
            for name in ("summary", "grade", "score", "verdict", "why", "final"):
                if name in b:
                    assert a[name] == b[name], name
            if "grade" in b:
                import re

                assert re.fullmatch(r"[1-9]/10", b["score"])
                sa = a.get_meta_info("grade")["normalized_prompt_logprobs"]
                sb = b.get_meta_info("grade")["normalized_prompt_logprobs"]
                assert sb == pytest.approx(sa, abs=1e-4)
        batch_a = make(sgl)[1].run_batch(
            [{"question": q} for q in ("a?", "b?", "c?")], temperature=0, backend=theirs
        )
        batch_b = make(pl)[1].run_batch(
            [{"question": q} for q in ("a?", "b?", "c?")], temperature=0, backend=ours
        )
        assert [s.text() for s in batch_a] == [s.text() for s in batch_b]
    finally:
        ours.close()
