"""The door's cluster for each module here: tiny models on loopback, two replicas, a door
that wants a token and one over a router with no replica; the `openai` SDK and specd's
gRPC client on it."""

import openai
import pytest

from router.client import SpecdClient
from router.generation import Router
from router.openai_http import OpenAIDoor
from router.openai_http import start as start_http
from router.replicas import ReplicaSet
from tests.cluster import TINY_MODEL_ID, char_tokenizer, start_cluster
from tests.integration.openai_api.door import POLICY, TOKEN


@pytest.fixture(scope="module")
def cluster(tiny_pair):
    c = start_cluster(*tiny_pair, policy=POLICY, replicas=2, alternatives=2)

    async def more_doors():
        # a door that wants a token, and one over a router with no replica at all
        secured = OpenAIDoor(c.router_core, TINY_MODEL_ID, token=TOKEN)
        nobody = ReplicaSet([])
        await nobody.start()
        empty = OpenAIDoor(Router(char_tokenizer(), nobody, POLICY), TINY_MODEL_ID)
        doors = [await start_http(secured, "127.0.0.1", 0), await start_http(empty, "127.0.0.1", 0)]
        return doors

    c.doors = c.run(more_doors())
    yield c
    c.run(_cleanup(c.doors))
    c.close()


async def _cleanup(doors):
    for runner, _ in doors:
        await runner.cleanup()


@pytest.fixture
def client(cluster):
    with openai.OpenAI(base_url=f"{cluster.http}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
def grpc_client(cluster):
    with SpecdClient(cluster.router) as c:
        yield c
