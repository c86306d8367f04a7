"""TLS on every hop: drafter <- verifier, verifier <- router, router <- client."""

import datetime
import ipaddress
import json
import ssl
import time
import urllib.error
import urllib.request

import grpc
import pytest

from drafter_service.draft_model import DraftModelProposer
from drafter_service.server import DrafterServicer
from protos.specd.v1 import (
    drafter_pb2_grpc,
    router_pb2_grpc,
    verifier_pb2_grpc,
)
from router.client import SpecdClient
from router.generation import Router
from router.openai_http import OpenAIDoor
from router.openai_http import start as start_http
from router.policy import Policy
from router.replicas import ReplicaSet
from router.server import GenerationServicer
from specd.channels import check_health
from specd.config import EngineConfig
from specd.params import SamplingParams
from specd.proposal import DraftState
from specd.serving import start_server
from tests.cluster import char_tokenizer, start_cluster
from verifier_service.drafter_client import RemoteProposer
from verifier_service.engine import Engine
from verifier_service.frontend import AsyncEngine
from verifier_service.server import VerifierServicer


def self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def tls_stack(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    c = start_cluster(target, draft)  # only for its event loop thread

    async def boot():
        drafter = DrafterServicer(DraftModelProposer(draft, 64, 4), draft.args.vocab_size)
        ds, dport, _ = await start_server(
            "127.0.0.1",
            0,
            lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(drafter, s),
            ["specd.v1.Drafter"],
            tls_cert=cert,
            tls_key=key,
        )
        proposer = RemoteProposer(f"localhost:{dport}", 2000, 100, tls_ca=cert)
        engine = Engine(target, EngineConfig(num_blocks=128, block_size=4), proposer, set())
        verifier = VerifierServicer(AsyncEngine(engine), "tiny")
        vs, vport, _ = await start_server(
            "127.0.0.1",
            0,
            lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(verifier, s),
            ["specd.v1.Verifier"],
            tls_cert=cert,
            tls_key=key,
        )
        replicas = ReplicaSet([f"localhost:{vport}"], tls_ca=cert)
        await replicas.start()
        core = Router(
            char_tokenizer(), replicas, Policy.from_dict({"default": {"min_acceptance": 0}})
        )
        router = GenerationServicer(core)
        # the HTTP door with the same certificate
        door, hport = await start_http(OpenAIDoor(core, "tiny"), "127.0.0.1", 0, cert, key)
        rs, rport, _ = await start_server(
            "127.0.0.1",
            0,
            lambda s: router_pb2_grpc.add_GenerationServicer_to_server(router, s),
            ["specd.v1.Generation"],
            tls_cert=cert,
            tls_key=key,
        )
        c.servers.update(tls_drafter=ds, tls_verifier=vs, tls_router=rs)
        c.tls = dict(
            drafter=dport,
            verifier=vport,
            router=rport,
            replicas=replicas,
            verifier_servicer=verifier,
            cert=cert,
            http=hport,
            door=door,
        )
        assert await replicas.wait_ready(10)

    c.run(boot())
    yield c
    c.run(c.tls["door"].cleanup())
    c.run(c.tls["replicas"].close())
    c.run(c.tls["verifier_servicer"].close())
    c.close()


def test_requests_flow_over_tls_on_every_hop(tls_stack):
    t = tls_stack.tls
    deadline = time.monotonic() + 10
    replica = next(iter(t["replicas"].replicas.values()))
    # the drafter's handshake over TLS, seen by the router in a load report over TLS
    while not (replica.report is not None and replica.report.drafter_available):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with SpecdClient(f"localhost:{t['router']}", tls_ca=t["cert"]) as client:
        r = client.generate("abcabc", max_new_tokens=8, ignore_eos=True, speculation="on")
    assert r.usage.completion_tokens == 8
    assert r.speculation.enabled and r.speculation.drafted > 0


def test_plaintext_clients_are_refused(tls_stack):
    t = tls_stack.tls
    assert check_health(f"localhost:{t['router']}", tls_ca=t["cert"])
    assert not check_health(f"127.0.0.1:{t['router']}", timeout=1.0)
    with SpecdClient(f"127.0.0.1:{t['router']}") as plain:
        with pytest.raises(grpc.RpcError) as err:
            plain.generate("abc", max_new_tokens=2, timeout=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    proposer = RemoteProposer(f"127.0.0.1:{t['drafter']}", 500, 100)  # no CA: no drafter
    states = [DraftState(1, [5, 6, 7], SamplingParams(), 3)]
    assert proposer.propose(states)[0].tokens == []
    proposer.shutdown()


def test_the_http_door_speaks_https_only(tls_stack):
    t = tls_stack.tls
    body = json.dumps({"model": "tiny", "prompt": "abc", "max_tokens": 4}).encode()
    headers = {"content-type": "application/json"}
    trusted = ssl.create_default_context(cafile=t["cert"])
    req = urllib.request.Request(f"https://localhost:{t['http']}/v1/completions", body, headers)
    with urllib.request.urlopen(req, context=trusted, timeout=30) as resp:
        answer = json.loads(resp.read())
    assert answer["usage"]["completion_tokens"] == 4
    plain = urllib.request.Request(f"http://127.0.0.1:{t['http']}/v1/completions", body, headers)
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(plain, timeout=10)
    untrusted = urllib.request.Request(f"https://localhost:{t['http']}/v1/models")
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(untrusted, context=ssl.create_default_context(), timeout=10)
