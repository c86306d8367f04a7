"""The verifier engine with tiny models: greedy parity, batching, stops, leaks."""

import asyncio

import pytest
import torch

from drafter_service.combined import CombinedProposer
from drafter_service.draft_model import DraftModelProposer
from specd.config import EngineConfig
from specd.lookup import NgramProposer, ngram_propose
from specd.models.loader import load_model
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput
from specd.params import SamplingParams
from specd.proposal import DraftState
from tests.conftest import TEST_DEVICE, make_tiny_pair, run_engine
from verifier_service.engine import Engine
from verifier_service.frontend import AsyncEngine
from verifier_service.request import Request

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9],  # repetitive: n-gram finds matches
    [20, 31, 42, 53, 64, 75, 86],
    [3] * 4 + [11, 12, 13, 14] * 3,
    list(range(40, 90)),
]


def make_engine(tiny_pair, proposer_kind=None, **config):
    target, draft = tiny_pair
    proposer = None
    if proposer_kind == "draft":
        proposer = DraftModelProposer(draft, num_blocks=128, block_size=4)
    elif proposer_kind == "ngram":
        proposer = NgramProposer()
    elif proposer_kind == "combined":
        proposer = CombinedProposer(DraftModelProposer(draft, num_blocks=128, block_size=4))
    cfg = EngineConfig(num_blocks=256, block_size=4, **config)
    return Engine(target, cfg, proposer, eos_ids=set())


def test_ngram_search_worked_example():
    assert ngram_propose([7, 1, 2, 3, 9, 4, 1, 2, 3], 3, max_n=3) == [9, 4, 1]
    assert ngram_propose([1, 2, 3], 3) == []
    assert ngram_propose([4, 5, 4], 5) == [5, 4]  # only what followed the match
    assert ngram_propose([1, 2, 9, 1, 2, 8, 1, 2], 2) == [8, 1]  # most recent match wins


@pytest.mark.parametrize("kind", ["draft", "ngram", "combined"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_parity_speculation_on_vs_off(tiny_pair, kind, k):
    reqs = [dict(prompt=p, max_new_tokens=24) for p in PROMPTS]
    off = run_engine(make_engine(tiny_pair), reqs)
    engine = make_engine(tiny_pair, kind)
    on = run_engine(engine, [dict(r, num_draft=k) for r in reqs])
    assert list(on.values()) == list(off.values())
    assert 0 < engine.totals.accepted < engine.totals.drafted  # speculation really ran
    assert engine.kv.allocator.num_used == 0
    if kind == "ngram":
        assert len(engine.proposer.lookups) == 0  # each sequence's index dropped with it
    else:
        drafter = engine.proposer
        if isinstance(drafter, CombinedProposer):
            drafter = drafter.model
        assert drafter.kv.allocator.num_used == 0
        assert drafter.num_sessions == 0


def test_combined_drafting_uses_ngram_where_text_repeats(tiny_pair):
    _, draft = tiny_pair
    model = DraftModelProposer(draft, num_blocks=128, block_size=4)
    combined = CombinedProposer(model, min_match=3)
    params = SamplingParams()
    repeating = DraftState("a", [5, 6, 7, 8, 9, 5, 6, 7], params, 3)  # [5, 6, 7] seen before
    fresh = DraftState("b", [20, 31, 42, 53], params, 3)
    got = combined.propose([repeating, fresh])
    assert got[0].tokens == [8, 9, 5] and got[0].q_ids is None  # the n-gram continuation
    assert len(got[1].tokens) == 3  # the draft model's
    assert got[0].ngram and not got[1].ngram  # each says where its drafts came from
    assert model.num_sessions == 1  # only the fresh sequence cost a draft forward
    for seq in ("a", "b"):
        combined.close(seq)
    assert model.num_sessions == 0 and model.kv.allocator.num_used == 0


def test_mixed_batch_speculative_and_plain(tiny_pair):
    reqs = [dict(prompt=p, max_new_tokens=20 + i) for i, p in enumerate(PROMPTS)]
    ref = run_engine(make_engine(tiny_pair), reqs)
    engine = make_engine(tiny_pair, "draft")
    mixed = [dict(r, num_draft=k) for r, k in zip(reqs, [0, 2, 4, 1], strict=True)]
    got = run_engine(engine, mixed)
    assert list(got.values()) == list(ref.values())
    assert [len(v) for v in got.values()] == [20, 21, 22, 23]  # max_new_tokens exactly


def test_stop_token_mid_round_cuts_the_rest(tiny_pair):
    ref = run_engine(make_engine(tiny_pair), [dict(prompt=PROMPTS[1], max_new_tokens=30)])
    full = next(iter(ref.values()))
    stop = full[9]
    first = full.index(stop)
    got = run_engine(
        make_engine(tiny_pair, "draft"),
        [dict(prompt=PROMPTS[1], max_new_tokens=30, num_draft=5, stop_ids={stop})],
    )
    assert next(iter(got.values())) == full[: first + 1]


def test_min_tokens_holds_a_stop_token_off_alike_with_speculation(tiny_pair):
    """The stop token the plain output meets at its 3rd token is banned before the 8th:
    the output runs past it, the same with drafts as without, and ends at the first
    stop token after (or at its length)."""
    ref = run_engine(make_engine(tiny_pair), [dict(prompt=PROMPTS[1], max_new_tokens=30)])
    stop = next(iter(ref.values()))[2]
    req = dict(
        prompt=PROMPTS[1], max_new_tokens=30, stop_ids={stop}, params=SamplingParams(min_tokens=8)
    )
    off = next(iter(run_engine(make_engine(tiny_pair), [req]).values()))
    engine = make_engine(tiny_pair, "draft")
    on = next(iter(run_engine(engine, [dict(req, num_draft=4)]).values()))
    assert on == off and engine.totals.drafted > 0
    assert len(off) >= 8 and stop not in off[:-1]
    assert off[-1] == stop or len(off) == 30


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_max_new_tokens_exact(tiny_pair, max_new):
    engine = make_engine(tiny_pair, "ngram")
    got = run_engine(engine, [dict(prompt=PROMPTS[0], max_new_tokens=max_new, num_draft=6)])
    assert len(next(iter(got.values()))) == max_new


def test_preemption_under_kv_pressure_keeps_outputs(tiny_pair):
    reqs = [dict(prompt=p, max_new_tokens=30, num_draft=3) for p in PROMPTS]
    ref = run_engine(make_engine(tiny_pair), [dict(r, num_draft=0) for r in reqs])
    target, draft = tiny_pair
    small = Engine(
        target,
        EngineConfig(num_blocks=40, block_size=4),
        DraftModelProposer(draft, num_blocks=128, block_size=4),
        eos_ids=set(),
    )
    got = run_engine(small, reqs)
    assert list(got.values()) == list(ref.values())
    assert small.kv.allocator.num_used == 0


# the pool bounds it, then the model's context, then --max-model-len
@pytest.mark.parametrize(("num_blocks", "max_model_len"), [(40, 0), (256, 0), (256, 100)])
def test_max_context_is_the_longest_request_the_engine_admits(tiny_pair, num_blocks, max_model_len):
    """What the verifier reports (InfoResponse.max_context, the HTTP card's max_model_len)
    is served: a prompt and generation of that length are admitted, one token more is not."""
    target, _ = tiny_pair
    config = EngineConfig(num_blocks=num_blocks, block_size=4, max_model_len=max_model_len)
    engine = Engine(target, config, eos_ids=set())
    longest = engine.max_context()
    context = max_model_len or target.args.max_position_embeddings
    assert longest == min(4 * num_blocks - 1, context)
    prompt = [7] * (longest - 2)
    engine.add_request(Request(prompt=prompt, max_new_tokens=2))
    with pytest.raises(ValueError):
        engine.add_request(Request(prompt=prompt, max_new_tokens=3))


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_cancel_frees_both_caches(tiny_pair, kind):
    engine = make_engine(tiny_pair, kind)

    async def main():
        gen = AsyncEngine(engine).generate(Request(PROMPTS[3], max_new_tokens=200, num_draft=3))
        seen = 0
        async for out in gen:
            seen += len(out.tokens)
            if seen >= 5:
                break
        await gen.aclose()
        for _ in range(100):  # the loop applies the abort at the next step boundary
            if engine.kv.allocator.num_used == 0 and not engine.has_work():
                break
            await asyncio.sleep(0.01)
        return seen

    assert asyncio.run(main()) >= 5
    assert engine.kv.allocator.num_used == 0
    if kind == "ngram":
        assert len(engine.proposer.lookups) == 0  # the sequence's index dropped with it
    else:
        assert engine.proposer.kv.allocator.num_used == 0 and engine.proposer.num_sessions == 0


def test_bad_requests_are_refused(tiny_pair):
    engine = make_engine(tiny_pair)
    for bad in (
        dict(prompt=[]),
        dict(prompt=[1], max_new_tokens=0),
        dict(prompt=[10_000]),
        dict(prompt=[1], max_new_tokens=10_000),
        dict(prompt=[1], params=SamplingParams(temperature=-1)),
    ):
        with pytest.raises(ValueError):
            engine.add_request(Request(**bad))
    assert not engine.has_work()


def test_batch_invariant_mode_keeps_parity(tiny_pair):
    reqs = [dict(prompt=p, max_new_tokens=16) for p in PROMPTS]
    off = run_engine(make_engine(tiny_pair, batch_invariant=True), reqs)
    on = run_engine(
        make_engine(tiny_pair, "draft", batch_invariant=True), [dict(r, num_draft=4) for r in reqs]
    )
    assert list(on.values()) == list(off.values())


@pytest.mark.parametrize("max_batch_size", [1, 2])
def test_batch_invariant_mode_with_a_full_batch_still_decodes(tiny_pair, max_batch_size):
    # requests waiting for a batch slot must not stop the running ones from decoding
    # (invariant mode never mixes prefill and decode in one forward)
    reqs = [dict(prompt=p, max_new_tokens=12) for p in PROMPTS]
    inv = run_engine(
        make_engine(tiny_pair, batch_invariant=True, max_batch_size=max_batch_size), reqs
    )
    assert all(len(v) == 12 for v in inv.values())
    assert list(inv.values()) == list(run_engine(make_engine(tiny_pair), reqs).values())


def test_a_failing_step_fails_requests_instead_of_hanging(tiny_pair):
    engine = make_engine(tiny_pair, "draft")
    calls = {"n": 0}
    real_forward = engine.model.forward

    def flaky(kv, seqs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return real_forward(kv, seqs)

    async def main():
        engine.model.forward = flaky
        try:
            outs = [
                o
                async for o in AsyncEngine(engine).generate(
                    Request(PROMPTS[0], max_new_tokens=50, num_draft=2)
                )
            ]
        finally:
            del engine.model.forward  # back to the class's method (the model is shared)
        return outs

    outs = asyncio.run(asyncio.wait_for(main(), 30))
    assert outs[-1].finish_reason == "error"
    assert engine.kv.allocator.num_used == 0 and engine.proposer.kv.allocator.num_used == 0


def _calls(obj, name: str) -> list:
    """Record the arguments of every call of obj.name (still calling it)."""
    calls = []
    real = getattr(obj, name)

    def spy(*args):
        calls.append(args)
        return real(*args)

    setattr(obj, name, spy)
    return calls


def _penalised_greedy(model, prompt: list[int], new: int, penalty: float) -> list[int]:
    """Greedy decoding by the model's own forward, one token at a time, each step's
    logits penalised here for every token of the context (transformers' rule: a positive
    logit divided by the penalty, a negative one multiplied)."""
    kv = PagedKV.for_model(model, 64)
    kv.allocator.allocate(0)
    tokens, feed = list(prompt), list(prompt)
    for _ in range(new):
        logits = model.forward(kv, [SeqInput(0, feed)])[-1].float()
        seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
        seen[torch.tensor(tokens)] = True
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        tokens.append(int(torch.where(seen, penalised, logits).argmax()))
        feed = tokens[-1:]
    return tokens[len(prompt) :]


def test_greedy_under_a_repetition_penalty_takes_the_penalised_argmax(tiny_pair):
    """With speculation off and on, a greedy request under a repetition penalty emits
    the argmax of its penalised logits at every step: the reference decodes with the
    model's forward and penalises on its own. (The penalty changes these prompts' output,
    so a verification that skipped it would fail here.)"""
    target, _ = tiny_pair
    params = SamplingParams(repetition_penalty=1.3)
    want = [_penalised_greedy(target, p, 16, 1.3) for p in PROMPTS]
    assert want != [_penalised_greedy(target, p, 16, 1.0) for p in PROMPTS]
    reqs = [dict(prompt=p, params=params, max_new_tokens=16) for p in PROMPTS]
    assert list(run_engine(make_engine(tiny_pair), reqs).values()) == want
    on = run_engine(make_engine(tiny_pair, "draft"), [dict(r, num_draft=3) for r in reqs])
    assert list(on.values()) == want


def _output_penalised_greedy(model, prompt: list[int], new: int, presence, frequency, bias=None):
    """Greedy decoding by the model's own forward, each step's logits moved by `bias`
    ({token: value}), then lowered by OpenAI's rule for every token generated so far:
    frequency per time, presence once."""
    kv = PagedKV.for_model(model, 64)
    kv.allocator.allocate(0)
    out, feed = [], list(prompt)
    for _ in range(new):
        logits = model.forward(kv, [SeqInput(0, feed)])[-1].float().clone()
        for token, value in (bias or {}).items():
            logits[token] += value
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        out.append(int(logits.argmax()))
        feed = out[-1:]
    return out


def _off_chain_tree(tiny_pair, params: SamplingParams, new: int = 16):
    """PROMPTS' greedy outputs under `params`: without drafts, with a draft model's
    chains, and with alternative leaves beside them; and the tree rounds that ran."""
    target, draft = tiny_pair
    reqs = [dict(prompt=p, params=params, max_new_tokens=new) for p in PROMPTS]
    proposer = DraftModelProposer(draft, num_blocks=128, block_size=4, alternatives=3)
    cfg = EngineConfig(num_blocks=256, block_size=4, max_tree_tokens=256, cost_model=False)
    tree = Engine(target, cfg, proposer, eos_ids=set())
    runs = [(make_engine(tiny_pair), 0), (make_engine(tiny_pair, "draft"), 3), (tree, 3)]
    outputs = [
        list(run_engine(engine, [dict(r, num_draft=k) for r in reqs]).values())
        for engine, k in runs
    ]
    return outputs, tree.tree_rounds


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 0.8), (-0.5, 0.6)])
def test_greedy_under_presence_and_frequency_penalties(tiny_pair, presence, frequency):
    """Off, with drafts, and with drafts and alternative leaves (a node counts its own
    path): the argmax of the penalised logits at every step, as a plain reference
    decodes it. (The penalties change these prompts' output.)"""
    target, _ = tiny_pair
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    want = [_output_penalised_greedy(target, p, 16, presence, frequency) for p in PROMPTS]
    assert want != [_output_penalised_greedy(target, p, 16, 0.0, 0.0) for p in PROMPTS]
    outputs, tree_rounds = _off_chain_tree(tiny_pair, params)
    assert outputs == [want] * 3 and tree_rounds > 0


@pytest.mark.parametrize("trimmed", [False, True], ids=["whole-head", "trimmed-head"])
def test_a_drafter_drafts_under_the_requests_penalties(tiny_pair, tmp_path_factory, trimmed):
    """The target drafting for itself: its drafts are the biased, penalised argmax the
    verifier takes, so (nearly) every draft is accepted; a drafter blind to the penalties
    drafts tokens the penalties turned away. Trimmed: its head scores every token in reverse
    order (a drafter's trimmed head maps columns to token ids)."""
    target, _ = tiny_pair
    bias = ((5, 2.0), (7, -100.0), (40, 1.5))
    params = SamplingParams(presence_penalty=1.5, frequency_penalty=0.8, logit_bias=bias)
    reqs = [dict(prompt=p, params=params, max_new_tokens=24, num_draft=4) for p in PROMPTS]
    drafter = target
    if trimmed:
        folder, _ = make_tiny_pair(tmp_path_factory, prefix="trimmed")
        target, drafter = (load_model(folder, dtype="fp32", device=TEST_DEVICE) for _ in "td")
        drafter.trim_head(torch.arange(target.args.vocab_size - 1, -1, -1))
    proposer = DraftModelProposer(drafter, num_blocks=128, block_size=4)
    engine = Engine(target, EngineConfig(num_blocks=256, block_size=4), proposer, eos_ids=set())
    run_engine(engine, reqs)
    assert engine.totals.drafted > 20
    assert engine.totals.accepted >= 0.95 * engine.totals.drafted


def test_greedy_under_a_logit_bias(tiny_pair):
    """A bias that bans the plain answer's most frequent tokens and favours another: off,
    with drafts and with alternative leaves, the argmax of the biased logits at every
    step, as a plain reference decodes it."""
    target, _ = tiny_pair
    plain = [_output_penalised_greedy(target, p, 16, 0.0, 0.0) for p in PROMPTS]
    common = sorted(set(plain[0]), key=plain[0].count)[-2:]
    bias = {t: -100.0 for t in common} | {40: 1.0}
    params = SamplingParams(logit_bias=tuple(bias.items()))
    want = [_output_penalised_greedy(target, p, 16, 0.0, 0.0, bias) for p in PROMPTS]
    assert want != plain and not set(common) & set(want[0])
    outputs, tree_rounds = _off_chain_tree(tiny_pair, params)
    assert outputs == [want] * 3 and tree_rounds > 0


def test_a_greedy_step_takes_every_rows_argmax_in_one_call(tiny_pair, monkeypatch):
    """A step of greedy rounds takes its rows' argmax in one call (on a GPU one kernel
    and one copy back for the step, not one of each a sequence), with the same output."""
    import verifier_service.verify as verify

    calls = []
    real = verify.argmax_rows
    monkeypatch.setattr(verify, "argmax_rows", lambda rows: calls.append(len(rows)) or real(rows))
    reqs = [dict(prompt=p, max_new_tokens=12, num_draft=3) for p in PROMPTS]
    engine = make_engine(tiny_pair, "draft")
    steps = _calls(engine, "step")
    on = run_engine(engine, reqs)
    assert len(calls) <= len(steps)  # at most one a step
    assert max(calls) > 1 + 3  # more rows than one round's
    monkeypatch.undo()
    assert on == run_engine(make_engine(tiny_pair), [dict(r, num_draft=0) for r in reqs])


@pytest.mark.parametrize("k,penalty", [(2, 1.0), (4, 1.0), (3, 1.3)])
def test_greedy_parity_with_alternative_leaves(tiny_pair, k, penalty):
    target, draft = tiny_pair
    params = SamplingParams(repetition_penalty=penalty)  # a node sees its own ancestors
    reqs = [dict(prompt=p, params=params, max_new_tokens=24) for p in PROMPTS]
    off = run_engine(make_engine(tiny_pair), reqs)
    proposer = DraftModelProposer(draft, num_blocks=128, block_size=4, alternatives=k)
    cfg = EngineConfig(
        num_blocks=256, block_size=4, max_tree_tokens=256, batch_invariant=False, cost_model=False
    )
    engine = Engine(target, cfg, proposer, eos_ids=set())
    moved = _calls(engine.kv, "move")
    on = run_engine(engine, [dict(r, num_draft=k) for r in reqs])
    assert list(on.values()) == list(off.values())
    assert moved  # some rounds took a runner-up: its K/V was moved into place
    assert engine.kv.allocator.num_used == 0 and proposer.kv.allocator.num_used == 0


def test_alternatives_are_dropped_when_the_step_is_large(tiny_pair):
    target, draft = tiny_pair
    # lengths differ, so the batch shrinks to one sequence, whose 1 + 3 + 3 tokens fit
    reqs = [dict(prompt=p, max_new_tokens=8 + 8 * i, num_draft=3) for i, p in enumerate(PROMPTS)]
    proposer = DraftModelProposer(draft, num_blocks=128, block_size=4, alternatives=3)
    cfg = EngineConfig(num_blocks=256, block_size=4, max_tree_tokens=8, cost_model=False)
    engine = Engine(target, cfg, proposer, eos_ids=set())
    tree_steps = []
    real = target.forward

    def spy(kv, seqs):
        if any(s.parents is not None for s in seqs):
            tree_steps.append(sum(len(s.tokens) for s in seqs))
        return real(kv, seqs)

    target.forward = spy
    try:
        run_engine(engine, reqs)
    finally:
        del target.forward
    assert tree_steps and max(tree_steps) <= 8
    assert engine.kv.allocator.num_used == 0


@pytest.mark.parametrize("alternatives", [0, 2])
def test_draft_ahead_answers_a_fully_accepted_round_without_the_model(tiny_pair, alternatives):
    _, draft = tiny_pair
    greedy = SamplingParams()
    prompt = PROMPTS[1]

    def fresh(tokens, k):
        p = DraftModelProposer(draft, num_blocks=64, block_size=4, alternatives=alternatives)
        return p.propose([DraftState("s", list(tokens), greedy, k)])[0]

    proposer = DraftModelProposer(draft, num_blocks=64, block_size=4, alternatives=alternatives)
    first = proposer.propose([DraftState("s", list(prompt), greedy, 3)])[0]
    proposer.draft_ahead()
    bonus = fresh(prompt + first.tokens, 1).tokens  # what the drafter guesses comes next
    hyp = prompt + first.tokens + bonus
    calls = _calls(draft, "forward")
    try:
        got = proposer.propose([DraftState("s", hyp, greedy, 3)])[0]
        assert calls == [] and proposer.ahead_hits == 1  # the work was done ahead
        want = fresh(hyp, 3)
        assert (got.tokens, got.alts) == (want.tokens, want.alts)
        # a round that did not accept everything misses, and drafts as usual
        partial = hyp + got.tokens[:1] + [(got.tokens[1] + 1) % draft.args.vocab_size]
        proposer.draft_ahead()
        missed = proposer.propose([DraftState("s", partial, greedy, 3)])[0]
        assert calls and proposer.ahead_hits == 1
        assert missed.tokens == fresh(partial, 3).tokens
        # stopped at once: no forward at all
        calls.clear()
        proposer.draft_ahead(stop=lambda: True)
        assert calls == []
    finally:
        del draft.forward
    proposer.close("s")
    assert proposer.kv.allocator.num_used == 0 and proposer.num_sessions == 0
