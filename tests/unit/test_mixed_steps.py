"""A prompt that arrives while others decode: where every row of the forward is computed
from its own inputs and cache alone (int4/int8 with the paged attention kernel), its
prefill rides in the decoding batch's step, in batch-invariant mode too, and changes no
token of anyone's output; where it is not (dense weights), prefill and decode keep to
steps of their own."""

import pytest

from drafter_service.draft_model import DraftModelProposer
from specd.config import EngineConfig
from specd.models.loader import load_model
from tests.conftest import make_tiny_pair
from verifier_service.engine import Engine
from verifier_service.request import Request

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [50, 51, 52], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]


@pytest.fixture(scope="module")
def quantised_pair(tmp_path_factory):
    target_dir, draft_dir = make_tiny_pair(tmp_path_factory, prefix="mix")
    return (
        load_model(target_dir, dtype="bf16", device="cpu", weights="int4"),
        load_model(draft_dir, dtype="bf16", device="cpu", weights="int4"),
    )


def _engine(target, draft=None) -> Engine:
    proposer = None if draft is None else DraftModelProposer(draft, num_blocks=256)
    return Engine(target, EngineConfig(num_blocks=256, batch_invariant=True), proposer, set())


def _staggered(engine: Engine, requests: list[Request], every: int = 3):
    """Add a request every `every` steps while the engine runs; -> each request's tokens
    and, per step, the kinds of its slots ({True}: decode only, {False}: prefill only)."""
    kinds, schedule = [], engine.scheduler.schedule

    def recording(*args):
        plan = schedule(*args)
        kinds.append({s.decode for s in plan})
        return plan

    engine.scheduler.schedule = recording
    ids, out, pending, steps = [], {}, list(requests), 0
    while pending or engine.has_work():
        if pending and steps % every == 0:
            ids.append(engine.add_request(pending.pop(0)))
        for o in engine.step():
            out.setdefault(o.seq_id, []).extend(o.tokens)
        steps += 1
    return [out[i] for i in ids], kinds


def _requests(num_draft: int) -> list[Request]:
    return [Request(p, max_new_tokens=20, num_draft=num_draft, ignore_eos=True) for p in PROMPTS]


def test_a_joining_prompt_rides_in_the_decode_step_and_changes_no_token(quantised_pair):
    target, draft = quantised_pair
    assert target.chunk_invariant()
    alone = [_staggered(_engine(target), [r])[0][0] for r in _requests(0)]
    plain, plain_kinds = _staggered(_engine(target), _requests(0))
    drafted, drafted_kinds = _staggered(_engine(target, draft), _requests(3))
    assert plain == alone
    assert drafted == alone  # speculation on: the same tokens, prompts joining mid-round
    for kinds in (plain_kinds, drafted_kinds):
        assert {True, False} in kinds  # a step held both decode and prefill rows


def test_dense_weights_keep_prefill_and_decode_apart(tiny_pair):
    target, _ = tiny_pair
    assert not target.chunk_invariant()
    _, kinds = _staggered(_engine(target), _requests(0))
    assert {True, False} not in kinds
    assert {False} in kinds and {True} in kinds
