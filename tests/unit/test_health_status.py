"""`specd health`: what a server answers grpc.health.v1, or why it gave no answer."""

from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from launcher.cli import main
from specd.channels import check_health, health_status

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_health_says_what_the_server_answered_or_why_it_did_not(capsys):
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        servicer.set("", SERVING)
        servicer.set("specd.v1.Generation", NOT_SERVING)
        assert health_status(address) == "SERVING" and check_health(address)
        assert health_status(address, service="specd.v1.Generation") == "NOT_SERVING"
        assert not check_health(address, service="specd.v1.Generation")
        assert health_status(address, service="specd.v1.Nothing").startswith("NOT_FOUND: ")
        assert main(["health", address]) == 0 and capsys.readouterr().out == "SERVING\n"
    finally:
        server.stop(0).wait()
    assert health_status(address, timeout=1).startswith("UNAVAILABLE: ")
    assert main(["health", address, "--timeout", "1"]) == 1
    assert capsys.readouterr().out.startswith("UNAVAILABLE: ")
