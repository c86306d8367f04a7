"""What llama-server's /slots shows of a request the router relays (router/slots_http.py):
the prompt's tokens found cached and those processed, the tokens decoded, and whether the
text so far holds a line break, as each verifier message arrives."""

from __future__ import annotations

import anyio

from protos.specd.v1 import common_pb2, router_pb2, verifier_pb2
from router.decide import Decision
from router.prepare import Prepared
from router.relay import relay
from router.replicas import Serving
from router.slots_http import _task
from specd.params import SamplingParams


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


class _Call:
    """A verifier's Generate stream: one message a piece of text; `seen`: what the slot
    showed once the router had read each."""

    def __init__(self, tokenizer, pieces: list[str], serving: Serving, cached: int):
        self.tokenizer, self.pieces, self.serving, self.cached = tokenizer, pieces, serving, cached
        self.seen: list[dict] = []

    async def __aiter__(self):
        done = 0
        for i, piece in enumerate(self.pieces):
            ids = self.tokenizer.encode(piece, add_special_tokens=False)
            done += len(ids)
            usage = common_pb2.Usage(prompt_tokens=12, completion_tokens=done)
            usage.cached_prompt_tokens = self.cached
            last = i == len(self.pieces) - 1
            yield verifier_pb2.VerifyGenerateResponse(
                token_ids=ids, usage=usage, finish_reason="length" if last else ""
            )
            self.seen.append(_task(self.serving))

    def cancel(self):
        pass


def test_a_slot_shows_the_cached_prompt_and_a_line_break_once_the_text_holds_one():
    tokenizer = _byte_tokenizer()
    params = SamplingParams()
    serving = Serving(prompt_tokens=12, max_new_tokens=20, params=params)
    prep = Prepared(
        request=router_pb2.GenerateRequest(),
        params=params,
        prompt_ids=[1] * 12,
        route="",
        warnings=[],
        policy=None,
        max_new_tokens=20,
        metadata={},
        deadline=None,
    )
    call = _Call(tokenizer, ["def f", "(x):", "\n    ", "return"], serving, cached=8)

    async def run():
        return [m async for m in relay(call, prep, Decision(0, False, ""), tokenizer, serving)]

    out = anyio.run(run)
    assert "".join(m.text for m in out) == "def f(x):\n    return"
    # the slot as it stood after each message but the last (the request then ended)
    assert [t["next_token"][0]["has_new_line"] for t in call.seen] == [False, False, True]
    assert [t["next_token"][0]["n_decoded"] for t in call.seen] == [5, 9, 14]
    assert {(t["n_prompt_tokens_cache"], t["n_prompt_tokens_processed"]) for t in call.seen} == {
        (8, 4)
    }
