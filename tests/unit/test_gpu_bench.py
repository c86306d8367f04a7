"""The GPU benchmark's harness, run on a CPU with the tiny shape: a proposer at a
controlled acceptance gives the acceptance it is set to, keeps the target's output, and
`specd bench gpu` reports every part it measures."""

import json

import pytest
import torch

from bench.gpu import run
from bench.gpu.controlled import ControlledProposer
from bench.gpu.shapes import build


@pytest.fixture(scope="module")
def tiny():
    _, model = build("tiny", "cpu", torch.float32)
    return model


@pytest.mark.parametrize("acceptance", [0.0, 1.0])
def test_controlled_drafts_are_accepted_as_set(tiny, acceptance):
    prompts = run._prompts(2, 12, tiny.args.vocab_size, 0)
    plain = run.engine_run(tiny, prompts, 20)
    recorded = {tuple(p): out for p, out in zip(prompts, plain["outputs"], strict=True)}
    proposer = ControlledProposer(recorded, tiny.args.vocab_size, acceptance)
    spec = run.engine_run(tiny, prompts, 20, proposer, k=4)
    assert spec["outputs"] == plain["outputs"]
    assert spec["acceptance"] == acceptance


def test_the_bench_reports_every_part(tmp_path):
    out = tmp_path / "gpu.json"
    argv = ["--device", "cpu", "--target", "tiny", "--draft", "tiny", "--also", ""]
    argv += ["--no-peer", "--no-services"]
    assert run.main([*argv, "--new-tokens", "24", "--prompt-tokens", "12", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    decode = report["decode"]["tiny"]
    assert 0 < decode["engine_tok_per_s"] and decode["limit_tok_per_s"] > 0
    assert report["verification_ratio"]["1"] == 1.0 and report["c32"]["c32_tok_per_s"] > 0
    spec = report["speculation"]
    assert all(spec[m]["identical_to_off"] for m in ("lookup", "draft", "draft-auto"))
    assert spec["lookup"]["acceptance"] > 0.3  # 0.8 a draft, until the first miss
