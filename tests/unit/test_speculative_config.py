"""vLLM's `--speculative-config` on `specd up`: each key reaches the service that owns
its meaning (the drafter's model and proposer, the verifier's deepest round, the router's
policy), and what specd does not do is refused, naming it, before anything starts."""

from __future__ import annotations

import pytest

from launcher.cli import main
from launcher.cli_parser import build_parser, serve_config
from launcher.local_cluster import CLI, cluster_children
from router.decide import Load, decide
from router.policy import PolicyError, routing_policy
from specd.config import DrafterConfig, RouterConfig, VerifierConfig
from specd.params import SamplingParams
from specd.proposal import DraftState
from tests.conftest import make_tiny


def _configs(*flags: str) -> dict:
    """Each child's config, as `specd up FLAGS` would start it."""
    up = build_parser().parse_args(["up", *flags])
    return {c.role: serve_config(c.argv[len(CLI) :]) for c in cluster_children(up)}


def _policy(router: RouterConfig):
    return routing_policy(router.policy_file, router.policy)


def test_a_draft_model_drafts_alone_at_every_routes_k():
    spec = '{"method": "draft_model", "model": "small-draft", "num_speculative_tokens": 10}'
    c = _configs("--speculative-config", spec)
    assert (c["drafter"].model, c["drafter"].proposer) == ("small-draft", "draft")
    # deeper than the verifier's default of 8: its bound follows, the drafter's (16) holds it
    assert c["verifier"].engine.max_draft_tokens == 10
    assert c["drafter"].max_draft_tokens == DrafterConfig.max_draft_tokens
    policy = _policy(c["router"])
    assert policy.default.num_draft_tokens == 10
    for route in ("code", "edit", "chat"):
        assert policy.routes[route].num_draft_tokens == 10
    assert policy.routes["batch"].speculation == "off"  # the built-in routes stay
    assert policy.default.max_batch_size == 8  # not given: the built-in bound
    # a model alone is vLLM's draft_model too; deeper than the drafter's 16, both follow
    c = _configs("--speculative-config", '{"model": "small-draft", "num_speculative_tokens": 20}')
    assert c["drafter"].proposer == "draft"
    assert c["drafter"].max_draft_tokens == c["verifier"].engine.max_draft_tokens == 20


def test_without_a_config_or_a_method_specd_keeps_its_own_drafter():
    c = _configs()
    assert (c["drafter"].model, c["drafter"].proposer) == ("default-draft", "combined")
    assert (c["router"].policy, c["router"].policy_file) == ("", "")
    c = _configs("--proposer", "suffix", "--speculative-config", '{"num_speculative_tokens": 3}')
    assert (c["drafter"].model, c["drafter"].proposer) == ("default-draft", "suffix")
    assert _policy(c["router"]).routes["code"].num_draft_tokens == 3


def test_ngram_looks_up_its_window_in_the_verifier_with_no_drafter(tmp_path):
    spec = '{"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 2}'
    c = _configs("--target", "small", "--speculative-config", spec)
    assert set(c) == {"verifier", "router"}  # no drafter process, no draft model
    verifier = c["verifier"]
    assert (verifier.lookup, verifier.drafter, verifier.model) == (True, "", "small")
    assert (verifier.prompt_lookup_max, verifier.prompt_lookup_min) == (3, 2)
    assert c["router"].policy == ""  # no k, no batch size: the built-in policy
    one = _configs("--speculative-config", '{"method": "ngram", "prompt_lookup_max": 3}')
    assert (one["verifier"].prompt_lookup_max, one["verifier"].prompt_lookup_min) == (3, 3)
    neither = _configs("--speculative-config", '{"method": "ngram"}')["verifier"]
    assert (neither.prompt_lookup_max, neither.prompt_lookup_min) == (4, 1)  # specd's own
    assert _configs("--proposer", "ngram")["verifier"].lookup  # specd's own flag alike
    assert not _configs("--proposer", "draft")["verifier"].lookup
    with pytest.raises(ValueError, match="no drafter runs"):
        _configs("--proposer", "ngram", "--drafter-flags=--top-m 8")

    from drafter_service.server import build_proposer
    from verifier_service.startup import build_engine

    folder = tmp_path / "tiny"
    make_tiny("llama", folder)
    # the last token, 7, came before (followed by 9); its last two, 9 7, did not
    tokens = [5, 7, 9, 1, 9, 7]
    state = DraftState(seq_id=1, tokens=tokens, params=SamplingParams(), k=3)
    for low, drafts in ((1, [9, 1, 9]), (2, [])):
        # in the verifier (as `specd up` runs it) and in a drafter (`--proposer ngram`)
        config = VerifierConfig(model=str(folder), lookup=True, prompt_lookup_min=low)
        engine, _ = build_engine(config)
        assert engine.proposer.drafter == "ngram"
        assert engine.proposer.propose([state])[0].tokens == drafts
        config = DrafterConfig(model=str(folder), proposer="ngram", prompt_lookup_min=low)
        proposer, _, name = build_proposer(config)
        assert name == "ngram"
        assert proposer.propose([state])[0].tokens == drafts


def test_a_batch_size_schedule_bounds_where_the_router_lets_a_request_draft():
    schedule = '{"num_speculative_tokens_per_batch_size": [[1, 4, 6], [5, 16, 2], [17, 64, 0]]}'
    policy = _policy(_configs("--speculative-config", schedule)["router"])
    code = policy.routes["code"]
    assert code.num_draft_tokens == 6  # the largest k given: `auto` drafts fewer as it pays
    # a route drafts while fewer than its max_batch_size run (the verifier holds a batch of
    # that many plain): here up to 16, the last batch size given a k
    assert code.max_batch_size == 17
    assert decide(code, "auto", 0.0, Load(running=16)).reason == "auto"
    assert decide(code, "auto", 0.0, Load(running=17)).reason == "off:batch"
    # vLLM 0.x's bound: none drafts where that many or more run, as specd's
    policy = _policy(_configs("--speculative-config", '{"disable_by_batch_size": 4}')["router"])
    assert policy.default.max_batch_size == 4
    assert decide(policy.routes["chat"], "auto", 0.0, Load(running=3)).reason == "auto"
    assert decide(policy.routes["chat"], "auto", 0.0, Load(running=4)).reason == "off:batch"
    assert policy.routes["chat"].num_draft_tokens == 3  # k not given: the route's own


REFUSED = [
    ('{"method": "eagle3", "model": "x"}', "method 'eagle3': specd drafts with a draft model"),
    ('{"method": "draft_model"}', "method draft_model needs a model"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens: Input should be greater than"),
    ('{"num_speculative_tokens": "5"}', "num_speculative_tokens: Input should be a valid integer"),
    ('{"enforce_eager": true}', "enforce_eager: not a key specd takes (it takes method, model"),
    ("{method: ngram}", "not a JSON object"),
    ('{"draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size: Input should be less"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}', "5 is over"),
    ('{"model": "small-draft", "prompt_lookup_max": 3}', "are for method ngram"),
    ('{"method": "ngram", "suffix_decoding_max_cached_requests": 0}', "is for method suffix"),
    ('{"num_speculative_tokens_per_batch_size": [[4, 1, 2]]}', "got [4, 1, 2]"),
    ('{"num_speculative_tokens_per_batch_size": [[1, 8, 0]]}', "no batch size a k > 0"),
    (
        '{"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 8, 4]]}',
        "num_speculative_tokens 3 and the largest k",
    ),
]


@pytest.mark.parametrize(("spec", "said"), REFUSED)
def test_what_specd_does_not_do_is_refused_before_anything_starts(spec, said, capsys):
    assert main(["up", "--http-port", "0", "--speculative-config", spec]) == 2
    err = capsys.readouterr().err
    assert said in err
    assert "--speculative-config" in err and "Traceback" not in err


def test_llama_servers_draft_max_is_every_routes_k(capsys):
    c = _configs("--draft-max", "12")
    assert c["verifier"].engine.max_draft_tokens == 12
    assert c["drafter"].proposer == "combined"  # specd's own drafter, as without it
    policy = _policy(c["router"])
    assert [policy.routes[r].num_draft_tokens for r in ("code", "edit", "chat")] == [12] * 3
    c = _configs("--draft-max", "5", "--speculative-config", '{"num_speculative_tokens": 5}')
    assert _policy(c["router"]).default.num_draft_tokens == 5
    for flags, said in (
        (["--draft-max", "-1"], "specd up: --draft-max: --draft-max must be >= 0, got -1"),
        (
            ["--draft-max", "4", "--speculative-config", '{"num_speculative_tokens": 5}'],
            "--draft-max 4 and num_speculative_tokens 5: give one",
        ),
        (["--draft-max", "4", "--policy-file", "deploy/policy.yaml"], "specd up: --draft-max: a"),
    ):
        assert main(["up", "--http-port", "0", *flags]) == 2
        assert said in capsys.readouterr().err


def test_the_config_and_specd_ups_own_flags_must_agree(capsys):
    for flags, said in (
        (["--draft", "small-draft"], "--draft small-draft and the speculative config's tiny"),
        (["--proposer", "ngram"], "--proposer ngram and the speculative config's draft"),
        (["--policy-file", "deploy/policy.yaml"], "set its routes' num_draft_tokens"),
    ):
        spec = '{"model": "tiny", "num_speculative_tokens": 4}'
        assert main(["up", "--http-port", "0", *flags, "--speculative-config", spec]) == 2
        assert said in capsys.readouterr().err
    # the same value said twice is one
    spec = '{"model": "small-draft"}'
    c = _configs("--draft", "small-draft", "--proposer", "draft", "--speculative-config", spec)
    assert (c["drafter"].model, c["drafter"].proposer) == ("small-draft", "draft")


def test_the_routers_policy_as_text():
    assert routing_policy("", "default: {num_draft_tokens: 3}").default.num_draft_tokens == 3
    assert routing_policy("", "").routes["code"].num_draft_tokens == 6  # the built-in
    with pytest.raises(PolicyError, match=r"^--policy: default\.num_draft_tokens"):
        routing_policy("", "default: {num_draft_tokens: '3'}")
    with pytest.raises(PolicyError, match=r"^--policy: not YAML"):
        routing_policy("", "routes: {code: [unclosed")
    with pytest.raises(ValueError, match="policy and policy_file: name one"):
        RouterConfig(policy="default: {}", policy_file="deploy/policy.yaml")


def _sglang(*flags: str) -> dict:
    return _configs("--speculative-algorithm", *flags)


def test_sglangs_standalone_flags_are_the_draft_models_depth_and_tree():
    # SGLang's T counts the last committed token: a tree of 4 drafts and 2 runner-ups
    c = _sglang(
        *("STANDALONE", "--speculative-draft-model-path", "small-draft"),
        *("--speculative-num-steps", "4", "--speculative-eagle-topk", "2"),
        *("--speculative-num-draft-tokens", "7"),
    )
    assert (c["drafter"].model, c["drafter"].proposer) == ("small-draft", "draft")
    assert c["drafter"].alternatives == 2
    policy = _policy(c["router"])
    assert [policy.routes[r].num_draft_tokens for r in ("code", "edit", "chat")] == [4] * 3
    # topk 1 is a chain of num_steps, T or not (SGLang sets T to num_steps + 1)
    for extra in ((), ("--speculative-num-draft-tokens", "9")):
        chain = _sglang(
            *("standalone", "--speculative-draft-model-path", "small-draft"),
            *("--speculative-num-steps", "6", "--speculative-eagle-topk", "1", *extra),
        )
        assert chain["drafter"].alternatives == 0
        assert _policy(chain["router"]).default.num_draft_tokens == 6
    # T alone: a chain of T - 1; neither depth nor tree: specd's own (its tree, its k)
    alone = _sglang(
        *("STANDALONE", "--speculative-draft-model-path", "small-draft"),
        *("--speculative-num-draft-tokens", "5"),
    )
    assert _policy(alone["router"]).default.num_draft_tokens == 4
    assert alone["drafter"].alternatives == 0
    own = _sglang("STANDALONE", "--speculative-draft-model-path", "small-draft")
    assert own["drafter"].alternatives == DrafterConfig.alternatives
    assert own["router"].policy == ""


def test_sglangs_ngram_is_the_lookup_its_window_and_length():
    c = _configs(
        *("-m", "small", "--speculative-algorithm", "NGRAM"),
        *("--speculative-num-draft-tokens", "6", "--speculative-ngram-max-match-window-size", "3"),
    )
    verifier = c["verifier"]
    assert "drafter" not in c and (verifier.lookup, verifier.model) == (True, "small")
    # one end given: the other is SGLang's default (min 1, max 12), not vLLM's rule
    assert (verifier.prompt_lookup_max, verifier.prompt_lookup_min) == (3, 1)
    assert _policy(c["router"]).default.num_draft_tokens == 5
    low = _sglang("NGRAM", "--speculative-ngram-min-match-window-size", "2")["verifier"]
    assert (low.prompt_lookup_max, low.prompt_lookup_min) == (12, 2)


SGLANG_REFUSED = [
    (["--speculative-algorithm", "EAGLE3"], "EAGLE, EAGLE3 and NEXTN read the target's"),
    (["--speculative-algorithm", "STANDALONE"], "STANDALONE drafts with --speculative-draft"),
    (["--speculative-num-steps", "3"], "give --speculative-algorithm (STANDALONE or NGRAM)"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3"], "NGRAM takes"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "1"], "must be >= 2"),
    (["--speculative-algorithm", "NGRAM", "--draft", "small-draft"], "loads no draft model"),
    (
        ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "x"]
        + ["--speculative-ngram-max-match-window-size", "3"],
        "the --speculative-ngram-* flags are for NGRAM",
    ),
    (
        ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "x"]
        + ["--speculative-eagle-topk", "4", "--speculative-num-steps", "3"],
        "takes its depth, --speculative-num-steps, and its size",
    ),
    (
        ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "x"]
        + ["--speculative-eagle-topk", "4", "--speculative-num-steps", "3"]
        + ["--speculative-num-draft-tokens", "8"],
        "num-draft-tokens 8 with --speculative-num-steps 3: specd's tree holds",
    ),
    (
        ["--speculative-algorithm", "NGRAM", "--speculative-config", '{"method": "ngram"}'],
        "--speculative-config and SGLang's --speculative-algorithm: give one",
    ),
]


def test_llama_servers_spec_type_and_its_draft_flags_under_their_current_names():
    """llama-server's `--spec-type` and `--spec-draft-*` (its names since `--draft-max`
    was removed) as the drafts specd runs for them."""
    looked = _configs("--spec-type", "ngram-simple", "--spec-draft-n-max", "8")
    assert set(looked) == {"verifier", "router"} and looked["verifier"].lookup
    assert _policy(looked["router"]).routes["code"].num_draft_tokens == 8
    drafts = _configs(
        *("--spec-type", "draft-simple", "--spec-draft-model", "small-draft"),
        *("--spec-draft-p-min", "0.5", "--spec-draft-ngl", "0"),
    )["drafter"]
    assert (drafts.proposer, drafts.model, drafts.p_min, drafts.device) == (
        "draft", "small-draft", 0.5, "cpu",
    )  # fmt: skip
    both = _configs("--spec-type", "ngram-mod,draft-simple")
    assert both["drafter"].proposer == "combined" and not both["verifier"].lookup
    assert both["router"].policy == ""  # no k given: the built-in policy
    plain = _policy(_configs("--spec-type", "none")["router"])
    assert plain.default.speculation == "off"
    assert {route.speculation for route in plain.routes.values()} == {"off"}


LLAMA_SPEC_REFUSED = [
    (["--spec-type", "draft-eagle3"], "draft-eagle3 read the target's hidden states"),
    (["--spec-type", "ngram-fancy"], "ngram-fancy: give none, draft-simple or ngram-simple"),
    (["--spec-type", "none,draft-simple"], "none and a type that drafts: give one"),
    (["--spec-type", "ngram-simple", "--speculative-config", "{}"], "give one"),
    (["--spec-type", "none", "--policy-file", "p.yaml"], "set its routes' speculation: off"),
]


# each refusal as `specd up` says it, under the flag that asked
REFUSED = [(flags, said, "--speculative-") for flags, said in SGLANG_REFUSED] + [
    (flags, said, "--spec-type: ") for flags, said in LLAMA_SPEC_REFUSED
]


@pytest.mark.parametrize(("flags", "said", "flag"), REFUSED)
def test_what_sglangs_and_llama_servers_flags_ask_and_specd_does_not_do_is_refused(
    flags, said, flag, capsys
):
    assert main(["up", "--http-port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and err.startswith(f"specd up: {flag}")
    assert "Traceback" not in err
