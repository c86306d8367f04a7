"""The router's check of a request's token limits (router/prepare.py): the default where a
request names none, and a cap only where the operator sets one; otherwise the verifier
bounds a request by what it serves (its context and KV pool: test_engine.py)."""

import grpc
import pytest

from protos.specd.v1.router_pb2 import GenerateRequest
from router.policy import Policy
from router.prepare import Preparer, RequestError
from tests.cluster import char_tokenizer


def test_max_new_tokens_is_capped_only_where_the_operator_says():
    uncapped = Preparer(char_tokenizer(), Policy.builtin(), 256, 0)
    assert uncapped.prepare(GenerateRequest(prompt="ab"), {}).max_new_tokens == 256
    many = GenerateRequest(prompt="ab", max_new_tokens=100_000)
    assert uncapped.prepare(many, {}).max_new_tokens == 100_000
    capped = Preparer(char_tokenizer(), Policy.builtin(), 256, 100)
    at_cap = GenerateRequest(prompt="ab", max_new_tokens=100)
    assert capped.prepare(at_cap, {}).max_new_tokens == 100
    for preparer, over in ((capped, 101), (uncapped, -1)):
        with pytest.raises(RequestError) as err:
            preparer.prepare(GenerateRequest(prompt="ab", max_new_tokens=over), {})
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_new_tokens" in str(err.value)
