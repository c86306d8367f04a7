"""Constrained decoding (specd/constraint.py, specd/grammar.py) with speculation: the
grammar state rolls back exactly, proposals are cut where the grammar forbids, every
output keeps to its constraint, greedy is the same with speculation on and off, and
sampling follows the masked target exactly (the engine-level test of
test_engine_exactness.py, with a mask at every position)."""

import json
import re
import subprocess
import sys

import jsonschema
import pytest
import torch
from tokenizers import decoders

from drafter_service.draft_model import DraftModelProposer
from specd.config import EngineConfig
from specd.constraint import Constraint
from specd.grammar import Grammars, _lltokenizer, grammar_tokenizer, mask_q
from specd.lookup import NgramProposer
from specd.models.catalog import DEFAULT_TARGET
from specd.params import SamplingParams
from specd.proposal import Proposal
from tests.cluster import char_tokenizer
from tests.conftest import real_model_or_skip
from tests.unit.test_engine_exactness import chi_square_ok
from verifier_service.engine import Engine
from verifier_service.request import Request

V = 96  # the tiny models' vocabulary: printable ASCII, id = ord(c) - 32
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["id", "tag"],
    "additionalProperties": False,
}


def ids(text: str) -> list[int]:
    return [ord(c) - 32 for c in text]


def text(tokens: list[int]) -> str:
    return "".join(chr(t + 32) for t in tokens)


@pytest.fixture(scope="module")
def grammars():
    return Grammars(char_tokenizer, V)


def test_the_tokenizer_is_loaded_at_the_first_constraint_once():
    loads = []
    grammars = Grammars(lambda: loads.append(1) or char_tokenizer(), V)
    assert loads == []
    for pattern in ("ab[0-9]+c", "x+"):
        grammars.start(Constraint("regex", pattern))
    assert loads == [1]


@pytest.mark.parametrize(
    "name",
    [
        "char",
        "char-wordpiece",  # a decoder llguidance cannot read: each token's bytes instead
        "no-tokenizer-json",  # a byte-level BPE's vocab.json and merges.txt only
        pytest.param("smollm2-135m-instruct", marks=pytest.mark.real),
        pytest.param(DEFAULT_TARGET, marks=pytest.mark.real),
    ],
)
def test_grammars_read_a_folders_tokenizer_json_as_transformers_tokenizer_reads(name, tmp_path):
    """The services' grammars see a folder's tokenizer.json, read without transformers, as
    llguidance.hf sees transformers' tokenizer of it: every token's bytes, and which are
    special (a grammar never allows those)."""
    from transformers import AutoTokenizer

    if name.startswith("char"):
        tokenizer = char_tokenizer()
        if name == "char-wordpiece":
            tokenizer.backend_tokenizer.decoder = decoders.WordPiece()
        tokenizer.save_pretrained(tmp_path)
        folder = tmp_path
    elif name == "no-tokenizer-json":
        vocab = {c: i for i, c in enumerate([*"Ġabcdefgh{}:", "Ġa"])}
        (tmp_path / "vocab.json").write_text(json.dumps(vocab))
        (tmp_path / "merges.txt").write_text("#version: 0.2\nĠ a\n")
        config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "}"}
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        folder = tmp_path
    else:
        folder = real_model_or_skip(name)
    theirs = AutoTokenizer.from_pretrained(folder)
    vocab, eos = len(theirs) + 3, {theirs.eos_token_id or 0}  # as wide as a model's logits
    ours, want = (_lltokenizer(t, vocab, eos) for t in (grammar_tokenizer(folder), theirs))
    assert ours.vocab_size == want.vocab_size == vocab
    for i in range(vocab):
        assert ours.decode_bytes([i]) == want.decode_bytes([i]), i
        assert ours.is_special_token(i) == want.is_special_token(i), i
    if name == "char":  # and a service's first constraint imports no transformers for it
        code = (
            "import sys; from specd.grammar import Grammars, grammar_tokenizer; "
            f"Grammars(lambda: grammar_tokenizer({str(folder)!r}), {vocab}).prepare(); "
            "print('transformers' in sys.modules)"
        )
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert run.stdout.strip() == "False", run.stderr


def test_allowed_follows_the_regex(grammars):
    state = grammars.start(Constraint("regex", "ab[0-9]+c"))
    assert text(state.allowed().nonzero().flatten().tolist()) == "a"
    assert state.consume(ids("ab"))
    assert text(state.allowed().nonzero().flatten().tolist()) == "0123456789"
    assert not state.consume(ids("x"))  # refused, state unchanged
    assert state.consumed == 2 and state.consume(ids("7c")) and state.done


def test_plan_cuts_at_the_first_forbidden_draft_and_leaves_no_trace(grammars):
    state = grammars.start(Constraint("regex", "ab[0-9]+c"))
    before = state.allowed()
    alts = [(0, ids("b")[0]), (1, ids("x")[0]), (2, ids("7")[0]), (3, ids("c")[0])]
    kept, masks = state.plan(Proposal(ids("ab1x2"), alts=alts))
    assert kept.tokens == ids("ab1")  # "x" is not allowed after "ab1"
    # (0, "b") is not allowed at the root, (1, "x") not after "a"; (3, "c") sat beside the
    # cut draft "x"; (2, "7") is a sibling of "1" after "ab"
    assert kept.alts == [(2, ids("7")[0])]
    # node masks: root, a, ab, ab1, then the alternative's node ab7
    expected = []
    for prefix in ["", "a", "ab", "ab1", "ab7"]:
        fresh = grammars.start(Constraint("regex", "ab[0-9]+c"))
        assert fresh.consume(ids(prefix))
        expected.append(fresh.allowed())
    assert torch.equal(masks, torch.stack(expected))
    assert state.consumed == 0 and torch.equal(state.allowed(), before)


def test_mask_q_renormalises_on_the_allowed_tokens():
    q_ids = torch.tensor([[3, 5, 7], [1, 2, 3]])
    q_probs = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]])
    masks = torch.zeros(2, 10, dtype=torch.bool)
    masks[0, [3, 7]] = True
    masks[1, [1, 2, 3]] = True
    out = mask_q(q_ids, q_probs, masks)
    assert torch.allclose(out[0], torch.tensor([0.5 / 0.7, 0.0, 0.2 / 0.7]))
    assert torch.allclose(out[1], q_probs[1])


@pytest.mark.parametrize(
    "kind,value",
    [
        ("regex", "[a-"),
        ("json_schema", "{not json"),
        ("json_schema", '{"type": "objec"}'),
        ("grammar", "start: missing_rule"),
        ("regex", "[^\\s\\S]"),  # matches nothing
        ("kind", "x"),
    ],
)
def test_bad_constraints_are_refused_with_the_library_message(grammars, kind, value):
    with pytest.raises(ValueError) as err:
        grammars.start(Constraint(kind, value))
    assert str(err.value)


def _engine(tiny_pair, proposer_kind: str, alternatives: int = 0):
    target, draft = tiny_pair
    proposer = None
    if proposer_kind == "model":
        proposer = DraftModelProposer(draft, 512, block_size=4, top_m=8, alternatives=alternatives)
    elif proposer_kind == "ngram":
        proposer = NgramProposer()
    # leaves whatever a row costs (the cost model would price them out of a large batch)
    cfg = EngineConfig(num_blocks=1024, block_size=4, max_tree_tokens=1 << 20, cost_model=False)
    return Engine(target, cfg, proposer, eos_ids=set(), load_tokenizer=char_tokenizer)


CONSTRAINTS = [
    Constraint("json_schema", json.dumps(SCHEMA)),
    Constraint("json_object"),
    Constraint("regex", "(cat|dog)s? [0-9]{2,4}!"),
    Constraint("grammar", 'start: "(" item ("," item)* ")"\nitem: /[a-z]{1,3}/ | start'),
]
PROMPTS = [ids("Q: give me a record. A: "), ids("name=x; "), ids("##"), ids("0123 abc")]


def check_finished(constraint: Constraint, out: str) -> None:
    """A finished output is what its constraint describes, checked by other parsers."""
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(out), SCHEMA)
    elif constraint.kind == "json_object":
        assert isinstance(json.loads(out), dict)
    elif constraint.kind == "regex":
        assert re.fullmatch(constraint.text, out)


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: c.kind)
def test_outputs_keep_to_the_constraint_and_greedy_is_the_same_on_and_off(tiny_pair, constraint):
    outputs, finished = {}, 0
    torch.manual_seed(7)  # unseeded requests (a seeded sampled one gets no leaves)
    setups = [("none", 0, 0), ("model", 4, 0), ("model", 3, 2), ("ngram", 4, 0)]
    for proposer, k, alternatives in setups:
        engine = _engine(tiny_pair, proposer, alternatives)
        for temperature in (0.0, 1.0):
            requests = [
                dict(
                    prompt=p,
                    params=SamplingParams(temperature=temperature),
                    max_new_tokens=48,
                    num_draft=k,
                    constraint=constraint,
                )
                for p in PROMPTS
            ]
            ids_ = [engine.add_request(Request(**r)) for r in requests]
            got, reasons = {i: [] for i in ids_}, {}
            while engine.has_work():
                for o in engine.step():
                    got[o.seq_id].extend(o.tokens)
                    if o.finish_reason:
                        reasons[o.seq_id] = o.finish_reason
            for i in ids_:
                assert reasons[i] in ("stop", "length")
                # an unfinished output is a prefix of a valid one: a fresh state takes it
                check = CHECK.start(constraint)
                assert check.consume(got[i]), f"{proposer}: {text(got[i])!r} left the grammar"
                assert (reasons[i] == "stop") == check.done
                if check.done:
                    check_finished(constraint, text(got[i]))
                    finished += 1
            outputs[(proposer, k, alternatives, temperature)] = [got[i] for i in ids_]
        assert engine.kv.allocator.num_used == 0
        if proposer == "model":
            assert engine.totals.drafted > 0
    greedy = [v for (_, _, _, t), v in outputs.items() if t == 0.0]
    assert all(g == greedy[0] for g in greedy), "greedy output depends on speculation"
    assert finished > 0, "no output completed its constraint: the checks above saw nothing"


CHECK = Grammars(char_tokenizer, V)  # fresh states to compare with


def test_rejected_drafts_leave_the_grammar_as_if_never_proposed(tiny_pair):
    """After every step, the verifier's and the drafter's grammar states equal a fresh
    state fed only the committed tokens (same next-token mask, same count)."""
    engine = _engine(tiny_pair, "model", alternatives=2)
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    torch.manual_seed(3)  # sampled, unseeded: a seeded request would get no leaves
    params = SamplingParams(temperature=1.0)
    seq_id = engine.add_request(Request(PROMPTS[0], params, 64, num_draft=4, constraint=constraint))
    seq = engine.sequence(seq_id)
    while engine.has_work():
        engine.step()
        if seq.finish_reason:
            break
        generated = seq.tokens[len(seq.prompt) :]
        fresh = CHECK.start(constraint)
        assert fresh.consume(generated)
        assert seq.grammar.consumed == len(generated)
        assert torch.equal(seq.grammar.allowed(), fresh.allowed())
    assert seq.stats.drafted > seq.stats.accepted > 0  # drafts were rejected along the way


def exact_masked_marginals(model, prompt, params, masks):
    """Marginals of positions 1-3 under the target masked by position (a constraint whose
    allowed set depends only on the position), enumerated as test_engine_exactness does."""
    from tests.unit.test_engine_exactness import next_probs

    def probs(contexts, mask):
        p = next_probs(model, contexts, params) * mask
        return p / p.sum(-1, keepdim=True)

    p1 = probs([prompt], masks[0])[0]
    p2_given = probs([prompt + [a] for a in range(V)], masks[1])
    pair = p1[:, None] * p2_given
    contexts = [prompt + [a, b] for a in range(V) for b in range(V)]
    p3_given = probs(contexts, masks[2]).view(V, V, V)
    return p1, pair.sum(0), (pair[:, :, None] * p3_given).sum((0, 1))


@pytest.mark.parametrize("alternatives", [0, 2], ids=["chain", "tree"])
def test_sampling_follows_the_masked_target(tiny_pair, alternatives):
    target, draft = tiny_pair
    proposer = DraftModelProposer(draft, 2048, block_size=4, top_m=8, alternatives=alternatives)
    cfg = EngineConfig(
        num_blocks=4096,
        block_size=4,
        max_batch_size=256,
        max_batched_tokens=4096,
        max_tree_tokens=1 << 20,
        cost_model=False,  # leaves whatever a row costs
        batch_invariant=False,
    )
    engine = Engine(target, cfg, proposer, eos_ids=set(), load_tokenizer=char_tokenizer)
    regex = "[a-m][a-z0-9][0-9a-f]"
    allowed = []
    for chars in ["abcdefghijklm", "abcdefghijklmnopqrstuvwxyz0123456789", "0123456789abcdef"]:
        m = torch.zeros(V)
        m[ids(chars)] = 1.0
        allowed.append(m)
    prompt, n = [11, 12, 13, 14, 15, 16], 3000
    params = SamplingParams(temperature=1.0)
    out = {}
    torch.manual_seed(500)  # unseeded requests (a seeded one gets no leaves), deterministic
    for _ in range(n):
        constraint = Constraint("regex", regex)
        out[engine.add_request(Request(prompt, params, 4, num_draft=2, constraint=constraint))] = []
    while engine.has_work():
        for o in engine.step():
            out[o.seq_id].extend(o.tokens)
    samples = torch.tensor([tokens[:3] for tokens in out.values()])
    assert engine.totals.drafted > 0 and engine.totals.accepted < engine.totals.drafted
    assert (engine.tree_rounds > 0) == bool(alternatives)  # the tree variant has leaves
    assert engine.kv.allocator.num_used == 0 and proposer.kv.allocator.num_used == 0
    for position, p in enumerate(exact_masked_marginals(target, prompt, params, allowed)):
        counts = torch.bincount(samples[:, position], minlength=V).float()
        assert chi_square_ok(counts, p.cpu(), n), f"position {position + 1}"
