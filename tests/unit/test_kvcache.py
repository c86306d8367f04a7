import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specd.kvcache import BlockAllocator, NoFreeBlocks


def test_slots_follow_block_table():
    a = BlockAllocator(num_blocks=8, block_size=4)
    a.allocate("s")
    assert a.append("s", 6) == (0, 6)
    table = a.block_table("s")
    assert len(table) == 2
    assert a.slots("s", 3, 6) == [table[0] * 4 + 3, table[1] * 4, table[1] * 4 + 1]
    assert a.utilization() == 2 / 8


def test_truncate_frees_whole_blocks_past_n():
    a = BlockAllocator(num_blocks=8, block_size=4)
    a.allocate("s")
    a.append("s", 10)  # 3 blocks
    a.truncate_to("s", 5)  # needs 2
    assert a.num_used == 2 and a.length("s") == 5
    a.truncate_to("s", 4)
    assert a.num_used == 1
    with pytest.raises(ValueError):
        a.truncate_to("s", 5)


def test_exhaustion_is_all_or_nothing():
    a = BlockAllocator(num_blocks=3, block_size=2)
    a.allocate("x", reserve_tokens=4)
    with pytest.raises(NoFreeBlocks):
        a.allocate("y", reserve_tokens=4)
    assert "y" not in a and a.num_used == 2
    a.append("x", 4)
    with pytest.raises(NoFreeBlocks):
        a.append("x", 3)  # would need 2 more blocks, 1 free
    assert a.length("x") == 4 and a.num_used == 2
    a.free("x")
    a.free("x")  # idempotent
    assert a.num_used == 0


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "append", "truncate", "free", "reserve"]),
        st.integers(0, 5),
        st.integers(0, 40),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, block_size=st.integers(1, 8))
def test_no_leaks_and_exact_utilisation(ops, block_size):
    a = BlockAllocator(num_blocks=32, block_size=block_size)
    for op, seq, n in ops:
        try:
            if op == "alloc" and seq not in a:
                a.allocate(seq, reserve_tokens=n)
            elif op == "append" and seq in a:
                a.append(seq, n)
            elif op == "truncate" and seq in a:
                a.truncate_to(seq, min(n, a.length(seq)))
            elif op == "reserve" and seq in a:
                a.reserve(seq, n)
            elif op == "free":
                a.free(seq)
        except NoFreeBlocks:
            pass
        held = [b for s in a.sequences() for b in a.block_table(s)]
        assert len(held) == len(set(held)), "a block is held twice"
        assert a.num_used == len(held)
        assert a.utilization() == len(held) / 32
        for s in a.sequences():
            assert len(a.block_table(s)) >= a.blocks_for(a.length(s))
    for s in a.sequences():
        a.free(s)
    assert a.num_used == 0 and a.num_free == 32


# -- the prefix cache ------------------------------------------------------------------------
def _prefilled(a: BlockAllocator, seq, tokens: list[int], salt: str = "") -> int:
    """Admit a sequence as the scheduler does (all but its last token may come from the
    cache), run its prefill, publish it: -> tokens found cached."""
    cached = a.allocate(seq, reserve_tokens=len(tokens) + 1, tokens=tokens[:-1], salt=salt)
    a.append(seq, len(tokens) - cached)
    a.publish(seq, tokens)
    return cached


def test_a_shared_prefix_is_found_by_whole_blocks_and_held_once():
    a = BlockAllocator(num_blocks=16, block_size=4, prefix_cache=True)
    system = [9, 8, 7, 6, 5, 4, 3, 2]  # two full blocks
    assert _prefilled(a, "x", system + [1, 1, 1]) == 0
    assert a.num_used == 3
    # the same two blocks, then its own: 8 tokens found, one block more held
    assert _prefilled(a, "y", system + [2, 2, 2, 2, 2]) == 8
    assert a.block_table("y")[:2] == a.block_table("x")[:2]
    assert a.num_used == 3 + 2
    # one token differs in the second block: only the first block is found
    assert _prefilled(a, "z", system[:7] + [0, 3]) == 4
    # the whole prompt cached: its last full block is computed again (its logits are needed)
    assert _prefilled(a, "w", system) == 4
    assert (a.cached_tokens, a.asked_tokens) == (16, 10 + 12 + 8 + 7)


def test_a_salt_keeps_cached_blocks_among_the_requests_that_share_it():
    """vLLM's cache_salt: the same tokens under another salt, or none, find nothing; under
    the same salt they find the whole blocks, as unsalted ones find each other's."""
    a = BlockAllocator(num_blocks=32, block_size=4, prefix_cache=True)
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    assert _prefilled(a, "plain", prompt) == 0
    assert _prefilled(a, "alice", prompt, salt="alice") == 0
    assert _prefilled(a, "bob", prompt, salt="bob") == 0
    assert _prefilled(a, "alice again", prompt, salt="alice") == 8
    assert a.block_table("alice again")[:2] == a.block_table("alice")[:2]
    assert _prefilled(a, "plain again", prompt) == 8
    assert a.block_table("plain again")[:2] == a.block_table("plain")[:2]
    for seq in ("plain", "alice", "bob", "alice again", "plain again"):
        a.free(seq)
    assert a.num_used == 0


def test_released_blocks_stay_cached_until_the_pool_needs_them_oldest_first():
    a = BlockAllocator(num_blocks=6, block_size=2, prefix_cache=True)
    _prefilled(a, "old", [1, 1, 2, 2, 3])  # publishes 2 blocks
    _prefilled(a, "new", [5, 5, 6, 6, 7])
    a.free("old")
    a.free("new")
    assert a.num_used == 0 and a.num_free == 6 and a.num_idle == 4
    # a fresh sequence takes the never-published blocks first, then the oldest cached
    a.allocate("big", reserve_tokens=8)  # 4 blocks: 2 never published + old's 2
    a.free("big")
    assert _prefilled(a, "again", [5, 5, 6, 6, 7]) == 4  # new's blocks survived
    assert _prefilled(a, "gone", [1, 1, 2, 2, 3]) == 0  # old's were taken


def test_a_kept_block_whose_tail_is_cut_leaves_the_cache():
    a = BlockAllocator(num_blocks=8, block_size=4, prefix_cache=True)
    _prefilled(a, "x", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    a.truncate_to("x", 6)  # block 1 (positions 4-7) stays with x and will be rewritten
    a.append("x", 3)
    assert _prefilled(a, "y", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 4
    a.free("x")
    a.free("y")
    assert a.num_used == 0


def test_off_the_cache_finds_nothing():
    a = BlockAllocator(num_blocks=8, block_size=2)
    _prefilled(a, "x", [1, 2, 3, 4, 5])
    a.free("x")
    assert _prefilled(a, "y", [1, 2, 3, 4, 5]) == 0 and a.num_idle == 0


prefix_ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "grow", "truncate", "publish", "free"]),
        st.integers(0, 4),  # sequence
        st.integers(0, 40),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=prefix_ops, block_size=st.integers(1, 4))
def test_cached_blocks_always_hold_the_kv_of_their_tokens(ops, block_size):
    """A model of the pool: every slot remembers the tokens its K/V were computed from.
    Whatever the allocations, a sequence's positions hold its own tokens' K/V (a cached
    prefix is the right one, a shared block is never overwritten) and nothing leaks."""
    a = BlockAllocator(num_blocks=24, block_size=block_size, prefix_cache=True)
    pool: dict[int, tuple] = {}
    tokens: dict[int, list[int]] = {}
    floor: dict[int, int] = {}  # below it a sequence never truncates (cached / published)

    def write(seq, start, end):
        for p, slot in zip(range(start, end), a.slots(seq, start, end), strict=True):
            pool[slot] = tuple(tokens[seq][: p + 1])

    for op, seq, n in ops:
        try:
            if op == "admit" and seq not in a:
                prompt = [(n >> i) & 1 for i in range(2 + n % 9)]  # few, often shared
                tokens[seq] = prompt
                cached = a.allocate(seq, len(prompt) + 1, tokens=prompt[:-1])
                floor[seq] = cached
                write(seq, *a.append(seq, len(prompt) - cached))
            elif op == "grow" and seq in a:
                tokens[seq].append(n % 2)
                write(seq, *a.append(seq, 1))
            elif op == "truncate" and seq in a:
                keep = max(floor[seq], min(n, a.length(seq)))
                a.truncate_to(seq, keep)
                del tokens[seq][keep:]
            elif op == "publish" and seq in a:
                a.publish(seq, tokens[seq])
                floor[seq] = a.length(seq)
            elif op == "free":
                a.free(seq)
        except NoFreeBlocks:
            if op == "grow":
                tokens[seq].pop()
        held = {b for s in a.sequences() for b in a.block_table(s)}
        assert a.num_used == len(held) and a.num_free == 24 - len(held)
        for s in a.sequences():
            for p, slot in enumerate(a.slots(s, 0, a.length(s))):
                assert pool[slot] == tuple(tokens[s][: p + 1]), (s, p)
    for s in a.sequences():
        a.free(s)
    assert a.num_used == 0 and a.num_free == 24


def test_a_reset_forgets_every_cached_prefix_and_running_sequences_keep_their_blocks():
    """vLLM's reset_prefix_cache: no later allocation finds a block published before it,
    idle cached blocks are free again, a running sequence keeps (and shares) what it
    holds, and every block comes back when all are freed."""
    a = BlockAllocator(num_blocks=12, block_size=4, prefix_cache=True)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    _prefilled(a, "done", prompt)
    a.free("done")
    _prefilled(a, "running", prompt)  # finds done's 2 blocks, holds 3
    _prefilled(a, "salted", prompt, salt="s")
    a.free("salted")
    assert (a.num_idle, a.num_used) == (2, 3)
    held = a.block_table("running")
    assert a.forget_cached() == 4  # 2 plain (held by running) and 2 salted
    assert (a.num_idle, a.num_used, a.num_free) == (0, 3, 9)
    assert a.block_table("running") == held
    assert _prefilled(a, "after", prompt) == 0
    assert _prefilled(a, "after salted", prompt, salt="s") == 0
    assert not set(a.block_table("after")) & set(held)
    assert _prefilled(a, "again", prompt) == 8  # what is computed after the reset is cached
    for seq in ("running", "after", "after salted", "again"):
        a.free(seq)
    assert a.num_used == 0 and a.num_free == 12
