"""The scheduler alone (no model), fed the speculation control's plan as the engine feeds
it: what a step holds, every KV reservation it makes, how it gives way when blocks run
short; and the plan's decisions behind each decode slot."""

from __future__ import annotations

import dataclasses
import random

import pytest

from specd.config import EngineConfig
from specd.kvcache import BlockAllocator
from specd.params import SamplingParams
from verifier_service.records import SeqView, StepView
from verifier_service.request import Request, SpeculationBounds
from verifier_service.scheduler import Scheduler
from verifier_service.sequence import Sequence
from verifier_service.speculation import SpeculationControl
from verifier_service.speculation.control import free_rows
from verifier_service.speculation.costs import CostCurve

BLOCK = 4


class Planned(Scheduler):
    """A scheduler whose `schedule()` first asks its own speculation control for the plan,
    as the engine's step does."""

    def __init__(self, allocator, config, clock=None):
        super().__init__(allocator, config)
        self.control = SpeculationControl(config, *([clock] if clock else []))

    def schedule(self):
        ready = self.ready()
        return super().schedule(ready, self.control.plan(view(ready, self.batch)))


def view(ready, batch: int, kv_used: float = 0.0) -> StepView:
    return StepView(tuple(SeqView.of(s) for s in ready), batch, kv_used)


def _scheduler(num_blocks: int = 64, **config) -> Planned:
    config.setdefault("block_size", BLOCK)
    config.setdefault("max_batched_tokens", 512)  # as the engine resolves it on a GPU
    return Planned(BlockAllocator(num_blocks, BLOCK), EngineConfig(**config))


def _decide(control: SpeculationControl, ready, batch: int, kv_used: float = 0.0):
    return list(control.plan(view(ready, batch, kv_used)).decisions)


def _seq(seq_id: int, prompt_len: int = 6, num_draft: int = 4, **request) -> Sequence:
    request = Request(
        list(range(1, prompt_len + 1)), SamplingParams(), num_draft=num_draft, **request
    )
    return Sequence.start(seq_id, request, eos_ids=())


def _decoding(sched: Scheduler, *seqs: Sequence) -> None:
    """Admit and prefill the sequences, as the engine would, and give each a first token."""
    for seq in seqs:
        sched.add(seq)
    for slot in sched.schedule():
        assert not slot.decode and slot.logits
        slot.seq.num_cached += len(slot.tokens)
        slot.seq.append([7])


def test_a_fresh_prompt_is_one_prefill_slot_with_logits_and_its_blocks_reserved():
    sched = _scheduler()
    seq = _seq(0, prompt_len=6, num_draft=4)
    sched.add(seq)
    (slot,) = sched.schedule()
    assert (slot.decode, slot.tokens, slot.logits, slot.k) == (False, tuple(range(1, 7)), True, 0)
    # admission reserves the prompt + the most it may draft + 1
    assert len(sched.allocator.block_table(0)) == sched.allocator.blocks_for(6 + 4 + 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        slot.k = 3  # nothing after the scheduler changes a plan


def test_long_prompts_are_chunked_to_the_token_budget():
    sched = _scheduler(max_batched_tokens=10, max_draft_tokens=4)
    seq = _seq(0, prompt_len=25)
    sched.add(seq)
    chunks = []
    while seq.num_cached < len(seq.prompt):
        (slot,) = sched.schedule()
        chunks.append((len(slot.tokens), slot.logits))
        seq.num_cached += len(slot.tokens)
    assert chunks == [(10, False), (10, False), (5, True)]


def test_decode_slots_get_k_and_one_leaf_per_draft_within_the_tree_room():
    sched = _scheduler(max_tree_tokens=16)
    a, b = _seq(0, num_draft=4), _seq(1, num_draft=4)
    _decoding(sched, a, b)
    first, second = sched.schedule()
    assert first.decode and first.tokens == (7,) and first.k == 4
    # 16 rows - 2 * (1 + 4) = 6 leaves: 4 beside the first sequence's drafts, 2 for the next
    assert (first.alts, second.alts) == (4, 2)
    for slot in (first, second):
        reserved = len(sched.allocator.block_table(slot.seq_id)) * BLOCK
        assert reserved >= slot.seq.num_cached + 1 + slot.k + slot.alts
        assert slot.decision.reason == "on"


@pytest.mark.parametrize(
    "forward_ms,leaves",
    [
        # this AVX2 CPU (section 29): a row past the first ~17 ms of a 44 ms step
        ({1: 44.0, 5: 111.0}, (0, 0)),
        # rows flat (a GPU, AMX): a 16-row forward ~ a 10-row one, every leaf
        ({1: 10.0, 10: 10.2, 16: 10.5}, (4, 2)),
        # between: each of the 6 leaves adds 1% to the 10-row forward, all pass; at 3.3%
        # each (over the leaf_cost of 3%), none
        ({10: 100.0, 16: 106.0}, (4, 2)),
        ({10: 100.0, 16: 120.0}, (0, 0)),
    ],
)
def test_leaves_are_only_as_many_as_the_measured_forward_prices_near_free(forward_ms, leaves):
    sched = _scheduler(max_tree_tokens=16, batch_invariant=False)
    for rows, ms in forward_ms.items():
        sched.control.controller.costs.steps.forward.record(rows, ms / 1e3)
    a, b = _seq(0, num_draft=4), _seq(1, num_draft=4)
    _decoding(sched, a, b)
    first, second = sched.schedule()
    assert (first.k, second.k) == (4, 4)  # the chain is the controller's, never cut here
    assert (first.alts, second.alts) == leaves


def test_leaves_are_priced_at_the_rows_they_can_feed_not_past_them():
    """Two sequences at k = 1 feed 4 rows and can take 2 leaves (one beside each draft).
    Two leaves add 30% to the forward: none. A cheap price read at 16 rows, a size such a
    step can never feed, must not buy them (it did: each leaf then cost ~14% of a 4-row
    step on the AMX host, docs/benchmarks-log.md section 101)."""
    sched = _scheduler(max_tree_tokens=16, batch_invariant=False)
    for rows, ms in {4: 100.0, 6: 130.0, 16: 105.0}.items():
        sched.control.controller.costs.steps.forward.record(rows, ms / 1e3)
    a, b = _seq(0, num_draft=1), _seq(1, num_draft=1)
    _decoding(sched, a, b)
    first, second = sched.schedule()
    assert (first.k, second.k) == (1, 1)
    assert (first.alts, second.alts) == (0, 0)


def test_leaves_dear_while_the_machine_ran_fast_stay_dear_once_it_runs_slow():
    """Four sequences at k = 1 feed 8 rows; 4 leaves (12 rows) cost 50% more, measured
    while the machine ran fast. It slows by 40% and only 8-row steps run: their forward
    now costs about what 12 rows did. Priced at one pace the leaves are as dear as
    before: none. (Two sizes of an EMA learned at different speeds read them free, and
    the leaf steps then never measured the chain alone again: section 101.)"""
    sched = _scheduler(max_tree_tokens=16, batch_invariant=False)
    costs = sched.control.controller.costs

    def step(rows: int, scale: float) -> None:  # as SpeculationControl._learn_costs records
        forward_s, rest_s = scale * 0.1 * rows / 8, scale * 0.03
        costs.record_forward(rows, forward_s)
        costs.record_step([1, 1, 1, 1], forward_s + rest_s, rows=rows, forward_s=forward_s)

    for _ in range(40):
        step(8, 1.0)
        step(12, 1.0)
    for _ in range(60):
        step(8, 1.4)
    seqs = [_seq(i, num_draft=1) for i in range(4)]
    _decoding(sched, *seqs)
    slots = sched.schedule()
    assert [s.k for s in slots] == [1, 1, 1, 1]
    assert [s.alts for s in slots] == [0, 0, 0, 0]


def test_a_chain_shorter_than_every_forward_measured_takes_no_leaves_and_measures_itself():
    """Only leaf-laden forwards measured (12 rows, as the first drafting steps run, every
    leaf taken while nothing was measured): a chain of 8 rows is priced flat below them,
    which reads every leaf free. It takes none, so that its step measures the chain."""
    sched = _scheduler(max_tree_tokens=16, batch_invariant=False)
    sched.control.controller.costs.steps.forward.record(12, 0.15)
    seqs = [_seq(i, num_draft=1) for i in range(4)]
    _decoding(sched, *seqs)
    assert [s.alts for s in sched.schedule()] == [0, 0, 0, 0]


@pytest.mark.parametrize(
    "forward_ms,leaves",
    [
        # a Zen 4 host's forward as measured in-process at c = 1 (section 109): ~3 ms a row,
        # with 5 rows read cheaper than 4. Neither chain takes a leaf: the dip read alone
        # gave k = 3's chain of 4 its two leaves and k = 2's chain of 3 none
        ({2: 32.4, 3: 30.0, 4: 42.1, 5: 38.7, 6: 43.4, 7: 46.8}, (0, 0)),
        # rows flat within their noise (AMX, a GPU): both chains take every leaf
        ({2: 30.0, 3: 31.0, 4: 29.5, 5: 30.5, 6: 30.2, 7: 30.8}, (2, 3)),
    ],
)
def test_a_noisy_forward_gives_chains_of_neighbouring_k_the_same_leaves(forward_ms, leaves):
    """One sequence at k = 2 (3 rows, room for 2 leaves) and at k = 3 (4 rows, 3)."""
    forward = CostCurve(median=True)
    for rows, ms in forward_ms.items():
        for _ in range(4):
            forward.record(rows, ms / 1e3)
    assert (free_rows(forward, 3, 2, 0.03), free_rows(forward, 4, 3, 0.03)) == leaves


def test_without_the_cost_model_the_leaves_fill_the_tree_room_whatever_rows_cost():
    sched = _scheduler(max_tree_tokens=16, cost_model=False)
    sched.control.controller.costs.record_forward(1, 0.044)
    sched.control.controller.costs.record_forward(5, 0.111)
    a, b = _seq(0, num_draft=4), _seq(1, num_draft=4)
    _decoding(sched, a, b)
    assert [s.alts for s in sched.schedule()] == [4, 2]


def test_a_seeded_sampled_request_has_leaves_as_any_other():
    """A seeded sampled request's tokens are its seed's at each position, whatever its
    rounds verified (verifier_service.verify._seeded): its rounds take leaves in turn as
    any request's do, first come first."""
    sched = _scheduler(max_tree_tokens=20, cost_model=False, batch_invariant=False)

    def seeded(seq_id: int, temperature: float) -> Sequence:
        params = SamplingParams(temperature=temperature, seed=5)
        return Sequence.start(seq_id, Request(list(range(1, 7)), params, num_draft=4), eos_ids=())

    _decoding(sched, seeded(0, 1.0), seeded(1, 0.0), _seq(2, num_draft=4))
    assert [(s.k, s.alts) for s in sched.schedule()] == [(4, 4), (4, 1), (4, 0)]


def test_short_of_blocks_the_leaves_go_first_then_k_then_the_newest_sequence():
    sched = _scheduler(num_blocks=6, max_tree_tokens=16)
    a, b = _seq(0, prompt_len=6, num_draft=4), _seq(1, prompt_len=6, num_draft=4)
    _decoding(sched, a, b)  # admission: ceil((6 + 4 + 1) / 4) = 3 blocks each, the whole pool
    assert sched.allocator.num_free == 0
    first, second = sched.schedule()
    # 6 cached + 1 + 4 drafts fit the 3 blocks; 4 leaves more would need a 4th
    assert [(s.k, s.alts) for s in (first, second)] == [(4, 0), (4, 0)]
    # a grows past its blocks: k goes down to what fits...
    a.num_cached, a.tokens = 10, a.tokens + [7] * 4
    (first, second) = sched.schedule()
    assert (first.k, first.alts) == (1, 0) and second.k == 4
    # ...and when not even k = 0 fits, the newest running sequence is preempted
    a.num_cached, a.tokens = 12, a.tokens + [7] * 2
    plan = sched.schedule()
    assert [(s.seq_id, s.k, s.alts) for s in plan] == [(0, 4, 4)]
    assert list(sched.waiting) == [b] and b.num_cached == 0 and 1 not in sched.allocator


def test_batch_invariant_steps_never_mix_prefill_and_decode_and_alternate():
    sched = _scheduler(batch_invariant=True)
    a = _seq(0)
    _decoding(sched, a)
    sched.add(_seq(1))
    kinds = [tuple(s.decode for s in sched.schedule()) for _ in range(3)]
    assert kinds == [(True,), (False,), (True,)]  # after a prefill step a decode step


def test_without_invariance_prefill_rides_along_and_the_leaves_go():
    sched = _scheduler(batch_invariant=False)
    a = _seq(0)
    _decoding(sched, a)
    sched.add(_seq(1))
    plan = sched.schedule()
    assert [s.decode for s in plan] == [True, False]
    assert plan[0].k == 4 and plan[0].alts == 0


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_decisions_gate_on_the_largest_recent_batch_and_on_kv():
    clock = FakeClock()
    control = SpeculationControl(EngineConfig(), clock)
    gated = _seq(0, speculation=SpeculationBounds(draft_below_batch=3, max_kv_utilization=0.5))
    plain = _seq(1, num_draft=0)
    assert _decide(control, [gated, plain], batch=3, kv_used=0.1) == [
        (0, "off:batch", 1.0),
        (0, "off:request", 1.0),
    ]
    clock.now = 0.1  # the batch fell to 2, but a batch of 3 was seen within `batch_memory_s`
    assert _decide(control, [gated], batch=2, kv_used=0.1)[0].reason == "off:batch"
    clock.now = 2.0
    assert _decide(control, [gated], batch=2, kv_used=0.1)[0] == (4, "on", 1.0)
    assert _decide(control, [gated], batch=2, kv_used=0.6)[0].reason == "off:kv"


def test_the_tightest_batch_bound_holds_every_bounded_sequence_plain():
    """A drafting step is slower for every sequence in it: a chat request bounded at 4
    beside code ones bounded at 8 holds them plain at 4, while an explicit k drafts."""
    clock = FakeClock()
    control = SpeculationControl(EngineConfig(cost_model=False), clock)

    def auto(seq_id: int, bound: int) -> Sequence:
        return _seq(seq_id, speculation=SpeculationBounds(auto=True, draft_below_batch=bound))

    code, chat, explicit = [auto(i, 8) for i in (0, 1, 4, 5)], [auto(2, 4)], _seq(3)
    decided = _decide(control, [*code[:2], *chat, explicit], batch=4)
    assert [d.reason for d in decided] == ["off:batch"] * 3 + ["on"]
    clock.now = 2.0  # the batch fell to 3 long enough ago: every one drafts again
    assert [d.reason for d in _decide(control, [*code[:2], *chat], batch=3)] == ["on"] * 3
    clock.now = 4.0  # without the chat request, code's own bound allows 4
    assert [d.reason for d in _decide(control, code, batch=4)] == ["on"] * 4


def test_decisions_tell_the_controller_of_a_dip_in_the_batch():
    clock = FakeClock()
    control = SpeculationControl(EngineConfig(), clock)
    dips = []
    plan = control.controller.plan
    control.controller.plan = lambda cands, fixed, dip: dips.append(dip) or plan(cands, fixed, dip)
    auto = [_seq(i, speculation=SpeculationBounds(auto=True)) for i in range(4)]
    _decide(control, auto, batch=4, kv_used=0.1)
    _decide(control, auto[:1], batch=1, kv_used=0.1)  # three finished a moment ago
    # the batch has stayed one for 0.6 s (a client's next request comes within ~0.4 s at
    # c = 8 on the 2-core CPU): the last request of a load that fell drafts again
    clock.now = 0.6
    _decide(control, auto[:1], batch=1, kv_used=0.1)
    _decide(control, auto[:1], batch=3, kv_used=0.1)  # two more wait for their prefill
    assert dips == [False, True, False, True]


def test_the_largest_recent_batch_is_the_largest_within_the_memory():
    """What gates drafting by batch (`_recent_batch`), against the plain maximum over
    the batches seen within `batch_memory_s`, over steps of random sizes and gaps."""
    clock, rnd = FakeClock(), random.Random(5)
    control = SpeculationControl(EngineConfig(), clock)
    memory, seen = control.tuned.batch_memory_s, []
    for _ in range(2000):
        clock.now += rnd.choice([0.001, 0.01, 0.05, 0.3])
        size = rnd.randint(1, 32)
        seen.append((clock.now, size))
        within = [n for t, n in seen if t >= clock.now - memory]
        assert control._recent_batch(size) == max(within)


def test_decisions_never_draft_past_the_tokens_left():
    control = SpeculationControl(EngineConfig())
    seq = _seq(0, num_draft=3, max_new_tokens=10)
    assert _decide(control, [seq], batch=1)[0].k == 3
    seq.append([7] * 8)  # 2 tokens left: one draft, then the bonus token
    assert _decide(control, [seq], batch=1)[0].k == 1
