"""A drafting round stops after a draft the draft model is unsure of (DrafterConfig.p_min):
the drafts are then exactly the first ones of the round it would have drafted in full, up
to and including the first whose probability is under p_min."""

import pytest
import torch

from drafter_service.draft_model import DraftModelProposer, greedy_pick, greedy_picks
from specd.params import SamplingParams
from specd.proposal import DraftState
from tests.unit.test_drafter_cuts import PROMPT, prefill_logits

K = 8


def propose(draft, params, p_min: float):
    proposer = DraftModelProposer(draft, num_blocks=64, block_size=4, top_m=8, p_min=p_min)
    return proposer.propose([DraftState(0, list(PROMPT), params, K)])[0]


def stop_after(confidences: list[float], p_min: float) -> int:
    return next((j + 1 for j, c in enumerate(confidences) if c < p_min), len(confidences))


def threshold_inside(confidences: list[float]) -> float:
    """A p_min halfway between two of the first K - 1 drafts' confidences (so the round
    stops early, and no rounding decides where)."""
    ranked = sorted(set(confidences[: K - 1]))
    assert len(ranked) >= 2, confidences
    mid = len(ranked) // 2
    return (ranked[mid - 1] + ranked[mid]) / 2


def test_greedy_round_stops_after_the_first_unsure_draft(tiny_pair):
    _, draft = tiny_pair
    full = propose(draft, SamplingParams(), 0.0).tokens
    assert len(full) == K
    # the draft model's own probabilities of its drafts, fed a token per forward as it drafts
    logits = prefill_logits(draft, PROMPT + full[:-1], one_by_one_from=len(PROMPT))
    rows = logits[len(PROMPT) - 1 :].float()
    assert rows.argmax(-1).tolist() == full
    confidences = rows.softmax(-1).amax(-1).tolist()
    p_min = threshold_inside(confidences)
    n = stop_after(confidences, p_min)
    assert 1 <= n < K
    assert propose(draft, SamplingParams(), p_min).tokens == full[:n]
    assert propose(draft, SamplingParams(), 1.0).tokens == full[:1]  # one draft at least


def test_sampled_round_stops_by_the_drawn_tokens_q(tiny_pair):
    _, draft = tiny_pair
    params = SamplingParams(temperature=1.0, seed=5)
    full = propose(draft, params, 0.0)
    assert len(full.tokens) == K
    confidences = [
        float(full.q_probs[j][full.q_ids[j] == t].sum()) for j, t in enumerate(full.tokens)
    ]
    p_min = threshold_inside(confidences)
    n = stop_after(confidences, p_min)
    stopped = propose(draft, params, p_min)  # the same seed draws the same tokens
    assert 1 <= n < K
    assert stopped.tokens == full.tokens[:n]
    assert torch.equal(stopped.q_probs, full.q_probs[:n])


@pytest.mark.parametrize("p_min", [-0.1, 1.5, float("nan")])
def test_p_min_outside_zero_one_is_refused(p_min):
    from specd.config import DrafterConfig

    with pytest.raises(ValueError, match="p_min"):
        DrafterConfig(p_min=p_min)


def test_greedy_pick_is_topk_and_softmax():
    """The greedy draw's argmax, probability and runner-up (numpy on the CPU) are topk's
    and softmax's, including rows of masked (-inf) logits, a runner-up whose exp underflows
    and a single finite logit."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(1000, generator=g) * scale for scale in (1, 5, 40)]
    masked = torch.randn(1000, generator=g)
    masked[torch.randperm(1000, generator=g)[:990]] = float("-inf")
    far = torch.full((50,), float("-inf"))
    far[3], far[7] = 1.0, -200.0  # exp(-201) is 0 in fp32
    alone = torch.full((5,), float("-inf"))
    alone[2] = 0.0
    for row in rows + [masked, far, alone]:
        col, confidence, other = greedy_pick(row)
        best, top = row.topk(2)
        assert col == int(top[0])
        assert confidence == pytest.approx(float(row.softmax(-1).max()), rel=1e-5)
        assert other == (int(top[1]) if best[1].isfinite() else None)


def test_greedy_picks_a_batch_as_each_row_alone():
    """Off the CPU's fp32 (a GPU's rows; here bf16 rows on the CPU, which take the same
    torch path) the batch's picks are each row's `greedy_pick`: the same argmax and
    runner-up (None past the finite logits) and the same probability."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(5, 300, generator=g) * torch.tensor([[1.0], [5.0], [40.0], [1.0], [1.0]])
    rows[3, torch.randperm(300, generator=g)[:299]] = float("-inf")  # one finite logit
    rows[4, :] = float("-inf")
    rows[4, 7], rows[4, 9] = 2.0, 1.0
    rows = rows.bfloat16()
    picks = greedy_picks(rows)
    assert [p[2] is None for p in picks] == [False, False, False, True, False]
    for pick, row in zip(picks, rows, strict=True):
        assert pick == greedy_pick(row)


class _Logits:
    """A draft model whose logits come as `dtype` rows (bf16: as a GPU's would)."""

    def __init__(self, model, dtype):
        self.model, self.dtype = model, dtype

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, kv, inputs):
        return self.model.forward(kv, inputs).to(self.dtype)


def test_a_round_off_the_cpus_fp32_picks_each_draft_step_in_one_batch(tiny_pair, monkeypatch):
    """A draft model whose logits are not the CPU's fp32 (a GPU's): each draft step's
    greedy picks come from one `greedy_picks` call over the batch, and the drafts are
    those of the same rows picked one at a time."""
    import drafter_service.draft_model as dm

    _, draft = tiny_pair
    states = [DraftState(i, list(PROMPT[: 6 + 3 * i]), SamplingParams(), 5) for i in range(3)]
    calls = []
    batched = dm.greedy_picks
    monkeypatch.setattr(dm, "greedy_picks", lambda rows: calls.append(len(rows)) or batched(rows))
    proposer = DraftModelProposer(_Logits(draft, torch.bfloat16), num_blocks=64, block_size=4)
    got = [p.tokens for p in proposer.propose(states)]
    assert calls == [3] * 5  # five draft steps of three sequences
    monkeypatch.setattr(DraftModelProposer, "_picks", lambda self, batch, _: [None] * len(batch))
    proposer = DraftModelProposer(_Logits(draft, torch.bfloat16), num_blocks=64, block_size=4)
    assert [p.tokens for p in proposer.propose(states)] == got  # each row's greedy_pick
