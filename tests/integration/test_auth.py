"""The router's bearer-token check: UNAUTHENTICATED without the token, open health."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.specd.v1 import router_pb2_grpc
from router.auth import BearerTokenInterceptor
from router.client import SpecdClient, build_request
from router.generation import Router
from router.policy import Policy
from router.replicas import ReplicaSet
from router.server import GenerationServicer
from specd.serving import start_server
from tests.cluster import char_tokenizer, start_cluster

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def secured(tiny_pair):
    c = start_cluster(*tiny_pair)

    async def boot():
        replicas = ReplicaSet(c.verifiers)
        await replicas.start()
        await replicas.wait_ready(10)
        servicer = GenerationServicer(Router(char_tokenizer(), replicas, Policy.from_dict({})))
        server, port, _ = await start_server(
            "127.0.0.1",
            0,
            lambda s: router_pb2_grpc.add_GenerationServicer_to_server(servicer, s),
            ["specd.v1.Generation"],
            interceptors=[BearerTokenInterceptor(TOKEN)],
        )
        c.servers["secured"] = server
        c.extra_replicas = replicas
        return f"127.0.0.1:{port}"

    address = c.run(boot())
    yield address
    c.run(c.extra_replicas.close())
    c.close()


def test_requests_need_the_token(secured):
    with SpecdClient(secured) as client:
        for call in (
            lambda md: client.generate("abc", max_new_tokens=3, metadata=md),
            lambda md: list(client.stream("abc", max_new_tokens=3, metadata=md)),
        ):
            for md in (None, [("authorization", "Bearer wrong")]):
                with pytest.raises(grpc.RpcError) as err:
                    call(md)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "bearer token" in err.value.details()
        ok = client.generate(
            "abc", max_new_tokens=3, metadata=[("authorization", f"Bearer {TOKEN}")]
        )
        assert ok.usage.completion_tokens == 3


def test_health_stays_open(secured):
    with grpc.insecure_channel(secured) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        stub = router_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError):
            stub.Generate(build_request("abc", max_new_tokens=2))
