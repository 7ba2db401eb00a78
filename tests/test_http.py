"""HttpClient: allowlist policy (checked before connecting) and HTTP/1.1 against a local server.

Everything runs on loopback: each test starts an asyncio server on 127.0.0.1 (a free port)
that answers by path and records the requests it saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import ssl
import subprocess
from pathlib import Path

import pytest

from pastry.control.http import (
    AllowRule,
    HttpClient,
    HttpDenied,
    HttpError,
    HttpTimeout,
    HttpTooLarge,
)


class Server:
    """A tiny HTTP/1.1 test server; ``routes`` maps a path to raw response bytes or to an
    async function ``(request: dict, writer) -> None`` that writes the response itself."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self.requests: list[dict] = []
        self.connections = 0
        self.ssl_context = ssl_context
        self.port = 0

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(
            self._handle, "127.0.0.1", 0, ssl=self.ssl_context
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        scheme = "https" if self.ssl_context else "http"
        return f"{scheme}://{host}:{self.port}{path}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            request_line, *lines = head.split("\r\n")[:-2]
            method, target, _ = request_line.split(" ")
            headers = {}
            for line in lines:
                name, _, value = line.partition(":")
                headers[name.lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            request = {
                "method": method,
                "target": target,
                "headers": headers,
                "body": body,
                "reader": reader,
            }
            self.requests.append(request)
            route = ROUTES.get(target.split("?")[0], ROUTES["/404"])
            if isinstance(route, bytes):
                writer.write(route)
            else:
                await route(request, writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            writer.close()


async def _echo(request: dict, writer: asyncio.StreamWriter) -> None:
    body = json.dumps(
        {
            "method": request["method"],
            "target": request["target"],
            "headers": request["headers"],
            "body": request["body"].decode("utf-8"),
        }
    ).encode()
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )


async def _slow(request: dict, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
    await writer.drain()
    with contextlib.suppress(TimeoutError):  # until the client gives up and closes
        await asyncio.wait_for(request["reader"].read(), 5)


async def _eof(request: dict, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\n\r\n")
    for part in (b"streamed ", b"until ", b"close"):
        writer.write(part)
        await writer.drain()


ROUTES = {
    "/hello": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello",
    "/echo": _echo,
    "/chunked": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nX-Trailer: t\r\n\r\n"
    ),
    "/eof": _eof,
    "/redirect": b"HTTP/1.1 302 Found\r\nLocation: http://evil.test/steal\r\nContent-Length: 0\r\n\r\n",
    "/big": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100,
    "/bigchunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"20\r\n"
    + b"y" * 32
    + b"\r\n"
    + b"20\r\n"
    + b"y" * 32
    + b"\r\n0\r\n\r\n",
    "/bigeof": b"HTTP/1.1 200 OK\r\n\r\n" + b"z" * 100,
    "/slow": _slow,
    "/latin1": b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=ISO-8859-1\r\n"
    b"Content-Length: 4\r\n\r\ncaf\xe9",
    "/interim": b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "/204": b"HTTP/1.1 204 No Content\r\n\r\n",
    "/truncated": b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
    "/badchunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "/gzipte": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "/badcl": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    "/garbage": b"SSH-2.0-OpenSSH\r\n\r\n",
    "/404": b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found",
}


def run(coro):
    return asyncio.run(coro)


# -- policy ------------------------------------------------------------------------------


def test_allow_rule_parsing():
    assert AllowRule.parse("localhost") == AllowRule(None, "localhost")
    assert AllowRule.parse("127.0.0.1:8080") == AllowRule(None, "127.0.0.1", 8080)
    assert AllowRule.parse("*.Example.com") == AllowRule(None, "example.com", None, True)
    assert AllowRule.parse("https://api.x.com/") == AllowRule("https", "api.x.com")
    assert AllowRule.parse("[::1]:8080") == AllowRule(None, "::1", 8080)
    assert AllowRule.parse("0:0::1") == AllowRule(None, "::1")
    assert str(AllowRule.parse("http://[::1]:80")) == "http://[::1]:80"
    assert str(AllowRule.parse("*.example.com:443")) == "*.example.com:443"
    for bad in (
        "",
        "*",
        "*.1.2.3.4",
        "ftp://x.com",
        "https://x.com/api",
        "user@x.com",
        "x.com:http",
        "x.com:70000",
        "a*.x.com",
        "127.1",
        "[::1",
        "bad host",
    ):
        with pytest.raises(ValueError, match="invalid HTTP allowlist entry"):
            AllowRule.parse(bad)
    with pytest.raises(TypeError):
        HttpClient("localhost")  # type: ignore[arg-type]


def test_check_matches_hosts_ports_and_schemes():
    client = HttpClient(
        ["localhost", "127.0.0.1:8080", "*.example.com", "https://api.x.com", "[::1]:9000"]
    )
    allowed = {
        "http://localhost/": ("localhost", 80, "/"),
        "https://LOCALHOST.:4443/a?b=c#frag": ("localhost", 4443, "/a?b=c"),
        "http://127.0.0.1:8080": ("127.0.0.1", 8080, "/"),
        "http://a.example.com/p": ("a.example.com", 80, "/p"),
        "https://a.b.example.com/p": ("a.b.example.com", 443, "/p"),
        "https://api.x.com/v1/é": ("api.x.com", 443, "/v1/%C3%A9"),
        "http://[0::1]:9000/": ("::1", 9000, "/"),
    }
    for url, (host, port, target) in allowed.items():
        t = client.check(url)
        assert (t.host, t.port, t.target) == (host, port, target), url
    assert client.check("http://[::1]:9000/").host_header == "[::1]:9000"
    assert client.check("https://api.x.com/").host_header == "api.x.com"

    denied = [
        "http://127.0.0.1:8081/",  # wrong port
        "http://127.0.0.2:8080/",
        "http://example.com/",  # the wildcard covers subdomains only
        "http://evilexample.com/",
        "http://example.com.evil.net/",
        "http://api.x.com/",  # entry says https
        "http://localhost@evil.net/",  # userinfo: the host is evil.net
        "http://evil.net@localhost/",  # userinfo even with an allowed host
        "http://user:pw@localhost/",
        "http://2130706433/",  # 127.0.0.1 as one number
        "http://127.1:8080/",
        "http://0x7f.0.0.1:8080/",
        "http://[::ffff:127.0.0.1]:8080/",
        "ftp://localhost/",
        "file:///etc/passwd",
        "javascript:alert(1)",
        "localhost/x",  # no scheme
    ]
    for url in denied:
        with pytest.raises(HttpDenied):
            client.check(url)
    with pytest.raises(
        HttpDenied,
        match=r"host 'evil.net' port 80 \(http\) is not in the HTTP "
        r"allowlist \[localhost, 127.0.0.1:8080, \*.example.com, "
        r"https://api.x.com, \[::1\]:9000\]",
    ):
        client.check("http://evil.net/")
    for url in (
        "http://localhost/a b",
        "http://localhost/a\r\nX-Injected: 1",
        "http://localhost\\@evil.net/",
        "http:///path",
        "http://localhost:99999/",
        "http://local_host!/",
        "http://[::1/",
    ):
        with pytest.raises(ValueError):
            client.check(url)
    with pytest.raises(HttpDenied, match="nothing is allowed"):
        HttpClient([]).check("http://localhost/")


def test_denied_before_any_connection():
    async def main():
        async with Server() as srv:
            client = HttpClient(["localhost"])  # the server is reached as 127.0.0.1: denied
            for url in (srv.url("/hello"), f"http://localhost@127.0.0.1:{srv.port}/hello"):
                with pytest.raises(HttpDenied):
                    await client.get(url)
            with pytest.raises(HttpDenied):
                await client.post(srv.url("/echo"), "data")
            await asyncio.sleep(0.01)
            assert srv.connections == 0

    run(main())


# -- requests ----------------------------------------------------------------------------


def test_get_post_and_headers():
    async def main():
        async with Server() as srv:
            client = HttpClient([f"127.0.0.1:{srv.port}"], user_agent="test-agent")
            r = await client.get(srv.url("/hello"))
            assert (r.status, r.reason, r.body, r.text, r.ok) == (
                200,
                "OK",
                b"hello",
                "hello",
                True,
            )
            assert r.headers["x-a"] == "1, 2" and r.headers["content-length"] == "5"
            assert r.url == srv.url("/hello") and r.location is None

            r = await client.post(srv.url("/echo?q=1"), "héllo", headers={"X-Token": "abc"})
            echo = r.json()
            assert echo["method"] == "POST" and echo["target"] == "/echo?q=1"
            assert echo["body"] == "héllo"
            h = echo["headers"]
            assert h["host"] == f"127.0.0.1:{srv.port}" and h["x-token"] == "abc"
            assert h["content-length"] == "6" and h["content-type"] == "text/plain; charset=utf-8"
            assert h["connection"] == "close" and h["user-agent"] == "test-agent"

            r = await client.post(srv.url("/echo"), b"\x00\x01", headers={"Content-Type": "a/b"})
            assert r.json()["headers"]["content-type"] == "a/b"
            r = await client.request("PUT", srv.url("/echo"))
            assert r.json()["method"] == "PUT" and r.json()["headers"]["content-length"] == "0"
            r = await client.request("HEAD", srv.url("/hello"))
            assert r.status == 200 and r.body == b""

            for bad in (
                {"Host": "evil"},
                {"Content-Length": "1"},
                {"X": "a\r\nB: c"},
                {"a b": "c"},
            ):
                with pytest.raises(ValueError):
                    await client.get(srv.url("/hello"), headers=bad)
            with pytest.raises(ValueError, match="method"):
                await client.request("GE T", srv.url("/hello"))
            assert len(srv.requests) == 5

    run(main())


def test_body_framing_variants():
    async def main():
        async with Server() as srv:
            client = HttpClient(["127.0.0.1"])
            r = await client.get(srv.url("/chunked"))
            assert r.body == b"hello, world" and "content-length" not in r.headers
            assert (await client.get(srv.url("/eof"))).body == b"streamed until close"
            assert (await client.get(srv.url("/latin1"))).text == "café"
            r = await client.get(srv.url("/interim"))
            assert (r.status, r.body) == (200, b"ok") and "link" not in r.headers
            r = await client.get(srv.url("/204"))
            assert (r.status, r.body) == (204, b"")
            r = await client.get(srv.url("/missing"))
            assert (r.status, r.ok, r.text) == (404, False, "not found")
            errors = {
                "/truncated": "closed after 3 of 10 body bytes",
                "/badchunk": "malformed chunk size",
                "/gzipte": "unsupported Transfer-Encoding",
                "/badcl": "invalid Content-Length",
                "/garbage": "malformed status line",
            }
            for path, message in errors.items():
                with pytest.raises(HttpError, match=message):
                    await client.get(srv.url(path))

    run(main())


def test_redirect_is_returned_not_followed():
    async def main():
        async with Server() as srv:
            client = HttpClient(["127.0.0.1"])
            r = await client.get(srv.url("/redirect"))
            assert r.status == 302 and r.location == "http://evil.test/steal"
            assert len(srv.requests) == 1
            with pytest.raises(HttpDenied, match=r"evil\.test"):
                await client.get(r.location)

    run(main())


def test_size_limit():
    async def main():
        async with Server() as srv:
            client = HttpClient(["127.0.0.1"], max_response_bytes=50)
            for path in ("/big", "/bigchunked", "/bigeof"):
                with pytest.raises(HttpTooLarge, match="exceeds the limit of 50 bytes"):
                    await client.get(srv.url(path))
            assert (
                await HttpClient(["127.0.0.1"], max_response_bytes=100).get(srv.url("/big"))
            ).body == b"x" * 100

    run(main())


def test_timeout_and_connection_refused():
    async def main():
        async with Server() as srv:
            client = HttpClient(["127.0.0.1"], timeout=5)
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(HttpTimeout, match=r"within 0\.2 s"):
                await client.get(srv.url("/slow"), timeout=0.2)
            assert loop.time() - start < 2
            port = srv.port
        with pytest.raises(HttpError, match="cannot connect"):
            await client.get(f"http://127.0.0.1:{port}/")

    run(main())


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https(tmp_path: Path):
    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))

    async def main():
        async with Server(ssl_context=server_ctx) as srv:
            client = HttpClient(["localhost", "127.0.0.1"], ssl_context=client_ctx)
            assert (await client.get(srv.url("/hello", host="localhost"))).body == b"hello"
            assert (await client.get(srv.url("/chunked"))).text == "hello, world"
            with pytest.raises(HttpError, match="certificate verify failed"):  # system store
                await HttpClient(["localhost"]).get(srv.url("/hello", host="localhost"))

    run(main())
