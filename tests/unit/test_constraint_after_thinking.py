"""A constraint held after a reasoning model's thinking (Constraint.after_thinking, the
router's --reasoning-parser): any text while the output thinks, the constraint's own
mask from "</think>" on, with speculation as exact as under any constraint. And vLLM's
structural tags, free text around structures its triggers open, built the same way."""

import json

import pytest
import torch

from specd.constraint import Constraint, structural_tag_grammar
from specd.params import SamplingParams
from specd.wire import constraint_from_proto, constraint_to_proto
from tests.unit.test_constraint import CHECK, PROMPTS, SCHEMA, V, _engine, ids, text
from verifier_service.request import Request

JSON = json.dumps(SCHEMA)
RECORD = '{"id": 7, "tag": "red"}'


def allowed_text(state) -> str:
    return text(state.allowed().nonzero().flatten().tolist())


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_the_constraint_holds_from_the_close_of_the_thinking(parser):
    """While it thinks every character may come ("{", "</thin" included); from
    "</think>" on, exactly what the schema allows from its start; then the record."""
    plain = CHECK.start(Constraint("json_schema", JSON))
    state = CHECK.start(Constraint("json_schema", JSON, parser))
    opened = "" if parser == "deepseek_r1" else " <think>"
    assert state.consume(ids(opened + "the id is 7 {or 8} </thin"))
    assert state.allowed().all() and not state.done
    assert state.consume(ids("k>"))
    assert torch.equal(state.allowed(), plain.allowed())
    assert not state.consume(ids("the answer"))  # past the thinking, only the schema's
    assert state.consume(ids(RECORD)) and state.done


def test_deepseek_r1_thinks_from_the_start_qwen3_only_after_an_opening_tag():
    """deepseek_r1: a record with no "</think>" before it is still thinking. qwen3: the
    output opens with <think> (whitespace aside) or is the answer itself."""
    r1 = CHECK.start(Constraint("json_schema", JSON, "deepseek_r1"))
    assert allowed_text(r1) == text(range(V))
    assert r1.consume(ids(RECORD)) and not r1.done
    qwen3 = CHECK.start(Constraint("json_schema", JSON, "qwen3"))
    plain = CHECK.start(Constraint("json_schema", JSON))
    assert sorted(allowed_text(qwen3)) == sorted(" <" + allowed_text(plain))
    assert qwen3.consume(ids(RECORD)) and qwen3.done


def test_the_output_may_end_while_it_thinks_and_once_the_answer_is_complete():
    """The end of sequence may come while the output thinks, as it may without a
    constraint, then not until the answer is complete (llguidance's accepting state)."""
    state = CHECK.start(Constraint("regex", "[0-9]+", "deepseek_r1"))
    assert state.matcher.is_accepting() and state.consume(ids("so: </think>"))
    assert not state.matcher.is_accepting() and state.consume(ids("42"))
    assert state.matcher.is_accepting()


@pytest.mark.parametrize(
    "kind,value,answer",
    [("regex", "(cat|dog)s? [0-9]{2}", "cats 12"), ("grammar", 'start: "yes" | "no"', "no")],
)
def test_every_kind_of_constraint_waits_for_the_thinking(kind, value, answer):
    state = CHECK.start(Constraint(kind, value, "deepseek_r1"))
    assert state.consume(ids("maybe yes, maybe no</think>"))
    assert not state.consume(ids("maybe")) and state.consume(ids(answer)) and state.done


def test_an_answer_that_admits_nothing_is_refused_at_the_start():
    for after in ("", "deepseek_r1"):
        with pytest.raises(ValueError, match="admits no output"):
            CHECK.start(Constraint("regex", "[^\\s\\S]", after))
    with pytest.raises(ValueError, match="after_thinking"):
        Constraint("regex", "a", "r2").grammar()


def _greedy(engine, requests) -> list[list[int]]:
    seq_ids = [engine.add_request(Request(**r)) for r in requests]
    got = {i: [] for i in seq_ids}
    while engine.has_work():
        for o in engine.step():
            got[o.seq_id].extend(o.tokens)
    assert engine.kv.allocator.num_used == 0
    return [got[i] for i in seq_ids]


def test_greedy_thinking_is_the_unconstrained_output_with_speculation_on_and_off(tiny_pair):
    """Under deepseek_r1 the tiny model's greedy output never closes its thinking, so a
    schema held after the thinking leaves it as it is without one: token for token, with
    no drafter, a draft model (chain and tree) and n-grams."""
    constraint = Constraint("json_schema", JSON, "deepseek_r1")
    outputs = set()
    for proposer, k, alternatives in [
        ("none", 0, 0),
        ("model", 4, 0),
        ("model", 3, 2),
        ("ngram", 4, 0),
    ]:
        for c in (None, constraint):
            engine = _engine(tiny_pair, proposer, alternatives)
            requests = [
                dict(
                    prompt=p, params=SamplingParams(), max_new_tokens=32, num_draft=k, constraint=c
                )
                for p in PROMPTS
            ]
            outputs.add(tuple(map(tuple, _greedy(engine, requests))))
    assert len(outputs) == 1, "the thinking depends on the constraint or on speculation"
    (greedy,) = outputs
    assert all("</think>" not in text(out) for out in greedy)
    assert any(not set(text(out)) <= set(RECORD) for out in greedy)  # text the schema forbids


def test_qwen3_thinks_only_where_the_output_opens_a_thought(tiny_pair):
    """Under qwen3 the tiny model's greedy outputs either open with <think> (whitespace
    aside; then free text) or keep to the schema from the first token: both occur, the
    same with speculation on and off."""
    constraint = Constraint("json_schema", JSON, "qwen3")
    outputs = set()
    for proposer, k in [("none", 0), ("model", 4), ("ngram", 4)]:
        params = dict(params=SamplingParams(), max_new_tokens=48, num_draft=k)
        requests = [dict(prompt=p, constraint=constraint, **params) for p in PROMPTS]
        outputs.add(tuple(map(tuple, _greedy(_engine(tiny_pair, proposer), requests))))
    assert len(outputs) == 1
    forms = set()
    for out in next(iter(outputs)):
        head = text(out).lstrip()
        if "<think>".startswith(head) or head.startswith("<think>"):
            forms.add("thinking")
            assert "</think>" not in head
        else:
            forms.add("answer")
            assert CHECK.start(Constraint("json_schema", JSON)).consume(list(out)), text(out)
    assert forms == {"thinking", "answer"}


def test_the_wire_carries_it_to_the_verifier_and_on_to_the_drafter():
    """The router's proto, and the verifier's to its drafter (which drafts under the same
    mask), keep `after_thinking` with every kind."""
    for kind, value in [("json_schema", JSON), ("json_object", ""), ("regex", "a+")]:
        for after in ("", "deepseek_r1", "qwen3"):
            c = Constraint(kind, value, after)
            assert constraint_from_proto(constraint_to_proto(c)) == c


TAGS = [("<f=get>", {"type": "integer"}, "</f>"), ("<f=put>", None, "</f>")]


@pytest.mark.parametrize(
    "output,kept",
    [
        ("plain text, no trigger", True),
        ("call <f=get>42</f> then more", True),
        ('<f=get>7</f><f=put>{"a": [1]}</f>', True),
        ("cut short at <f", True),  # a trigger not yet whole is still text
        ("call <f=oops", False),  # a trigger opens one of the structures
        ("call <f=get>x", False),  # and its JSON keeps to the schema
    ],
)
def test_structural_tags_free_text_until_a_trigger_opens_a_structure(output, kept):
    """vLLM's structural tags: any text without the trigger; the trigger opens a structure
    (its begin, JSON its schema allows, its end); the output may end in free text only."""
    grammar = structural_tag_grammar(TAGS, ["<f="])
    state = CHECK.start(Constraint("grammar", grammar))
    assert state.consume(ids(output)) is kept
    if kept:
        assert state.matcher.is_accepting()
    opened = CHECK.start(Constraint("grammar", grammar))
    assert opened.consume(ids("x <f=get>4")) and not opened.matcher.is_accepting()


def test_a_structure_whose_begin_no_trigger_opens_is_refused():
    with pytest.raises(ValueError, match="starts with none of the triggers"):
        structural_tag_grammar([("<g>", None, "</g>")], ["<f="])
    with pytest.raises(ValueError, match="triggers"):
        structural_tag_grammar(TAGS, [""])
