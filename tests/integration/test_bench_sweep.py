"""A small sweep against in-process tiny-model servers: well-formed JSON, Markdown, PNG."""

import asyncio
import json

import pytest

from bench.sweep import mix, run_order, sweep
from bench.sweep_report import paired_ratios, to_markdown, write_outputs
from router.policy import Policy
from tests.cluster import start_cluster


def small_sweep(cluster, conversations, modes, levels, requests: int = 2, **kwargs) -> dict:
    """A sweep of 6-token requests against the module's cluster, quietly."""
    return sweep(
        cluster.router,
        conversations,
        modes,
        levels,
        requests=requests,
        max_new=6,
        progress=lambda line: None,
        **kwargs,
    )


@pytest.fixture(scope="module")
def cluster(tiny_pair):
    policy = {"default": {"min_acceptance": 0}, "routes": {"plain": {"speculation": "off"}}}
    c = start_cluster(*tiny_pair, policy=Policy.from_dict(policy))
    yield c
    c.close()


def test_small_sweep_writes_json_markdown_and_png(cluster, tmp_path):
    conversations = [[{"role": "user", "content": "abcabc"}], [{"role": "user", "content": "x"}]]
    modes, levels = ["off", "on", "auto"], [1, 2]
    report = small_sweep(cluster, conversations, modes, levels)
    paths = write_outputs(report, tmp_path)
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert len(data["cells"]) == len(modes) * len(levels)
    for cell in data["cells"]:
        assert cell["requests"] >= 2 and cell["tokens"] > 0 and cell["tokens_per_s"] > 0
        assert cell["ttft_p99"] >= cell["ttft_p50"] > 0
        assert sum(cell["reasons"].values()) == cell["requests"]
    on = next(c for c in data["cells"] if c["mode"] == "on")
    off = next(c for c in data["cells"] if c["mode"] == "off")
    assert on["reasons"] == {"on": on["requests"]} and on["acceptance"] is not None
    assert off["reasons"] == {"off:client": off["requests"]} and off["acceptance"] is None
    table, ratios = [], []
    for line in (tmp_path / "sweep.md").read_text().strip().splitlines():
        (table if line.startswith("|") else ratios).append(line)
    assert table[0].startswith("| mode | concurrency |") and len(table) == 2 + len(data["cells"])
    assert sorted(r.split(" ")[0] for r in ratios if "/off" in r) == ["c=1", "c=1", "c=2", "c=2"]
    pngs = [p for p in paths if p.suffix == ".png"]
    assert len(pngs) == 2
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


@pytest.mark.timeout(240)
def test_repeated_cells_alternate_modes_and_merge(cluster):
    # with several modes every cell runs them all, taking turns; the order reversed every
    # other repeat, so with an even count every mode sits at the same mean position
    order = run_order(["off", "auto"], [1, 4], 4)
    assert (
        order
        == [(["off", "auto"], 1), (["auto", "off"], 1)] * 2
        + [
            (["off", "auto"], 4),
            (["auto", "off"], 4),
        ]
        * 2
    )
    assert run_order(["off", "auto"], [1, 4], 1) == [(["off", "auto"], 1), (["off", "auto"], 4)]
    assert run_order(["auto"], [1, 4], 2) == [(["auto"], 1)] * 2 + [(["auto"], 4)] * 2

    conversations = [[{"role": "user", "content": "abcabc"}]]
    report = small_sweep(cluster, conversations, ["off", "on"], [1], repeats=2)
    assert [c["mode"] for c in report["cells"]] == ["off", "on"]
    for cell in report["cells"]:
        runs = cell["runs_tokens_per_s"]
        assert cell["requests"] == 4 and len(runs) == 2
        assert min(runs) <= cell["tokens_per_s"] <= max(runs)
    off, on = report["cells"]
    (line,) = paired_ratios(report)
    assert line.startswith(f"c=1 on/off {on['tokens_per_s'] / off['tokens_per_s']:.3f} (runs ")
    assert len(line.split("(runs ")[1].split()) == 2


def test_a_mixed_sweep_sends_each_workload_on_its_route_and_reports_each_route(cluster):
    code = [[{"role": "user", "content": f"abc{i}"}] for i in range(3)]
    chat = [[{"role": "user", "content": "x"}]]
    conversations, routes = mix([code, chat], ["default", "plain"])
    assert routes == ["default", "plain", "default", "default"]
    assert conversations == [code[0], chat[0], code[1], code[2]]
    report = small_sweep(cluster, conversations, ["on"], [2], requests=8, routes=routes)
    assert report["route"] == "default,plain"
    (cell,) = report["cells"]
    by_route = cell["routes"]
    assert set(by_route) == {"default", "plain"}
    assert by_route["default"]["requests"] == 6 and by_route["plain"]["requests"] == 2
    # what the router decided proves the route arrived: `plain` never speculates
    assert by_route["default"]["reasons"] == {"on": 6}
    assert by_route["plain"]["reasons"] == {"off:policy": 2}
    assert cell["tokens"] == by_route["default"]["tokens"] + by_route["plain"]["tokens"]
    table = to_markdown(report).splitlines()
    assert [row.split(" | ")[0] for row in table[2:]] == ["| on", "| on · default", "| on · plain"]


def test_a_mode_at_a_route_sends_that_modes_cells_on_it(cluster):
    conversations = [[{"role": "user", "content": "abc"}]]
    report = small_sweep(cluster, conversations, ["on", "on@plain"], [1])
    on, on_plain = report["cells"]
    assert (on["mode"], on_plain["mode"]) == ("on", "on@plain")
    assert on["reasons"] == {"on": 2}
    assert on_plain["reasons"] == {"off:policy": 2}  # the route arrived: it never drafts
    assert paired_ratios(report)[0].startswith("c=1 on@plain/on ")


def test_sweep_starts_its_own_services_and_swaps_in_ngram(tmp_path):
    from tests.cluster import save_tiny_cluster_model
    from tests.conftest import run_specd, said_logs

    model = save_tiny_cluster_model(tmp_path / "tiny")
    cmd = ["bench", "sweep", "--model", str(model)]
    cmd += ["--draft-model", str(model), "--dtype", "float32", "--concurrency", "1,2"]
    cmd += ["--modes", "off,on,ngram", "--requests-per-cell", "2", "--max-new-tokens", "6"]
    cmd += ["--no-progress", "--out", str(tmp_path / "out")]
    proc = run_specd(cmd, timeout=220, tmp=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    logs = said_logs(proc.stdout)
    assert len(logs) == 1  # said, where each service's log is
    assert logs[0].parent == tmp_path  # under the temporary folder it was given
    names = sorted(p.name.split("-")[0] for p in logs[0].iterdir())
    assert names == ["drafter", "router", "verifier"]
    # ngram as `specd up` serves it: the verifier restarted with a lookup of its own
    verifier_log = next(logs[0].glob("verifier-*")).read_text()
    assert "drafts: a lookup" in verifier_log.split("verifier serving on")[1]
    cells = json.loads((tmp_path / "out" / "sweep.json").read_text())["cells"]
    assert [(c["mode"], c["concurrency"]) for c in cells] == [
        (m, c) for m in ("off", "on", "ngram") for c in (1, 2)
    ]
    for cell in cells:
        if cell["mode"] == "off":
            assert cell["acceptance"] is None
        else:  # the drafts really came: rounds were drafted and verified
            assert cell["reasons"] == {"on": 2} and cell["acceptance"] is not None


def test_warm_up_lets_the_drafter_see_every_prompt_where_the_mode_may_draft(monkeypatch):
    # `auto` decides a few-token request plain, so its warm-up asks `on`: the drafter
    # caches each prompt before the timed cells, as `on`'s warm-up makes it do
    from bench import sweep as sweep_module
    from bench.prompts import WARM_UP_TOKENS

    asked = []

    async def fake_cell(address, conversations, mode, concurrency, requests, max_new, *rest):
        if max_new == WARM_UP_TOKENS:
            asked.append(mode)
        result = {"ttft": 0.01, "tpot": 0.01, "tokens": max_new, "reason": "on", "route": ""}
        return [{**result, "drafted": 0, "accepted": 0, "rounds": 0}] * requests, 1.0

    async def fake_stream(stub, messages, mode, max_new, route=""):  # the timed turns
        result = {"ttft": 0.01, "tpot": 0.01, "tokens": max_new, "reason": mode}
        return {**result, "drafted": 0, "accepted": 0, "rounds": 0}

    monkeypatch.setattr(sweep_module, "run_cell", fake_cell)
    monkeypatch.setattr(sweep_module, "stream_one", fake_stream)
    conversations = [[{"role": "user", "content": "abc"}]]
    report = sweep_module.sweep(
        "127.0.0.1:9",
        conversations,
        ["off", "auto", "on@plain"],
        [2],
        1,
        4,
        progress=lambda _: None,
    )
    assert asked == ["off", "on", "on"]
    assert [c["mode"] for c in report["cells"]] == ["off", "auto", "on@plain"]


def test_the_modes_take_turns_wave_by_wave_and_each_counts_its_own_time(monkeypatch):
    # each wave of `concurrency` requests goes to every mode in turn, A B B A by wave, all
    # of a wave at once, and a mode's tokens/s is its tokens over its own waves' time:
    # `off` here takes 4x as long a request
    from bench import sweep as sweep_module

    sent, running, most = [], [0], [0]

    async def fake_cell(address, conversations, mode, concurrency, requests, *rest):
        return [{"tokens": 1, "reason": mode, "route": ""}] * requests, 1.0

    async def fake_stream(stub, messages, mode, max_new, route=""):
        sent.append((mode, route, messages[0]["content"]))
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.04 if mode == "off" else 0.01)
        running[0] -= 1
        result = {"ttft": 0.001, "tpot": 0.001, "tokens": max_new, "reason": mode}
        return {**result, "drafted": 0, "accepted": 0, "rounds": 1}

    monkeypatch.setattr(sweep_module, "run_cell", fake_cell)
    monkeypatch.setattr(sweep_module, "stream_one", fake_stream)
    conversations = [[{"role": "user", "content": x}] for x in "abc"]

    def turns(levels, requests, waves=1):
        sent.clear()
        most[0] = 0
        return sweep_module.sweep(
            "127.0.0.1:9",
            conversations,
            ["off", "on@plain"],
            levels,
            requests,
            8,
            progress=lambda _: None,
            repeats=2,
            waves=waves,
        )

    report = turns([1], 4)  # one request a wave
    off, on = ("off", "", "a"), ("on", "plain", "a")
    b = [(m, r, "b") for m, r, _ in (off, on)]
    c = [(m, r, "c") for m, r, _ in (off, on)]
    a2 = [(m, r, "a") for m, r, _ in (off, on)]
    first = [off, on, b[1], b[0], c[0], c[1], a2[1], a2[0]]
    assert sent == first + [on, off, b[0], b[1], c[1], c[0], a2[0], a2[1]]
    assert most[0] == 1
    off_cell, on_cell = report["cells"]
    assert off_cell["requests"] == on_cell["requests"] == 8
    assert off_cell["tokens"] == on_cell["tokens"] == 64
    assert len(off_cell["runs_tokens_per_s"]) == len(on_cell["runs_tokens_per_s"]) == 2
    # 4 where each mode counts its own waves' time, 1 where both counted all of it; the
    # sleeps overshoot on a loaded machine (4.8 seen in CI), hence the wide bounds
    assert 2.5 < on_cell["tokens_per_s"] / off_cell["tokens_per_s"] < 8

    report = turns([2], 5)  # waves of 2 prompts at once: (a b), (c a), (b)
    waves = [sorted(sent[i : i + 2]) for i in range(0, 8, 2)] + [sent[8:9], sent[9:10]]
    assert waves[:2] == [sorted([off, b[0]]), sorted([on, b[1]])]
    assert waves[2:4] == [sorted([c[1], a2[1]]), sorted([c[0], a2[0]])]
    assert waves[4:] == [[b[0]], [b[1]]]
    assert len(sent) == 20 and most[0] == 2
    off_cell, on_cell = report["cells"]
    assert off_cell["requests"] == on_cell["requests"] == 10
    assert 2.5 < on_cell["tokens_per_s"] / off_cell["tokens_per_s"] < 8

    report = turns([2, 4], 1, waves=3)  # at least 3 waves a cell: 6 and 12 requests a run
    assert [c["requests"] for c in report["cells"]] == [12, 24, 12, 24]
    assert len(sent) == 72 and most[0] == 4


def test_a_raw_prompt_item_is_sent_as_a_prompt_and_a_chat_as_messages():
    """The `fim` workload's items are raw prompts (no chat template); the others chats."""
    from bench.sweep import stream_one
    from protos.specd.v1 import router_pb2

    sent = []

    class Stub:
        def GenerateStream(self, request):  # noqa: N802 - the gRPC stub's name
            sent.append(request)

            async def replies():
                yield router_pb2.GenerateStreamResponse(token_ids=[1], finish_reason="stop")

            return replies()

    chat = [{"role": "user", "content": "hi"}]
    for item in ("<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>", chat):
        result = asyncio.run(stream_one(Stub(), item, "on", 4))
        assert result["tokens"] == 1
    assert sent[0].WhichOneof("input") == "prompt" and sent[0].prompt.startswith("<|fim_prefix|>")
    assert (
        sent[1].WhichOneof("input") == "messages" and sent[1].messages.messages[0].content == "hi"
    )


def test_the_parity_bench_compares_seeded_sampling_across_modes(cluster, tmp_path):
    """`specd bench parity --temperature 1 --modes off,on,auto`: each prompt's seeded
    sample is the same in every mode (the tiny pair drafts, and its drafts are taken and
    refused); a prompt of its own seed each, so the prompts' samples differ."""
    from bench.parity import run

    chats = tmp_path / "chats.jsonl"
    prompts = ["abcabcabc", "hello there", "xyz xyz", "one two three"]
    chats.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    report = run(cluster.router, [str(chats)], 16, ("off", "on", "auto"), 1.0, 7)
    r = report[str(chats)]
    assert (r["identical"], r["prompts"]) == (4, 4), r
    greedy = run(cluster.router, [str(chats)], 16)[str(chats)]
    assert [x["output"] for x in r["rows"]] != [x["output"] for x in greedy["rows"]]  # sampled
