"""Wider verification (verifier_service/tree.py): a chain plus alternative leaves.

Statistically: tokens emitted through tree rounds follow the target exactly, for sampled
and deterministic chains, with alternatives chosen from the prefix or from the sampled
draft beside them; a sampled chain verified as if deterministic is caught by the same
test. By hand: greedy walks, parents and K/V moves."""

import pytest
import torch

from specd.params import SamplingParams
from specd.proposal import Proposal
from specd.sampling import logits_to_probs
from tests.unit.test_sampling import fails_exactness
from verifier_service import tree

V, T = 6, 3


def markov_pair(seed: int):
    """A toy target and drafter whose next-token distributions depend on the last token."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, V, generator=g) * 1.5
    target = logits_to_probs(logits, SamplingParams(temperature=1.0))
    draft = torch.softmax(logits + torch.randn(V, V, generator=g) * 1.5, -1)
    return target, draft


def tree_round(last: int, target, draft, k: int, chain: str, alts: str, g) -> list[int]:
    """One round from the token `last`: the drafter's chain and alternatives, then
    verify_tree_sampled. chain: "sampled" (d ~ q), "greedy" (argmax q, one-hot q) or
    "greedy-as-sampled" (argmax q verified as if drawn from q: wrong on purpose).
    alts: "likely" (the most likely token other than d, as the drafter does) or "next"
    ((d + 1) mod V: chosen from the sampled draft itself)."""
    tokens, qs, alternatives, prev = [], [], [], last
    for j in range(k):
        q = draft[prev]
        top = q.topk(2).indices.tolist()
        d = int(torch.multinomial(q, 1, generator=g)) if chain == "sampled" else top[0]
        one_hot = torch.nn.functional.one_hot(torch.tensor(d), V).float()
        qs.append(one_hot if chain == "greedy" else q)
        alt = (top[1] if d == top[0] else top[0]) if alts == "likely" else (d + 1) % V
        alternatives.append((j, alt))
        tokens.append(d)
        prev = d
    proposal = Proposal(tokens=tokens, alts=alternatives)
    node_last = [last] + tokens + [t for _, t in alternatives]  # p at a node: its own token's row
    probs = target[torch.tensor(node_last)]
    emitted, path = tree.verify_tree_sampled(probs, torch.stack(qs), proposal, g)
    assert len(emitted) == len(path) + 1
    return emitted


def generate(target, draft, k: int, chain: str, alts: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(n, T, dtype=torch.long)
    for i in range(n):
        tokens = [0]
        while len(tokens) <= T:
            tokens += tree_round(tokens[-1], target, draft, k, chain, alts, g)
        out[i] = torch.tensor(tokens[1 : T + 1])
    return out


N = 12_000


@pytest.mark.parametrize(
    "k,chain,alts",
    [
        (1, "sampled", "likely"),
        (2, "sampled", "likely"),
        (2, "greedy", "likely"),
        (2, "sampled", "next"),
    ],
)
def test_tree_rounds_emit_the_targets_distribution(k, chain, alts):
    target, draft = markov_pair(seed=k)
    samples = generate(target, draft, k, chain, alts, N, seed=10 + k)
    assert not fails_exactness(samples, target)


def test_a_greedy_chain_verified_as_sampled_is_caught():
    target, draft = markov_pair(seed=2)
    samples = generate(target, draft, 2, "greedy-as-sampled", "likely", N, seed=5)
    assert fails_exactness(samples, target)


def test_greedy_walk_takes_the_alternative_that_matches():
    # chain 7, 8, 9; alternatives: 5 beside 7 (parent 0), 4 beside 9 (parent 2)
    proposal = Proposal(tokens=[7, 8, 9], alts=[(0, 5), (2, 4)])
    # nodes: 0 root, 1..3 chain, 4 = alt 5, 5 = alt 4
    argmax = [5, 8, 9, 1, 6, 2]  # root wants 5 -> alt node 4, whose argmax 6 is the bonus
    assert tree.verify_tree_greedy(argmax, proposal) == ([5, 6], [4])
    argmax = [7, 8, 4, 1, 0, 3]  # chain 7, 8, then 4 (alt node 5), bonus 3
    assert tree.verify_tree_greedy(argmax, proposal) == ([7, 8, 4, 3], [1, 2, 5])
    argmax = [7, 8, 9, 1, 0, 0]  # the whole chain and its bonus
    assert tree.verify_tree_greedy(argmax, proposal) == ([7, 8, 9, 1], [1, 2, 3])
    assert tree.moves(100, [1, 2, 5]) == [(105, 103)]
    assert tree.moves(100, [4]) == [(104, 101)]
    assert tree.tree_parents(1, proposal) == [-1, 0, 1, 2, 0, 2]


def test_a_tree_forward_gives_each_node_its_own_paths_logits(tiny_pair):
    from specd.models.paged_kv import PagedKV, SeqInput

    target, _ = tiny_pair
    context = [5, 9, 14, 2, 33, 7]
    proposal = Proposal(tokens=[40, 41, 42], alts=[(0, 50), (1, 51), (2, 52)])
    fed = context[-1:] + tree.node_tokens(proposal)

    kv = PagedKV.for_model(target, num_blocks=64, block_size=4)
    kv.allocator.allocate("tree")
    target.forward(kv, [SeqInput("tree", context[:-1], 0)])
    parents = tree.tree_parents(1, proposal)
    got = target.forward(kv, [SeqInput("tree", fed, len(fed), parents)])  # [7, V]

    for node, path in enumerate(tree.node_paths(proposal)):
        ref_kv = PagedKV.for_model(target, num_blocks=64, block_size=4)
        ref_kv.allocator.allocate(0)
        want = target.forward(ref_kv, [SeqInput(0, context + path)])[0]
        torch.testing.assert_close(got[node], want, rtol=1e-4, atol=1e-4)

    # after taking node 5 (the alternative 51 beside 41: path 40, 51), moving its K/V to
    # the chain's second slot makes the cache the one a chain 40, 51 would have left
    root = len(context) - 1
    kv.move("tree", tree.moves(root, [1, 5]))
    kv.allocator.truncate_to("tree", root + 3)
    nxt = target.forward(kv, [SeqInput("tree", [60])])[0]
    ref_kv = PagedKV.for_model(target, num_blocks=64, block_size=4)
    ref_kv.allocator.allocate(0)
    want = target.forward(ref_kv, [SeqInput(0, context + [40, 51, 60])])[0]
    torch.testing.assert_close(nxt, want, rtol=1e-4, atol=1e-4)
