"""The ports the tests and benchmarks start services on: a port handed out must still be
free when the service binds it seconds later, whatever else binds port 0 meanwhile."""

import socket

from launcher.processes import _ephemeral_low, free_port


def test_free_ports_are_distinct_bindable_and_outside_what_port_0_draws_from():
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(1024 < p < _ephemeral_low() for p in ports)
    # 400 binds of port 0 (what an in-process gRPC server does) never take one of them
    held = []
    try:
        for _ in range(400):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        assert not {s.getsockname()[1] for s in held} & set(ports)
    finally:
        for s in held:
            s.close()
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
