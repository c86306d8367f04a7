"""Prefix affinity (router/affinity.py, ReplicaSet.choose): a prompt goes to the replica
that was sent its longest prefix, within BALANCE requests of the least loaded; chunk keys
chain every token before them and the cache salt."""

import time

from protos.specd.v1 import verifier_pb2
from router.affinity import BALANCE, CHUNK, PrefixAffinity, chunk_keys
from router.replicas import Replica, ReplicaSet

SYSTEM = list(range(100, 100 + 3 * CHUNK))  # three whole chunks


def test_chunk_keys_chain_every_token_before_them_and_the_salt():
    a = chunk_keys(SYSTEM + [1] * CHUNK)
    b = chunk_keys(SYSTEM + [2] * CHUNK)
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    moved = chunk_keys([7] + SYSTEM[1:] + [1] * CHUNK)  # the first token differs
    assert not set(moved) & set(a)
    assert not set(chunk_keys(SYSTEM, "alice")) & set(chunk_keys(SYSTEM))
    assert chunk_keys(SYSTEM, "alice") == chunk_keys(SYSTEM, "alice")
    assert chunk_keys(SYSTEM[: CHUNK - 1]) == []


def test_the_holders_of_the_longest_prefix_among_the_candidates():
    memory = PrefixAffinity()
    memory.sent(chunk_keys(SYSTEM[: 2 * CHUNK]), "a")
    memory.sent(chunk_keys(SYSTEM), "b")
    asked = chunk_keys(SYSTEM + [5] * CHUNK)
    assert memory.holders(asked, {"a", "b"}) == ({"b"}, 3)
    assert memory.holders(asked, {"a", "c"}) == ({"a"}, 2)
    assert memory.holders(chunk_keys(SYSTEM[:CHUNK]), {"a", "b"}) == ({"a", "b"}, 1)
    assert memory.holders(chunk_keys([9] * CHUNK), {"a", "b"}) == (set(), 0)
    memory.forget("b")
    assert memory.holders(asked, {"a", "b"}) == ({"a"}, 2)


def test_the_least_recently_sent_chunks_are_forgotten_first():
    memory = PrefixAffinity(capacity=4)
    old, new = chunk_keys(SYSTEM), chunk_keys([9] * 2 * CHUNK)
    memory.sent(old, "a")
    memory.sent(new, "b")  # 5 chunks: the oldest, old's first, goes
    assert memory.holders(old, {"a"}) == (set(), 0)
    assert memory.holders(new, {"b"}) == ({"b"}, 2)


def _replicas(queues: dict[str, int], affinity: bool = True) -> ReplicaSet:
    replicas = ReplicaSet([], prefix_affinity=affinity)
    for address, queued in queues.items():
        report = verifier_pb2.LoadReport(kv_blocks_total=100, running=queued)
        replica = Replica(address, None, None, report, time.monotonic(), scope=None)
        replicas.replicas[address] = replica
    return replicas


def test_a_prompt_goes_where_its_prefix_went_unless_that_replica_is_much_busier():
    keys = chunk_keys(SYSTEM)
    replicas = _replicas({"a": 0, "b": 0})
    first = replicas.choose(keys=keys).address
    other = "b" if first == "a" else "a"
    for busy in range(BALANCE + 1):  # the holder busier by up to BALANCE: still chosen
        replicas.replicas[first].report.running = busy
        assert replicas.choose(keys=keys).address == first
    replicas.replicas[first].report.running = BALANCE + 1
    assert replicas.choose(keys=keys).address == other  # now both hold it
    replicas.replicas[first].report.running = 0
    replicas.replicas[other].report.running = 1
    assert replicas.choose(keys=keys).address == first  # the least loaded holder
    assert replicas.choose({first}, keys).address == other  # a retry goes elsewhere
    plain = _replicas({"a": 0, "b": 0}, affinity=False)
    assert {plain.choose(keys=keys).address for _ in range(2)} == {"a", "b"}
