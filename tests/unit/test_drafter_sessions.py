"""The drafter's sessions (drafter_service/sessions.py): every command of a round applied
in order, bad commands answered with a problem and never a crash, sessions closed one by
one or with their stream, constrained sessions following their grammar."""

from drafter_service.sessions import Sessions
from protos.specd.v1 import common_pb2, drafter_pb2
from specd.grammar import Grammars
from tests.cluster import char_tokenizer

V = 96


def ids(text: str) -> list[int]:
    return [ord(c) - 32 for c in text]


class Recorder:
    def __init__(self):
        self.closed = []

    def __call__(self, key):
        self.closed.append(key)


def make(grammars=None):
    closed = Recorder()
    return Sessions(V, max_draft_tokens=8, grammars=grammars, on_close=closed), closed


def cmd(seq_id: int, **kind) -> drafter_pb2.SeqCommand:
    return drafter_pb2.SeqCommand(seq_id=seq_id, **kind)


def open_cmd(seq_id, tokens, **extra):
    return cmd(seq_id, open=drafter_pb2.Open(token_ids=tokens, **extra))


def step_cmd(seq_id, committed=(), k=4):
    return cmd(seq_id, step=drafter_pb2.Step(committed_ids=list(committed), k=k))


def test_open_then_step_drafts_from_the_committed_tokens():
    sessions, _ = make()
    steps = sessions.round(0, [open_cmd(1, [5, 6, 7]), step_cmd(1, [], k=3)])
    assert [(s.seq_id, s.problem) for s in steps] == [(1, "")]
    assert steps[0].state.tokens == [5, 6, 7] and steps[0].state.k == 3
    assert steps[0].state.seq_id == (0, 1)
    steps = sessions.round(0, [step_cmd(1, [8, 9], k=2)])  # the verifier committed 8, 9
    assert steps[0].state.tokens == [5, 6, 7, 8, 9]
    assert len(sessions) == 1


def test_bad_commands_get_a_problem_each():
    sessions, _ = make()
    steps = sessions.round(
        0,
        [
            open_cmd(1, [5, 200]),  # id outside the vocabulary: the open fails...
            step_cmd(1),  # ...and its step says why
            step_cmd(2),  # never opened
            open_cmd(3, [5]),
            step_cmd(3, k=0),  # k out of range
            step_cmd(3, k=9),
            step_cmd(3, [-1]),  # committed id outside the vocabulary
        ],
    )
    problems = [(s.seq_id, s.problem) for s in steps]
    assert all(s.state is None for s in steps)
    assert "outside [0, 96)" in problems[0][1]
    assert problems[1] == (2, "no open session for seq_id 2")
    assert "k must be in [1, 8], got 0" in problems[2][1] and "got 9" in problems[3][1]
    assert "outside [0, 96)" in problems[4][1]
    assert len(sessions) == 1  # only seq 3 opened, and it is still usable
    assert sessions.round(0, [step_cmd(3)])[0].state.tokens == [5]


def test_invalid_sampling_params_refuse_the_open():
    sessions, _ = make()
    bad = common_pb2.SamplingParams(temperature=-1.0)
    steps = sessions.round(0, [open_cmd(1, [5], params=bad), step_cmd(1)])
    assert steps[0].state is None and "temperature" in steps[0].problem
    assert len(sessions) == 0


def test_sessions_close_alone_or_with_their_stream():
    sessions, closed = make()
    sessions.round(0, [open_cmd(1, [5]), open_cmd(2, [6])])
    sessions.round(1, [open_cmd(1, [7])])  # another verifier's seq 1: its own session
    sessions.round(0, [cmd(1, close=drafter_pb2.Close())])
    assert closed.closed == [(0, 1)] and len(sessions) == 2
    sessions.round(0, [open_cmd(2, [8])])  # re-opening restarts: the old one is closed
    assert closed.closed == [(0, 1), (0, 2)]
    sessions.close_stream(0)
    assert closed.closed[-1] == (0, 2) and len(sessions) == 1
    assert sessions.get((1, 1)).state.tokens == [7]


def test_a_constrained_session_follows_its_grammar():
    sessions, _ = make(Grammars(char_tokenizer, V))
    regex = common_pb2.Constraint(regex="ab[0-9]+c")
    prompt = ids("Q:")
    # committed so far: the prompt, then "a" generated under the constraint
    opened = open_cmd(1, prompt + ids("a"), constraint=regex, prompt_length=len(prompt))
    state = sessions.round(0, [opened, step_cmd(1, ids("b"))])[0].state
    assert state.grammar is not None
    allowed = state.grammar.allowed().nonzero().flatten().tolist()
    assert sorted(allowed) == ids("0123456789")
    # tokens that break the constraint refuse the open
    broken = open_cmd(2, prompt + ids("x"), constraint=regex, prompt_length=len(prompt))
    assert "break the constraint" in sessions.round(0, [broken, step_cmd(2)])[0].problem
    # a drafter without a tokenizer drafts unconstrained (the verifier cuts)
    plain, _ = make()
    assert plain.round(0, [opened, step_cmd(1)])[0].state.grammar is None
