"""The compose file validates, and the topology it describes runs as local processes."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from router.client import SpecdClient
from router.policy import Policy
from specd.serving import check_health
from tests.conftest import real_model_or_skip

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
ROLES = ["drafter", "verifier-1", "verifier-2", "router"]


def test_compose_config_validates():
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.fail("docker-compose is missing: `make deploy-tools` installs it")
    for files in ([COMPOSE], [COMPOSE, DEPLOY / "docker-compose.gpu.yml"]):
        args = [a for f in files for a in ("-f", str(f))]
        subprocess.run(
            [tool, *args, "--profile", "observability", "config", "-q"],
            check=True,
            capture_output=True,
            text=True,
        )
    Policy.load(str(DEPLOY / "policy.yaml"))


def local_command(service: dict) -> list[str]:
    """The service's command with compose host names pointing at loopback, its policy
    file at the repository's, and the small real model so the test fits in CI."""
    cmd = []
    for arg in service["command"]:
        for role in ROLES:
            arg = arg.replace(f"{role}:", "127.0.0.1:")
        cmd.append(arg.replace("/etc/specd/policy.yaml", str(DEPLOY / "policy.yaml")))
    for flag in ("--model", "--tokenizer"):
        if flag in cmd:
            cmd[cmd.index(flag) + 1] = "small"
    return cmd


@pytest.mark.real
def test_compose_topology_as_local_processes(tmp_path):
    real_model_or_skip("smollm2-135m-instruct")
    spec = yaml.safe_load(COMPOSE.read_text())["services"]
    procs = []
    try:
        for role in ROLES:
            env = dict(os.environ)
            env.update(
                {
                    k: str(v)
                    for k, v in spec[role]["environment"].items()
                    if k.startswith("SPECD_") and k != "SPECD_CACHE"
                }
            )
            log = open(tmp_path / f"{role}.log", "w")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "specd.cli", *local_command(spec[role])],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            test = spec[role]["healthcheck"]["test"]
            address = test[test.index("health") + 1]
            service = test[test.index("--service") + 1] if "--service" in test else ""
            deadline = time.monotonic() + 120
            while not check_health(address, timeout=0.5, service=service):
                assert procs[-1].poll() is None, (tmp_path / f"{role}.log").read_text()
                assert time.monotonic() < deadline, f"{role} not healthy"
                time.sleep(0.3)
        time.sleep(0.5)  # the router's first load reports
        with SpecdClient("127.0.0.1:50051") as client:
            r = client.generate(
                messages=[{"role": "user", "content": "Say hi."}],
                max_new_tokens=8,
                route="code",
                speculation="on",
            )
        assert r.usage.completion_tokens > 0 and r.route == "code"
        assert r.speculation.enabled and r.speculation.num_draft_tokens == 6
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)
