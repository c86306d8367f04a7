"""The compose file validates, and the topology it describes runs as local processes."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import yaml

from launcher.processes import free_port
from router.client import SpecdClient
from router.policy import Policy
from specd.channels import check_health
from tests.conftest import real_model_or_skip, wait_for

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


def free_ports(spec: dict) -> dict[str, str]:
    """A free loopback port for each port the services listen on: the compose file's
    own numbers lie in the ephemeral range, where a parallel test's socket may hold one."""
    cmds = [spec[role]["command"] for role in ROLES]
    taken = {
        c[i + 1] for c in cmds for i, a in enumerate(c) if a.endswith("-port") or a == "--port"
    }
    ports = {port: str(free_port()) for port in taken}
    assert len(set(ports.values())) == len(ports), ports  # the kernel handed one out twice
    return ports


def local(arg: str, ports: dict[str, str]) -> str:
    """One argument or address as it reads on loopback under `ports`."""
    for role in ROLES:
        arg = arg.replace(f"{role}:", "127.0.0.1:")
    host, colon, port = arg.rpartition(":")
    return f"{host}{colon}{ports[port]}" if port in ports else arg


def local_command(service: dict, ports: dict[str, str]) -> list[str]:
    """The service's command with compose host names pointing at loopback on `ports`, its
    policy file at the repository's, and the small real model so the test fits in CI."""
    cmd = []
    for arg in service["command"]:
        arg = local(arg, ports)
        cmd.append(arg.replace("/etc/specd/policy.yaml", str(DEPLOY / "policy.yaml")))
    for flag in ("--model", "--tokenizer"):
        if flag in cmd:
            cmd[cmd.index(flag) + 1] = "small"
    return cmd


def start_order(spec: dict) -> list[list[str]]:
    """ROLES in waves: each wave's `depends_on` (service_healthy) met by earlier waves."""
    waves, done = [], set()
    while len(done) < len(ROLES):
        wave = [r for r in ROLES if r not in done and set(spec[r].get("depends_on", {})) <= done]
        assert wave, "depends_on has a cycle"
        waves.append(wave)
        done.update(wave)
    return waves


def start(role: str, service: dict, ports: dict[str, str], logs: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(
        {
            k: local(str(v), ports)
            for k, v in service["environment"].items()
            if k.startswith("SPECD_") and k != "SPECD_CACHE"
        }
    )
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    with open(logs / f"{role}.log", "w") as log:  # the child keeps its own copy
        return subprocess.Popen(  # through the image's entrypoint, as the container runs
            ["sh", str(DEPLOY / "entrypoint.sh"), *local_command(service, ports)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.real
def test_compose_topology_as_local_processes(tmp_path):
    real_model_or_skip("smollm2-135m-instruct")
    spec = yaml.safe_load(COMPOSE.read_text())["services"]
    procs: dict[str, subprocess.Popen] = {}
    ports = free_ports(spec)
    try:
        for wave in start_order(spec):  # as compose starts them: after their dependencies
            for role in wave:
                procs[role] = start(role, spec[role], ports, tmp_path)
            for role in wave:
                test = spec[role]["healthcheck"]["test"]
                address = local(test[test.index("health") + 1], ports)
                service = test[test.index("--service") + 1] if "--service" in test else ""
                deadline = time.monotonic() + 120
                while not check_health(address, timeout=0.5, service=service):
                    for name, p in procs.items():
                        assert p.poll() is None, (tmp_path / f"{name}.log").read_text()
                    assert time.monotonic() < deadline, f"{role} not healthy"
                    time.sleep(0.3)
        with SpecdClient(local("router:50051", ports)) as client:
            # until the router's load reports say the drafter is there (its handshake
            # with the verifiers may finish after the router is ready)
            probe = lambda: client.generate("hi", max_new_tokens=1, speculation="on")  # noqa: E731
            wait_for(lambda: probe().speculation.arrival_reason == "on", timeout=30, every=0.2)
            r = client.generate(
                messages=[{"role": "user", "content": "Say hi."}],
                max_new_tokens=8,
                route="code",
                speculation="on",
            )
        assert r.usage.completion_tokens > 0 and r.route == "code"
        assert r.speculation.enabled and r.speculation.num_draft_tokens == 6
        router = spec["router"]["command"]
        port = router[router.index("--http-port") + 1]
        assert f"{port}:{port}" in spec["router"]["ports"]
        with openai.OpenAI(base_url=f"http://127.0.0.1:{ports[port]}/v1", api_key="-") as c:
            model = c.models.list().data[0].id
            chat = c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
            )
        assert chat.usage.completion_tokens > 0
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(20)


def test_the_dockerfile_lints_clean():
    tool = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run(
        [tool, "--failure-threshold", "warning", str(DEPLOY / "Dockerfile")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_entrypoint_fetches_only_into_an_empty_cache(tmp_path):
    bin_dir = tmp_path / "bin"  # a stand-in `specd` that records how it was called
    bin_dir.mkdir()
    fake = bin_dir / "specd"
    fake.write_text('#!/bin/sh\necho "specd $*" >> "$CALLS"\n')
    fake.chmod(0o755)
    calls = tmp_path / "calls"

    def run(cache: Path, fetch: str | None) -> list[str]:
        calls.write_text("")
        env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "CALLS": str(calls)}
        env["SPECD_CACHE"] = str(cache)
        if fetch is not None:
            env["SPECD_FETCH"] = fetch
        cmd = ["sh", str(DEPLOY / "entrypoint.sh"), "serve", "router"]
        subprocess.run(cmd, env=env, check=True, timeout=30)
        return calls.read_text().splitlines()

    empty, filled = tmp_path / "empty", tmp_path / "filled"
    (filled / "models" / "some-model").mkdir(parents=True)
    assert run(empty, None) == ["specd serve router"]  # the image's models: no fetch
    assert run(empty, "none") == ["specd serve router"]
    assert run(empty, "small") == ["specd models fetch small", "specd serve router"]
    assert run(filled, "small") == ["specd serve router"]  # a filled volume is kept


def test_the_image_holds_every_package_the_project_installs():
    """`pip install .` in the image finds only what was copied in: a package left out
    (the launcher, which holds the `specd` command) installs an image that cannot start."""
    import re
    import tomllib

    pyproject = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    copied = set(re.findall(r"^COPY (\w+) \./\1$", (DEPLOY / "Dockerfile").read_text(), re.M))
    assert packages and packages <= copied, packages - copied


def test_the_image_installs_the_locked_versions_of_what_the_project_declares():
    """deploy/requirements.lock pins every runtime dependency at a version pyproject.toml
    allows (a dependency added or raised without `make lock` fails here), torch and its
    CUDA set stay out of it (they come from the torch index), and the image uses it."""
    import re
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    lines = (DEPLOY / "requirements.lock").read_text().splitlines()
    pins = [line for line in lines if line and not line.startswith((" ", "#"))]
    locked = {}
    for line in pins:
        name, _, version = line.partition("==")
        assert version, f"not pinned: {line}"
        locked[canonicalize_name(name)] = version
    assert not [n for n in locked if n == "torch" or n.startswith("nvidia")]
    pyproject = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    for spec in pyproject["project"]["dependencies"]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        assert name in locked, f"{name} is not in deploy/requirements.lock: run make lock"
        assert req.specifier.contains(locked[name]), f"{name}=={locked[name]} but {spec}"
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^COPY deploy/requirements\.lock .*\./$", dockerfile, re.M)
    assert re.search(r"^RUN pip install -c requirements\.lock \.$", dockerfile, re.M)
    assert re.search(r"^RUN pip install --no-deps .*TORCH_SPEC", dockerfile, re.M)
