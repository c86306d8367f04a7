"""Wider verification: a chain plus alternative leaves, verified by the same batched
functions as a chain (specd.sampling; the tree's shape in verifier_service/tree.py).

Statistically: tokens emitted through tree rounds follow the target exactly, for sampled
and deterministic chains, with alternatives chosen from the prefix or from the sampled
draft beside them; a sampled chain verified as if deterministic is caught by the same
test. Against a slow walk of the tree written node by node, on the same random draws. By
hand: greedy walks, parents and K/V moves."""

import pytest
import torch

from specd.draws import position_noise
from specd.logits import logits_to_probs
from specd.params import SamplingParams
from specd.proposal import Proposal
from specd.sampling import Alternatives, greedy_round, rejection_sample
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
    the batched sampler (verify_one). chain: "sampled" (d ~ q), "greedy" (argmax q,
    one-hot q) or "greedy-as-sampled" (argmax q verified as if drawn from q: wrong on purpose).
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
    u, noise = torch.rand(k, generator=g), torch.empty(V).exponential_(generator=g)
    alt_u = torch.rand(len(alternatives), generator=g)
    emitted, path = verify_one(probs, torch.stack(qs), proposal, u, noise, alt_u)
    assert len(emitted) == len(path) + 1
    return emitted


def alternatives_of(proposal: Proposal, uniforms: torch.Tensor) -> Alternatives:
    """One sequence's alternatives in the batched layout [1, A]."""
    tokens = torch.tensor([t for _, t in proposal.alts], dtype=torch.long).view(1, -1)
    parents = torch.tensor([p for p, _ in proposal.alts], dtype=torch.long).view(1, -1)
    return Alternatives(tokens, parents, uniforms[None])


def verify_one(probs, q, proposal: Proposal, u, noise, alt_u):
    """One sequence through the batched sampler: (emitted tokens, accepted node path)."""
    k = len(proposal.tokens)
    drafts = torch.tensor([proposal.tokens], dtype=torch.long)
    out = rejection_sample(
        probs[None], drafts, q[None], torch.tensor([k]), u[None], noise[None],
        alternatives_of(proposal, alt_u),
    )  # fmt: skip
    a, taken = int(out.accepted[0]), int(out.alternative[0])
    return out.tokens[0, : a + 1].tolist(), tree.accepted_path(k, a, taken)


def walk(probs, q, proposal: Proposal, u, noise, alt_u):
    """The slow reference: walk the tree node by node as iterative speculative sampling
    states it; the chain child first (its q), then the alternatives (q one-hot)."""
    k = len(proposal.tokens)
    kids = {j: [j + 1] for j in range(k)} | {k: []}
    for i, (parent, _) in enumerate(proposal.alts):
        kids[parent].append(k + 1 + i)
    tokens = list(proposal.tokens) + [t for _, t in proposal.alts]
    draws = list(u) + list(alt_u)  # node n's test uses draws[n - 1]
    node, path = 0, []
    while True:
        p, accepted = probs[node], None
        for child in kids.get(node, []):
            x = tokens[child - 1]
            q_x = float(q[child - 1, x]) if child <= k else 1.0
            if float(draws[child - 1]) * q_x < float(p[x]):
                accepted = child
                break
            residual = (p - q[child - 1]).clamp(min=0) if child <= k else p.clone()
            if child > k:
                residual[x] = 0.0
            if residual.sum() > 0:
                p = residual / residual.sum()
        if accepted is None:
            return [tokens[n - 1] for n in path] + [int((p / noise).argmax())], path
        path.append(accepted)
        node = accepted


def generate(target, draft, k: int, chain: str, alts: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(n, T, dtype=torch.long)
    for i in range(n):
        tokens = [0]
        while len(tokens) <= T:
            tokens += tree_round(tokens[-1], target, draft, k, chain, alts, g)
        out[i] = torch.tensor(tokens[1 : T + 1])
    return out


# sized by power: at 3,000 sequences the planted bug below (a greedy chain verified as if
# sampled) already puts each statistic at 4-9 times its critical value (seeds 5-7)
N = 4_000


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


def test_batched_tree_verification_matches_the_slow_walk():
    """Random trees (alternatives at random parents, some duplicating the chain's token),
    the batched sampler and the node-by-node walk fed the same draws."""
    g = torch.Generator().manual_seed(3)
    for trial in range(300):
        k = int(torch.randint(1, 5, (1,), generator=g))
        n_alts = int(torch.randint(0, 5, (1,), generator=g))
        sharp = 1.0 + trial % 3  # flatter and sharper targets: more and fewer rejections
        probs = torch.softmax(torch.randn(1 + k + n_alts, V, generator=g) * sharp, -1)
        q = torch.softmax(torch.randn(k, V, generator=g) * sharp, -1)
        chain = torch.multinomial(q, 1, generator=g)[:, 0].tolist()
        alts = [
            (
                int(torch.randint(0, k, (1,), generator=g)),
                int(torch.randint(0, V, (1,), generator=g)),
            )
            for _ in range(n_alts)
        ]
        proposal = Proposal(tokens=chain, alts=alts)
        u, noise = torch.rand(k, generator=g), torch.empty(V).exponential_(generator=g)
        alt_u = torch.rand(n_alts, generator=g)
        args = (probs, q, proposal, u, noise, alt_u)
        assert verify_one(*args) == walk(*args), trial


def test_seeded_trees_are_deterministic_and_independent_of_their_neighbours():
    from specd.draws import draw_randomness, make_generator

    g = torch.Generator().manual_seed(4)
    n, k, n_alts = 3, 3, 2
    probs = torch.softmax(torch.randn(n, 1 + k + n_alts, V, generator=g), -1)
    q = torch.softmax(torch.randn(n, k, V, generator=g), -1)
    drafts = q.argmax(-1)
    alt_tokens = (drafts[:, :n_alts] + 1) % V
    parents = torch.tensor([[0, 1]] * n)

    def run(seeds):
        gens = [make_generator(s) for s in seeds]
        u, noise, alt_u = draw_randomness(gens, [k] * n, V, [n_alts] * n)
        alts = Alternatives(alt_tokens, parents, alt_u)
        return rejection_sample(probs, drafts, q, torch.tensor([k] * n), u, noise, alts).tokens

    assert torch.equal(run([1, 2, 3]), run([1, 2, 3]))
    assert not torch.equal(run([1, 2, 3]), run([4, 5, 6]))
    assert torch.equal(run([7, 2, 3])[0], run([7, 8, 9])[0])


def greedy_one(argmax: list[int], proposal: Proposal):
    k = len(proposal.tokens)
    tokens, a, taken = greedy_round(argmax, proposal.tokens, proposal.alts)
    return tokens, tree.accepted_path(k, a, taken)


def test_greedy_walk_takes_the_alternative_that_matches():
    # chain 7, 8, 9; alternatives: 5 beside 7 (parent 0), 4 beside 9 (parent 2)
    proposal = Proposal(tokens=[7, 8, 9], alts=[(0, 5), (2, 4)])
    # nodes: 0 root, 1..3 chain, 4 = alt 5, 5 = alt 4
    argmax = [5, 8, 9, 1, 6, 2]  # root wants 5 -> alt node 4, whose argmax 6 is the bonus
    assert greedy_one(argmax, proposal) == ([5, 6], [4])
    argmax = [7, 8, 4, 1, 0, 3]  # chain 7, 8, then 4 (alt node 5), bonus 3
    assert greedy_one(argmax, proposal) == ([7, 8, 4, 3], [1, 2, 5])
    argmax = [7, 8, 9, 1, 0, 0]  # the whole chain and its bonus
    assert greedy_one(argmax, proposal) == ([7, 8, 9, 1], [1, 2, 3])
    argmax = [7, 3, 9, 1, 0, 0]  # stops at node 1: no alternative hangs there
    assert greedy_one(argmax, proposal) == ([7, 3], [1])
    assert tree.moves(100, [1, 2, 5]) == [(105, 103)]
    assert tree.moves(100, [4]) == [(104, 101)]
    assert tree.tree_parents(1, proposal) == [-1, 0, 1, 2, 0, 2]


def test_a_tree_forward_gives_each_node_its_own_paths_logits(tiny_pair):
    from specd.models.paged_kv import PagedKV
    from specd.models.seq_input import SeqInput

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


def seeded_generate(target, n: int, positions=(0, 1, 2)) -> torch.Tensor:
    """n sequences of 3 tokens after the token 0, each its seed's: at position t the token
    is argmax p(x) / E(x), E = position_noise(seed, t) (verifier_service.verify._seeded)."""
    out = torch.zeros(n, 3, dtype=torch.long)
    for seed in range(n):
        last = 0
        for i, t in enumerate(positions):
            last = int((target[last] / position_noise(seed, t, V)).argmax())
            out[seed, i] = last
    return out


def test_a_seeds_draws_at_each_position_emit_the_targets_distribution():
    """The seeded path's tokens (the exponential race over each position's draws) are
    distributed as the target's, jointly over positions; draws shared between positions
    (the same E at two positions) would correlate them, and are caught."""
    target, _ = markov_pair(seed=3)
    assert not fails_exactness(seeded_generate(target, N), target)
    assert fails_exactness(seeded_generate(target, N, positions=(0, 0, 0)), target)
