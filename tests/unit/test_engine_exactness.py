"""Sampling through the whole engine (drafter proposals, sparse q, verification, commit)
emits tokens distributed exactly as the target's: positions 1-3 against the tiny target's
exact marginals, enumerated with batched forwards."""

import math

import pytest
import torch

from drafter_service.draft_model import DraftModelProposer
from specd.config import EngineConfig
from specd.infill_filter import InfillFilter
from specd.logits import bias_row, logits_to_probs
from specd.models.paged_kv import PagedKV
from specd.models.seq_input import SeqInput
from specd.params import SamplingParams
from verifier_service.engine import Engine
from verifier_service.request import Request

PROMPT = [11, 12, 13, 14, 15, 16]
N = 3000


# llama.cpp's infill sampler over the tiny vocabulary: each token's text its decimal
# number ("9" begins "90" to "95"), token 0 the end of generation
INFILL = InfillFilter([b""] + [str(t).encode() for t in range(1, 96)], eog={0}, end=0)


class Tokenizer:
    """What the engine asks of its tokenizer for an infill request (no real one here)."""

    def infill_filter(self):
        return INFILL


def next_probs(model, contexts: list[list[int]], params, banned=frozenset()) -> torch.Tensor:
    """p(. | context) after the request's transforms, for many contexts at once (each
    context's tokens after PROMPT are its output, which the frequency and presence
    penalties count); `banned`: tokens min_tokens keeps out at every position asked; each
    bad word's last token is out where the output ends with its others."""
    kv = PagedKV.for_model(model, num_blocks=len(contexts) * 4 + 8, block_size=4)
    for i in range(len(contexts)):
        kv.allocator.allocate(i)
    logits = model.forward(kv, [SeqInput(i, c) for i, c in enumerate(contexts)])
    logits = logits.clone()
    logits[:, sorted(banned)] = float("-inf")
    for row, c in enumerate(contexts):
        out = c[len(PROMPT) :]
        for *head, last in params.bad_words:
            if not head or out[len(out) - len(head) :] == head:
                logits[row, last] = float("-inf")
    v = logits.shape[-1]
    counts = torch.stack(
        [
            torch.bincount(torch.tensor(c[len(PROMPT) :], dtype=torch.long), minlength=v).float()
            for c in contexts
        ]
    )
    return logits_to_probs(logits, params, counts=counts, bias=bias_row(params, v), infill=INFILL)


def exact_marginals(model, params, banned=frozenset()):
    """Marginals of generated positions 1, 2 and 3 (V = 96: 96^2 contexts at depth 3)."""
    v = model.args.vocab_size
    p1 = next_probs(model, [PROMPT], params, banned)[0]  # [V]
    p2_given = next_probs(model, [PROMPT + [a] for a in range(v)], params, banned)  # [V, V]
    pair = p1[:, None] * p2_given
    contexts = [PROMPT + [a, b] for a in range(v) for b in range(v)]
    p3_given = next_probs(model, contexts, params, banned).view(v, v, v)
    return p1, pair.sum(0), (pair[:, :, None] * p3_given).sum((0, 1))


def chi_square_ok(counts: torch.Tensor, p: torch.Tensor, n: int) -> bool:
    if (counts[p == 0] > 0).any():
        return False  # a token the target can never emit
    expected = p * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    z = 3.719  # one-sided 1e-4 (Wilson-Hilferty)
    return stat <= df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


BIAS = ((5, 2.0), (40, -3.0), (60, 1.0))
ALLOWED = (5, *range(0, 96, 2))  # the reference bans the others itself (next_probs)
BAD_WORDS = ((37,), (93, 40), (43, 39), (16, 35))  # likely after likely, on the tiny pair


@pytest.mark.parametrize(
    "params,alternatives,p_min",
    [
        (SamplingParams(temperature=1.0), 0, 0.0),
        (SamplingParams(temperature=0.8, top_k=12), 0, 0.0),
        (SamplingParams(temperature=1.0), 2, 0.0),  # tree rounds (verifier_service/tree.py)
        # rounds cut short where the drawn draft was unlikely under q (its length depends
        # on the draft: a stopping time, which leaves every position's test exact)
        (SamplingParams(temperature=1.0), 0, 0.2),
        # OpenAI's penalties on the output: each node of a round counts its own path
        (SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.8), 2, 0.0),
        # a logit bias within allowed_token_ids (the drafter drafts under both too)
        (SamplingParams(temperature=1.0, logit_bias=BIAS, allowed_token_ids=ALLOWED), 0, 0.0),
        # min_tokens: the stop tokens (the first position's 3 likeliest) banned at 1-3, and
        # bad words (one token anywhere, a token after another), the drafter not told of
        # either (its q still proposes them)
        (SamplingParams(temperature=1.0, min_tokens=3, bad_words=BAD_WORDS), 2, 0.0),
        # llama.cpp's order and its infill sampler (the drafter draws without the latter;
        # at position 1 it keeps 2 of the 5 tokens top-k leaves)
        (SamplingParams(temperature=0.7, top_k=5, temperature_last=True, infill=True), 0, 0.0),
    ],
    ids=[
        "t1",
        "t0.8-top12",
        "t1-alternatives",
        "t1-p-min",
        "t1-penalties-alternatives",
        "t1-logit-bias-allowed-ids",
        "t1-min-tokens-bad-words-alternatives",
        "t0.7-top5-last-infill",
    ],
)
def test_engine_sampling_follows_the_target(tiny_pair, params, alternatives, p_min):
    target, draft = tiny_pair
    proposer = DraftModelProposer(
        draft, num_blocks=2048, block_size=4, top_m=8, alternatives=alternatives, p_min=p_min
    )
    cfg = EngineConfig(
        num_blocks=4096,
        block_size=4,
        max_batch_size=256,
        max_batched_tokens=4096,
        max_tree_tokens=1 << 20,  # alternatives for the whole batch
        cost_model=False,  # whatever a row costs
        batch_invariant=False,  # which caps trees at one 16-row tile
    )
    engine = Engine(target, cfg, proposer, eos_ids=set())
    engine.grammars = Tokenizer()
    stops = frozenset()
    if params.min_tokens:
        stops = frozenset(next_probs(target, [PROMPT], params)[0].topk(3).indices.tolist())
    samples = torch.zeros(N, 3, dtype=torch.long)
    out = {}
    # unseeded requests (a seeded one gets no tree leaves), each drawing its generator's
    # seed from torch's, fixed here so that the test is deterministic
    torch.manual_seed(1000)
    for _ in range(N):
        request = Request(PROMPT, params, max_new_tokens=4, num_draft=2, stop_ids=stops)
        out[engine.add_request(request)] = []
    while engine.has_work():
        for o in engine.step():
            out[o.seq_id].extend(o.tokens)
    for row, tokens in enumerate(out.values()):
        samples[row] = torch.tensor(tokens[:3])  # position 1 from prefill, 2-3 from a round
    assert engine.totals.drafted > 0 and engine.totals.accepted < engine.totals.drafted
    assert (proposer.cut_rounds > 0) == (p_min > 0)  # p_min cut rounds to one draft
    # leaves were verified with the chains (a leaf wins rarely on the tiny pair, ~1 round
    # in 400: the K/V moves of a won branch are test_engine's greedy-parity test's)
    assert (engine.tree_rounds > 0) == bool(alternatives)
    assert engine.kv.allocator.num_used == 0 and proposer.kv.allocator.num_used == 0
    for *head, last in params.bad_words:  # never drawn, wherever it stands in the output
        word = torch.tensor([*head, last])
        windows = samples.unfold(1, len(word), 1)  # [N, 3 - len + 1, len]
        assert not (windows == word).all(-1).any(), f"bad word {[*head, last]} drawn"
    v = target.args.vocab_size
    banned = stops | (frozenset(range(v)) - frozenset(params.allowed_token_ids or range(v)))
    for position, p in enumerate(exact_marginals(target, params, banned)):
        p = p.cpu()
        counts = torch.bincount(samples[:, position], minlength=v).float()
        assert chi_square_ok(counts, p, N), f"position {position + 1}"


def test_sampling_with_a_predicted_output_follows_the_target(tiny_pair):
    """A client's predicted output drafts without q (specd/prediction.py), verified as any
    deterministic draft: the tokens are the target's whether its drafts are taken or not.
    Predicted: the likeliest first token, then the likeliest after it, twice; a request
    whose first token is another never finds it again within 3 tokens (no drafter here).
    At temperature 0.3 a quarter of the requests start so, and three in four of those
    take the next (the tiny target is flat)."""
    target, _ = tiny_pair
    params = SamplingParams(temperature=0.3)
    predicted = []
    for _ in range(3):
        predicted.append(int(next_probs(target, [PROMPT + predicted], params)[0].argmax()))
    cfg = EngineConfig(
        num_blocks=4096, block_size=4, max_batch_size=256, max_batched_tokens=4096,
        cost_model=False, batch_invariant=False,
    )  # fmt: skip
    engine = Engine(target, cfg, None, eos_ids=set())
    torch.manual_seed(1001)
    out = {}
    for _ in range(N):
        request = Request(PROMPT, params, max_new_tokens=4, num_draft=2, prediction=(*predicted, 7))
        out[engine.add_request(request)] = []
    while engine.has_work():
        for o in engine.step():
            out[o.seq_id].extend(o.tokens)
    totals = engine.totals
    assert 0 < totals.predicted_accepted < totals.predicted_drafted == totals.drafted
    samples = torch.tensor([tokens[:3] for tokens in out.values()])
    v = target.args.vocab_size
    for position, p in enumerate(exact_marginals(target, params)):
        counts = torch.bincount(samples[:, position], minlength=v).float()
        assert chi_square_ok(counts, p.cpu(), N), f"position {position + 1}"
