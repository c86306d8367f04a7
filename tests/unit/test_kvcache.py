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
