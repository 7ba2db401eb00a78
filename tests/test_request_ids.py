"""Request ids and 5xx answers (issue 31, point 1): every answer carries ``X-Request-Id``;
every 5xx is logged under it with its traceback, and its JSON body names it; the client
never sees a traceback."""

from __future__ import annotations

import logging

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pastry.api import ApiError
from pastry.control.constraints import HostConstraint
from pastry.server import errors
from pastry.server.errors import RequestIds, failure_reason
from server_util import running_server

SECRET = "/srv/secret/path.py"


def _app() -> Starlette:
    async def ok(request):
        return JSONResponse({"id": errors.current_request_id()})

    async def boom(request):
        raise RuntimeError(f"exploded in {SECRET}")

    async def json500(request):
        errors.note_failure(f'Traceback (most recent call last):\n  File "{SECRET}", line 1')
        return JSONResponse({"error": {"message": "generation failed: x"}}, 500)

    async def plain503(request):
        return PlainTextResponse("busy", 503)

    async def stream(request):
        async def body():
            yield b"data: 1\n\n"
            errors.note_failure("late failure detail")
            yield b"data: 2\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    routes = [Route(f"/{f.__name__}", f) for f in (ok, boom, json500, plain503, stream)]
    return Starlette(routes=routes, middleware=[Middleware(RequestIds)])


@pytest.fixture
def client():
    with TestClient(_app(), raise_server_exceptions=False) as c:
        yield c


def test_every_answer_has_an_id_and_a_good_client_id_is_kept(client):
    r = client.get("/ok")
    rid = r.headers["x-request-id"]
    assert rid.startswith("req-") and len(rid) == 28
    assert r.json() == {"id": rid}  # the handler sees the same id
    assert client.get("/ok").headers["x-request-id"] != rid
    r = client.get("/ok", headers={"X-Request-Id": "lb-7f3a.2:1"})
    assert r.headers["x-request-id"] == "lb-7f3a.2:1" == r.json()["id"]
    for bad in ("has space", "x" * 65, "semi;colon"):
        r = client.get("/ok", headers={"X-Request-Id": bad})
        assert r.headers["x-request-id"].startswith("req-")


def test_an_exception_is_a_logged_500_without_its_traceback(client, caplog):
    with caplog.at_level(logging.ERROR, logger="pastry.server.errors"):
        r = client.get("/boom")
    rid = r.headers["x-request-id"]
    assert r.status_code == 500
    body = r.json()
    assert body["error"]["request_id"] == rid
    assert body["error"]["type"] == "server_error"
    assert rid in body["error"]["message"]
    assert SECRET not in r.text and "Traceback" not in r.text
    (rec,) = [x for x in caplog.records if rid in x.getMessage()]
    assert rec.exc_info is not None and SECRET in str(rec.exc_info[1])
    assert "GET /boom" in rec.getMessage()


def test_a_5xx_answer_is_logged_with_its_details_and_names_its_id(client, caplog):
    with caplog.at_level(logging.WARNING, logger="pastry.server.errors"):
        r = client.get("/json500")
        r503 = client.get("/plain503")
    rid = r.headers["x-request-id"]
    assert r.json() == {"error": {"message": "generation failed: x", "request_id": rid}}
    assert int(r.headers["content-length"]) == len(r.content)
    (line,) = [x.getMessage() for x in caplog.records if rid in x.getMessage()]
    assert "500 on GET /json500: generation failed: x" in line and SECRET in line
    rid503 = r503.headers["x-request-id"]
    assert r503.status_code == 503 and r503.text == "busy"
    (rec,) = [x for x in caplog.records if rid503 in x.getMessage()]
    assert rec.levelno == logging.WARNING and "503 on GET /plain503" in rec.getMessage()


def test_a_failure_after_the_response_started_is_logged_at_once(client, caplog):
    with caplog.at_level(logging.ERROR, logger="pastry.server.errors"):
        r = client.get("/stream")
    rid = r.headers["x-request-id"]
    assert r.status_code == 200 and r.text == "data: 1\n\ndata: 2\n\n"
    (line,) = [x.getMessage() for x in caplog.records if rid in x.getMessage()]
    assert "late failure detail" in line


def test_failure_reason_is_one_line_without_module_or_frames():
    tb = (
        "Traceback (most recent call last):\n"
        '  File "pastry/runtime/trusted.py", line 150, in _run\n'
        "    result = await inst.program.main(list(inst.args))\n"
        "             ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        '  File "pastry/control/constraints.py", line 213, in _check\n'
        "    raise ApiError(f'grammar error: {self.matcher.get_error()}')\n"
        'pastry.api.ApiError: grammar error: token " badly" doesn\'t satisfy the grammar\n'
        "<state>\n"
        '  "compute_time_us": 98,\n'
        "}\n"
        "</grammar>\n"
    )
    assert (
        failure_reason(tb) == 'ApiError: grammar error: token " badly" doesn\'t satisfy the grammar'
    )
    assert failure_reason("plain message\nsecond line") == "plain message"
    assert failure_reason("") == "unknown error"
    assert len(failure_reason("Error: " + "x" * 1000)) == 300


@pytest.fixture(scope="module")
def served(make_tiny, tmp_path_factory):
    with running_server(make_tiny("llama"), tmp_path_factory.mktemp("rid")) as s:
        yield s


def test_a_failed_built_in_is_a_500_naming_its_request(served, monkeypatch, caplog):
    """A built-in that fails (here: its grammar refuses a token) answers 500 with the
    reason and the request's id; the traceback is in the log under that id."""
    url, server = served

    def refuse(self):
        raise ApiError('grammar error: refused\n<state>\n  "rows": 1,\n}\n</state>')

    monkeypatch.setattr(HostConstraint, "state", refuse)
    model = server.models[0]
    requests = [
        (
            "/v1/completions",
            {"model": model, "prompt": "a", "max_tokens": 4, "guided_regex": "[0-9]+"},
        ),
        (
            "/generate",
            {"text": "a", "sampling_params": {"max_new_tokens": 4, "regex": "[0-9]+"}},
        ),
    ]
    with caplog.at_level(logging.ERROR, logger="pastry.server.errors"):
        answers = [httpx.post(url + path, json=body, timeout=60) for path, body in requests]
    for r in answers:
        rid = r.headers["x-request-id"]
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["request_id"] == rid
        assert error["message"] == (
            f"generation failed: ApiError: grammar error: refused (logged as request {rid})"
        )
        assert "Traceback" not in r.text and "File " not in r.text
        (line,) = [x.getMessage() for x in caplog.records if rid in x.getMessage()]
        assert "Traceback (most recent call last)" in line and "def refuse" not in line
        assert "in refuse" in line  # the frame that raised, in the log only
