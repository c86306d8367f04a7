"""A round's penalties, node by node: the frequency and presence penalties count the
output committed before the round and each node's own path through the drafts, so a
draft that repeats the one before it is tested against the penalised target; min_tokens
bans the stop tokens at the nodes that choose a token before it, each by its depth."""

import pytest
import torch

from specd.params import SamplingParams
from specd.proposal import Proposal
from verifier_service.records import Round, Slot
from verifier_service.sequence import Sequence
from verifier_service.verify import verify_rounds

V = 16


def round_of(params: SamplingParams, drafts: list[int], alts=()) -> Round:
    seq = Sequence(0, [1, 2], params, 10, len(drafts), frozenset(), torch.Generator())
    seq.tokens.append(3)  # one token generated before this round (the pending one)
    slot = Slot(seq, (3,), decode=True, k=len(drafts), alts=len(alts))
    return Round(slot, Proposal(tokens=drafts, alts=list(alts)))


def logits(rows: int) -> torch.Tensor:
    """Every row: token 5 first (1.0), token 7 close behind (0.5), the rest far below."""
    out = torch.full((rows, V), -5.0)
    out[:, 5], out[:, 7] = 1.0, 0.5
    return out


@pytest.mark.parametrize(
    "params",
    [SamplingParams(presence_penalty=1.0), SamplingParams(frequency_penalty=1.0)],
    ids=["presence", "frequency"],
)
def test_a_draft_repeating_its_parent_meets_the_penalty_of_its_path(params):
    """Drafts 5, 5: the first matches the root's argmax (5: nothing generated yet holds
    5); at node 1 the path holds 5 once, so 5 drops to 0.0 under 7's 0.5 and the second
    draft is rejected for 7. Without the penalties both are accepted."""
    r = round_of(params, [5, 5])
    verdict = verify_rounds([r], logits(3), V)[0]
    assert verdict.tokens == [5, 7] and verdict.accepted == 1
    plain = verify_rounds([round_of(SamplingParams(), [5, 5])], logits(3), V)[0]
    assert plain.tokens == [5, 5, 5] and plain.accepted == 2


def test_each_node_counts_its_own_path_chain_and_alternative_alike():
    """Chain 5, 7: 5 is accepted at the root; at node 1 (path 5) the penalised argmax is
    7, the second draft; at node 2 (path 5, 7) both are penalised and 5 leads again.
    Chain 7, 7 with the alternative 5 beside the first draft: the chain fails at the
    root, the alternative is taken, and at its node (path 5, not its sibling's 7) the
    bonus is 7."""
    params = SamplingParams(presence_penalty=1.0)
    chain = verify_rounds([round_of(params, [5, 7])], logits(3), V)[0]
    assert chain.tokens == [5, 7, 5] and chain.accepted == 2
    branch = verify_rounds([round_of(params, [7, 7], alts=[(0, 5)])], logits(4), V)[0]
    assert branch.tokens == [5, 7] and branch.accepted == 1 and branch.path == [3]


def min_tokens_round(drafts: list[int], alts=(), min_tokens: int = 3) -> Round:
    """A round after one generated token, with stop token 5 and `min_tokens`: its root
    chooses the 2nd token, node 1 the 3rd, node 2 the 4th."""
    params = SamplingParams(min_tokens=min_tokens, logprobs=1)
    seq = Sequence(0, [1, 2], params, 10, len(drafts), frozenset({5}), torch.Generator())
    seq.tokens.append(3)
    slot = Slot(seq, (3,), decode=True, k=len(drafts), alts=len(alts))
    return Round(slot, Proposal(tokens=drafts, alts=list(alts)))


def test_min_tokens_bans_the_stop_token_at_the_nodes_before_it_only():
    """Every row's argmax is the stop token 5. With min_tokens 3 the root (the 2nd
    token) and node 1 (the 3rd) choose 7, node 2 (the 4th) may stop: drafts 7, 7 are
    both accepted and the bonus is the stop. min_tokens 2 bans the root's alone."""
    verdict = verify_rounds([min_tokens_round([7, 7])], logits(3), V)[0]
    assert verdict.tokens == [7, 7, 5] and verdict.accepted == 2
    # log-probabilities are the raw target's, the banned token still the likeliest
    assert [lp.top_ids[0] for lp in verdict.logprobs] == [5, 5, 5]
    shorter = verify_rounds([min_tokens_round([7, 7], min_tokens=2)], logits(3), V)[0]
    assert shorter.tokens == [7, 5] and shorter.accepted == 1
    plain = verify_rounds([min_tokens_round([7, 7], min_tokens=0)], logits(3), V)[0]
    assert plain.tokens == [5] and plain.accepted == 0


def test_min_tokens_counts_an_alternatives_depth_by_its_path():
    """Chain 5, 5 beside the alternative 7 at the root: the root may not stop, so the
    chain fails and 7 is taken; its node chooses the 3rd token, still banned: 7 again."""
    verdict = verify_rounds([min_tokens_round([5, 5], alts=[(0, 7)])], logits(4), V)[0]
    assert verdict.tokens == [7, 7] and verdict.path == [3]


def test_a_sequence_knows_whether_a_stop_token_ended_it():
    seq = min_tokens_round([]).seq
    assert seq.append([7, 5, 9]) == [7, 5] and seq.finish_reason == "stop"
    assert seq.stopped_at_token
    seq = min_tokens_round([]).seq
    seq.max_new_tokens = 2
    assert seq.append([7]) == [7] and seq.finish_reason == "length"
    assert not seq.stopped_at_token


def test_a_seeded_rounds_tokens_are_its_seeds_at_each_nodes_position():
    """A seeded sampled round, a chain of two and a leaf: each node's token is argmax
    p(x) / E(x) with E its seed's draws at the node's position (the root's: the sequence's
    length; a leaf's: the position after its parent's, where its token will stand)."""
    from specd.draws import position_noise
    from specd.logits import logits_to_probs

    params = SamplingParams(temperature=1.0, seed=7)
    rows = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    p = logits_to_probs(rows, params)
    start = 3  # [1, 2] and the pending 3
    drawn = [
        int((p[i] / position_noise(7, start + d, V)).argmax()) for i, d in enumerate([0, 1, 2, 2])
    ]
    wrong = next(t for t in range(V) if t != drawn[1])
    # the chain's second draft is refused; the leaf beside it is the seed's token there
    r = round_of(params, [drawn[0], wrong], alts=[(1, drawn[1])])
    assert verify_rounds([r], rows.clone(), V)[0].tokens == [drawn[0], drawn[1], drawn[3]]
    # a chain taken whole: its bonus token is the seed's at the position after it
    r = round_of(params, [drawn[0], drawn[1]])
    assert verify_rounds([r], rows[:3].clone(), V)[0].tokens == drawn[:3]
