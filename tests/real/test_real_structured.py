"""JSON-schema generation on the real default pair in the default configuration (bf16
activations, batch-invariant shapes, alternatives, int4 weights): every finished output
validates against its schema, and greedy output with speculation is token for token the
output without it."""

import json

import jsonschema
import pytest

from bench.prompts import load_items
from drafter_service.draft_model import DraftModelProposer
from specd.config import EngineConfig
from specd.constraint import Constraint
from specd.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specd.models.loader import eos_token_ids, load_config, load_model, load_tokenizer
from tests.conftest import real_model_or_skip
from verifier_service.engine import Engine
from verifier_service.request import Request


def _run(engine, requests):
    ids = [engine.add_request(Request(**r)) for r in requests]
    out, reasons = {i: [] for i in ids}, {}
    while engine.has_work():
        for o in engine.step():
            out[o.seq_id].extend(o.tokens)
            reasons[o.seq_id] = o.finish_reason or reasons.get(o.seq_id)
    return [(out[i], reasons[i]) for i in ids]


@pytest.mark.real
def test_real_pair_json_schema_greedy_identical_and_valid(cpu_kernels):
    target_dir = real_model_or_skip(DEFAULT_TARGET)
    draft_dir = real_model_or_skip(DEFAULT_DRAFT)
    tok = load_tokenizer(target_dir)
    eos = eos_token_ids(target_dir, load_config(target_dir))
    items = load_items("structured")[::2]  # one of each kind of schema
    requests = [
        dict(
            prompt=tok.apply_chat_template(it["messages"], add_generation_prompt=True)["input_ids"],
            max_new_tokens=96,
            constraint=Constraint("json_schema", json.dumps(it["schema"])),
        )
        for it in items
    ]
    target = load_model(target_dir, device="cpu", weights="int4")  # this CPU's activations
    draft = load_model(draft_dir, device="cpu", weights="int4")
    proposer = DraftModelProposer(draft, num_blocks=256, alternatives=4)
    engine = Engine(target, EngineConfig(), proposer, eos_ids=eos, load_tokenizer=lambda: tok)
    off = _run(engine, requests)  # as test_real_formats: one engine, prompts from its cache
    assert engine.totals.rounds == 0  # plain decoding
    on = _run(engine, [dict(r, num_draft=5) for r in requests])
    assert [t for t, _ in on] == [t for t, _ in off]
    finished = 0
    for item, (tokens, reason) in zip(items, on, strict=True):
        if reason == "stop":
            text = tok.decode(tokens, skip_special_tokens=True)
            jsonschema.validate(json.loads(text), item["schema"])
            finished += 1
    assert finished >= len(items) - 1
    assert engine.totals.accepted > 0.5 * engine.totals.drafted
    assert engine.kv.allocator.num_used == 0 and proposer.kv.allocator.num_used == 0


@pytest.mark.real
def test_a_constraint_past_llguidances_limits_ends_the_request_never_loosens(cpu_kernels):
    """llguidance builds a regex's lexer as the text grows, within limits; past them its
    matcher stops for good and would allow only end-of-sequence. The request then ends
    with an error naming the limit (the service's INVALID_ARGUMENT), never "stop" with
    text outside the constraint, and a later request for it is refused at the start."""
    target_dir = real_model_or_skip(DEFAULT_TARGET)
    tok = load_tokenizer(target_dir)
    eos = eos_token_ids(target_dir, load_config(target_dir))
    target = load_model(target_dir, device="cpu", weights="int4")
    engine = Engine(target, EngineConfig(), None, eos_ids=eos, load_tokenizer=lambda: tok)
    constraint = Constraint("regex", "(a{1000}){1000}")  # a million a's
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True
    )["input_ids"]
    seq_id = engine.add_request(Request(prompt, max_new_tokens=100, constraint=constraint))
    tokens, last = [], None
    while engine.has_work():
        for last in engine.step():
            assert last.seq_id == seq_id and last.finish_reason in (None, "error")
            tokens += last.tokens
    assert last.finish_reason == "error" and "beyond llguidance's limits" in last.error
    assert set(tok.decode(tokens)) == {"a"}  # what came was the constraint's text
    assert engine.kv.allocator.num_used == 0
    with pytest.raises(ValueError, match="beyond llguidance's limits"):
        engine.add_request(Request(prompt, max_new_tokens=100, constraint=constraint))
