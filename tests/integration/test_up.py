"""`specd up`: three child processes, ready line, a request, clean stop on SIGTERM."""

import signal
import subprocess
import sys
import time

import pytest

from router.client import SpecdClient
from specd.serving import check_health
from tests.conftest import real_model_or_skip

PORTS = {"router": 50151, "verifier": 50162, "drafter": 50161}


@pytest.mark.real
def test_specd_up_starts_serves_and_stops_cleanly():
    real_model_or_skip("smollm2-135m-instruct")
    cmd = [
        sys.executable,
        "-m",
        "specd.cli",
        "up",
        "--target",
        "small",
        "--draft",
        "small",
        "--router-port",
        str(PORTS["router"]),
        "--verifier-port",
        str(PORTS["verifier"]),
        "--drafter-port",
        str(PORTS["drafter"]),
        "--ready-timeout",
        "180",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 200
        for line in proc.stdout:
            lines.append(line)
            if "specd is up" in line or time.monotonic() > deadline:
                break
        assert any("specd is up" in x for x in lines), "".join(lines[-30:])
        ready_text = "".join(lines) + proc.stdout.readline() + proc.stdout.readline()
        assert "specd generate" in ready_text  # a ready-to-paste client command
        with SpecdClient(f"127.0.0.1:{PORTS['router']}") as client:
            # ready means speculating: the verifier waits for its drafter before serving
            r = client.generate(
                messages=[{"role": "user", "content": "Say hi."}],
                max_new_tokens=8,
                speculation="on",
            )
            assert r.usage.completion_tokens > 0
        assert r.speculation.enabled
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0
    for port in PORTS.values():
        assert not check_health(f"127.0.0.1:{port}", timeout=0.5)
