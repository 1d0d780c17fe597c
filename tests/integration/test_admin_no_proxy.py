"""`shoal alias` and the other admin commands talk to a head on this machine directly:
http_proxy never carries the admin secret away (urllib honours it even for 127.0.0.1 when
no_proxy is unset)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from engine.cli import http as cli_http


class _Recorder(BaseHTTPRequestHandler):
    seen: list[str]

    def do_GET(self) -> None:
        self.seen.append(self.path)
        body = json.dumps({"aliases": {}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _serving() -> tuple[ThreadingHTTPServer, list[str]]:
    seen: list[str] = []
    handler = type("Handler", (_Recorder,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


@pytest.fixture
def head_and_proxy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   ) -> Iterator[tuple[int, list[str], list[str]]]:
    head, head_seen = _serving()
    proxy, proxy_seen = _serving()
    proxy_url = f"http://127.0.0.1:{proxy.server_address[1]}"
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path))
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, proxy_url)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    yield head.server_address[1], head_seen, proxy_seen
    head.shutdown()
    proxy.shutdown()


def test_an_admin_call_to_this_machine_never_goes_through_the_proxy(
        head_and_proxy: tuple[int, list[str], list[str]]) -> None:
    port, head_seen, proxy_seen = head_and_proxy
    assert cli_http.call(f"127.0.0.1:{port}", "GET", "/v1/aliases") == {"aliases": {}}
    assert cli_http.call(f"localhost:{port}", "GET", "/v1/aliases") == {"aliases": {}}
    assert head_seen == ["/v1/aliases", "/v1/aliases"] and proxy_seen == []
