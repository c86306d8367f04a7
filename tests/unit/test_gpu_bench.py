"""The GPU benchmark's harness, run on a CPU with the tiny shape: a proposer at a
controlled acceptance gives the acceptance it is set to, keeps the target's output, and
`specd bench gpu` reports every part it measures."""

import json
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from bench.controller_batch import StepTable
from bench.gpu import goals, run
from bench.gpu.controlled import ControlledProposer
from bench.gpu.shapes import build
from specd.params import SamplingParams
from specd.proposal import DraftState


@pytest.fixture(scope="module")
def tiny():
    _, model = build("tiny", "cpu", torch.float32)
    return model


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    """The test's folder as every temporary folder's parent."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read from TMPDIR again
    return tmp_path


def left_behind(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith("specd-")]


def test_a_random_model_leaves_no_folder_behind(own_tmp):
    # its config.json is written only for the loader to read: every `specd bench gpu` run
    # (and every `make test`) built several
    _, model = build("tiny", "cpu", torch.float32, draft=True)
    assert model.args.num_layers == 2
    assert left_behind(own_tmp) == []


def test_the_services_run_leaves_no_folder_behind(own_tmp, monkeypatch):
    # its recorded drafts, policy and tokenizer, however the run ends (here: no process
    # starts)
    from bench.gpu import services

    def no_process(*args, **kwargs):
        raise OSError("no process today")

    monkeypatch.setattr(services.subprocess, "Popen", no_process)
    with pytest.raises(OSError, match="no process today"):
        services.compare({(1, 2): [3]}, 96, [[1, 2]], 4, 2, 0.8, ("tiny", "tiny"), "cpu")
    assert left_behind(own_tmp) == []


@pytest.mark.parametrize("acceptance", [0.0, 1.0])
def test_controlled_drafts_are_accepted_as_set(tiny, acceptance):
    prompts = run._prompts(2, 12, tiny.args.vocab_size, 0)
    plain = run.engine_run(tiny, prompts, 20)
    recorded = {tuple(p): out for p, out in zip(prompts, plain["outputs"], strict=True)}
    proposer = ControlledProposer(recorded, tiny.args.vocab_size, acceptance)
    spec = run.engine_run(tiny, prompts, 20, proposer, k=4)
    assert spec["outputs"] == plain["outputs"]
    assert spec["acceptance"] == acceptance


def test_a_warm_run_reports_its_second_pass_alone(tiny):
    # every draft accepted in the first pass, none in the second: the figures are the
    # second's (acceptance 0, one token a round), the outputs the target's either way
    prompts = run._prompts(2, 12, tiny.args.vocab_size, 0)
    plain = run.engine_run(tiny, prompts, 20)
    recorded = {tuple(p): out for p, out in zip(prompts, plain["outputs"], strict=True)}

    class SecondPassRejects(ControlledProposer):
        seen: set = set()

        def propose(self, states):
            self.seen.update(state.seq_id for state in states)  # a request: a sequence
            self.acceptance = 1.0 if len(self.seen) <= len(prompts) else 0.0
            return super().propose(states)

    spec = run.engine_run(tiny, prompts, 20, SecondPassRejects(recorded, 1000, 1.0), 4, warm=True)
    assert spec["outputs"] == plain["outputs"]
    assert spec["acceptance"] == 0.0 and spec["tokens_per_round"] == 1.0
    assert spec["first_pass_tok_per_s"] > 0 and 0 < spec["control_share"] < 1


def test_controlled_drafts_made_ahead_follow_the_recorded_tokens():
    prompt, out = (1, 2, 3), list(range(10, 30))
    proposer = ControlledProposer({prompt: out}, vocab=100, acceptance=1.0)
    [p] = proposer.propose([DraftState(1, list(prompt), SamplingParams(), 3)])
    assert p.tokens == out[:3]
    [(assumed, ahead)] = proposer.draft_ahead()  # the target's next token guessed right
    assert assumed.tokens == [*prompt, *out[:4]] and ahead.tokens == out[4:7]
    [(further, _)] = proposer.draft_ahead()
    assert further.tokens == [*prompt, *out[:8]]


def test_the_bench_reports_every_part(tmp_path):
    """At an emulated GPU step of 1 ms (`--emulate-ms`): every forward sleeps that long
    first, so no step of one sequence makes more than 1,000 tokens a second."""
    out = tmp_path / "gpu.json"
    argv = ["--device", "cpu", "--target", "tiny", "--draft", "tiny", "--also", ""]
    argv += ["--no-peer", "--no-services", "--emulate-ms", "1", "0.5"]
    assert run.main([*argv, "--new-tokens", "24", "--prompt-tokens", "12", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    decode = report["decode"]["tiny"]
    assert 0 < decode["engine_tok_per_s"] <= 1000 and decode["limit_tok_per_s"] > 0
    assert report["emulated_forward_ms"] == {"target": 1.0, "draft": 0.5}
    assert 0 < report["speculation"]["off"]["tok_per_s"] <= 1000
    assert report["verification_ratio"]["1"] == 1.0 and report["c32"]["c32_tok_per_s"] > 0
    spec = report["speculation"]
    assert all(spec[m]["identical_to_off"] for m in ("lookup", "draft", "draft-auto"))
    assert spec["lookup"]["acceptance"] > 0.3  # 0.8 a draft, until the first miss
    assert all(0 < spec[m]["control_share"] < 1 for m in ("off", "lookup", "draft-auto"))
    auto = spec["draft-auto"]  # against the better of fixed k and plain, and its cold start
    assert auto["vs_better_of_on_off"] > 0 and auto["first_pass_vs_off"] > 0
    # what its control expected of the steps it priced against what they did; fixed k
    # and plain are not priced
    assert auto["priced"] and all(p["steps"] > 0 for p in auto["priced"].values())
    assert all(p["seconds_vs_expected"] > 0 for p in auto["priced"].values())
    assert not spec["off"]["priced"] and not spec["draft"]["priced"]
    parts = spec["round_ms"]
    assert {"plain_step_ms", "verify_ms", "draft_forwards_ms"} <= parts.keys()
    assert parts["verify_ms"] > 0 and parts["plain_step_ms"] > 0
    # whole steps by (sequences, k), which the offline controller reads as its table
    assert {f"{n},{k}" for n in (1, 2, 4, 8, 16) for k in (0, 1, 2, 4, 6)} == set(report["steps"])
    assert report["steps"]["4,2"]["rows"] == 12 and report["first_round_s"] is not None
    table = StepTable.load(out)
    assert table.parts(4, 12, 4, 2)[1] == report["steps"]["4,2"]["draft"] > 0
    # where the run's time went, part by part (the GPU check's budget)
    elapsed = report["elapsed_s"]
    assert list(elapsed) == [
        "decode", "verification and c32", "speculation in-process", "speculation", "steps", "goals"
    ]  # fmt: skip
    assert list(elapsed.values()) == sorted(elapsed.values()) and elapsed["goals"] > 0
    # the GPU issue's goals, judged on what ran (no services, no peer: not measured)
    judged = {g["goal"]: g for g in report["goals"]}
    assert len(judged) == len(goals.GOALS) and report["target"] == "tiny"
    unmeasured = {name for name, g in judged.items() if g["state"] == "not measured"}
    assert unmeasured == {goals.GOALS[i].name for i in (1, 3, 4, 5, 6, 8)}
    assert judged[goals.GOALS[7].name]["value"] == report["c32"]["ratio"]


def test_the_in_process_figures_are_kept_before_the_services_and_their_failure_reported(
    tiny, monkeypatch
):
    """A services run cut short (the GPU check's timeout) or failed keeps what ran
    in-process; a failure is reported with the figures, not raised past the run's other
    parts."""
    _, draft = build("tiny", "cpu", torch.float32, seed=1, draft=True)
    prompts = run._prompts(2, 12, tiny.args.vocab_size, 0)
    kept = []

    def compare(*args, **kwargs):
        assert kept and "lookup" in kept[-1]  # saved before the services start
        raise RuntimeError("no verifier today")

    monkeypatch.setattr(run, "compare", compare)
    out = run.speculation(tiny, draft, prompts, 8, 2, 0.8, ("tiny", "tiny"), keep=kept.append)
    assert out["services_error"] == "RuntimeError: no verifier today"
    assert out["lookup"]["identical_to_off"] and "services" not in out


def test_a_gpu_is_not_emulated():
    with pytest.raises(SystemExit):
        run.main(["--device", "cuda", "--emulate-ms", "2", "0"])


def test_a_round_breaks_into_its_parts():
    """4 tokens a round: a lookup round at 100 tok/s is 40 ms of verification; the draft
    run's at 50 tok/s 80 ms, so 40 of draft forwards; through the verifier process the
    lookup's at 80 tok/s 50 ms, so 10 of it, and through the router at 4e3 / 60 tok/s 60
    ms, so 10 more. Drafting ahead on a second GPU: max(40, 40) + 10 + 10 ms a round of 4
    tokens, 4e3 / 60 tok/s, 2x plain's 1e3 / 30 through the router. The verifier's own
    lookup at 4e3 / 44 tok/s, 44 ms a round: the drafter's hop is 6 ms of its 50."""
    runs = {
        "off": {"tok_per_s": 25.0, "tokens_per_round": None},
        "lookup": {"tok_per_s": 100.0, "tokens_per_round": 4.0},
        "draft": {"tok_per_s": 50.0, "tokens_per_round": 4.0},
    }
    lookup = {"on_tok_per_s": 80.0, "off_tok_per_s": 40.0}
    lookup |= {"router_on_tok_per_s": 4e3 / 60, "router_off_tok_per_s": 1e3 / 30}
    services = {"lookup": lookup}
    assert run.round_breakdown(runs) == {
        "plain_step_ms": 40.0, "verify_ms": 40.0, "draft_forwards_ms": 40.0,
    }  # fmt: skip
    parts = run.round_breakdown(runs, services)
    assert parts["verifier_process_ms"] == 10.0 and parts["router_ms"] == 10.0
    assert parts["second_gpu_ahead_tok_per_s"] == round(4e3 / 60, 3)
    assert parts["second_gpu_ahead_vs_off"] == 2.0
    assert "drafter_hop_ms" not in parts  # no verifier drafted the lookup itself
    # the verifier's own lookup at 4e3 / 44 tok/s: a 44 ms round, the drafter's hop 6 of 50
    services["lookup_in_verifier"] = {"on_tok_per_s": 4e3 / 44}
    assert run.round_breakdown(runs, services)["drafter_hop_ms"] == 6.0
    # verification longer than the draft forwards: they hide behind it
    runs["draft"]["tok_per_s"] = 4e3 / 70  # a 70 ms round: 30 ms of forwards
    assert run.round_breakdown(runs, services)["second_gpu_ahead_tok_per_s"] == round(4e3 / 60, 3)


def test_a_router_reads_the_tokenizer_made_for_random_weights(tmp_path):
    """The GPU bench's routers check and decode token ids with a tokenizer of one made-up
    word an id: as many ids as the model's vocabulary, and text that reads back the ids."""
    from bench.gpu.services import write_tokenizer
    from router.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(write_tokenizer(tmp_path / "tokenizer", 300))
    assert len(tokenizer) == 300
    ids = [0, 5, 299, 17, 5]
    assert tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] == ids


def _state(p: subprocess.Popen) -> str:
    return Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _until(condition) -> bool:
    deadline = time.monotonic() + 5
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_set_of_services_is_measured_with_the_others_paused():
    from bench.gpu.services import _alone

    sets = {name: [subprocess.Popen(["sleep", "60"]) for _ in range(2)] for name in "ab"}
    try:
        with _alone(sets, "a"):
            assert _until(lambda: all(_state(p) == "T" for p in sets["b"]))
            assert all(_state(p) != "T" for p in sets["a"])
        assert _until(lambda: all(_state(p) != "T" for p in sets["b"]))
    finally:
        for p in sets["a"] + sets["b"]:
            p.kill()
            p.wait()


def test_a_run_of_several_passes_reports_the_fastest_after_the_first(tiny, monkeypatch):
    speeds = iter([1.0, 5.0, 9.0, 7.0])  # the first pass, then the three measured
    monkeypatch.setattr(run, "_pass", lambda *a: {"tok_per_s": next(speeds)})
    measured = run.engine_run(tiny, [[1, 2]], 4, warm=True, repeats=3)
    assert (measured["tok_per_s"], measured["first_pass_tok_per_s"]) == (9.0, 1.0)


def test_the_services_report_autos_first_pass_apart_and_each_modes_fastest(monkeypatch):
    """`auto`'s first pass through the router spends a fresh control's exploring budget:
    it is reported apart. Then the five run in turn, each one's fastest pass reported, and
    one pass whose outputs differ from plain's marks its mode."""
    from bench.gpu import services

    order, speeds = [], iter(range(1, 100))
    plain, wrong = [[7, 8]], [[7, 9]]

    def generate(address, prompts, new, k):
        order.append("on" if k else "off")
        return {"tok_per_s": float(next(speeds)), "outputs": plain}

    def generate_routed(address, prompts, new, mode):
        order.append(f"router_{mode}")
        speed = float(next(speeds))
        if mode == "auto" and len(order) == 12:  # the second measured pass of auto
            speed = 1000.0
        outputs = wrong if mode == "on" and len(order) == 11 else plain
        return {"tok_per_s": speed, "outputs": outputs}

    monkeypatch.setattr(services, "generate", generate)
    monkeypatch.setattr(services, "generate_routed", generate_routed)
    monkeypatch.setattr(services, "_warm_routed", lambda routed, prompts: None)
    out = services._through("v", "r", [[1, 2]], 2, 4, passes=3)
    modes = ["off", "on", "router_off", "router_on", "router_auto"]
    assert order == ["on", "router_auto", *modes * 3]  # warm, auto's first pass, the rounds
    assert out["router_auto_first_pass_tok_per_s"] == 2.0
    assert out["router_auto_tok_per_s"] == 1000.0  # the fastest, not the last
    assert (out["off_tok_per_s"], out["router_on_tok_per_s"]) == (13.0, 16.0)
    assert out["router_auto_vs_better_of_on_off"] == round(1000 / 16, 3)
    assert out["identical"] and out["router_auto_identical"]
    assert not out["router_identical"]  # the second round's `on` through the router
