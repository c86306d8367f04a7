"""The llama.cpp peer's server is stopped however it ends: one that ignores SIGTERM (a
llama-server once hung on its way out and kept a core busy after the bench) is killed."""

import os
import signal
import sys

import bench.llamacpp as llamacpp

# a llama-server stand-in: its health and chat endpoints, and no ear for SIGTERM
FAKE = """
import json, os, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[sys.argv.index("--pid-file") + 1], "w").write(str(os.getpid()))


class Handler(BaseHTTPRequestHandler):
    def _reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply({"status": "ok"})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        usage = {"completion_tokens": 1}
        self._reply({"choices": [{"message": {"content": "hi"}}], "usage": usage})

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler).serve_forever()
"""


def test_a_peer_server_deaf_to_sigterm_is_killed_on_the_way_out(tmp_path, monkeypatch):
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\n{FAKE}")
    script.chmod(0o755)
    pid_file = tmp_path / "pid"
    monkeypatch.setattr(llamacpp, "binary", lambda name: script)
    monkeypatch.setitem(llamacpp.VARIANTS, "fake", ["--pid-file", str(pid_file)])
    monkeypatch.setattr(llamacpp, "EXIT_WAIT_S", 0.5)
    try:
        with llamacpp.server("fake", "model.gguf", "", 1, tmp_path) as port:
            assert llamacpp._tokens(port, [{"role": "user", "content": "hi"}], 8) == 1
    finally:  # a server that never wrote its pid never started: the error is the test's
        pid = int(pid_file.read_text()) if pid_file.exists() else None
        alive = pid is not None and _alive(pid)
        if alive:
            os.kill(pid, signal.SIGKILL)
    assert not alive, "the peer server outlived the bench"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False  # gone, and reaped
    return True
