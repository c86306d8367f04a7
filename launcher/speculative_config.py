"""vLLM's `--speculative-config` for `specd up`: the JSON a vLLM user starts a server with
(`vllm serve TARGET --speculative-config '{...}'`), read as the specd settings it stands for
(llama-server's `--draft-max N` is its num_speculative_tokens N; SGLang's `--speculative-*`
launch flags are read as the same config: sglang_config below).

    no method and no model               -> specd's own drafter (--proposer, --draft)
    method draft_model, or a model alone -> the drafter drafts with that model alone
                                           (--draft MODEL --proposer draft)
    method ngram (or ngram_gpu)          -> a lookup in the request's own text
                                           (--proposer ngram; prompt_lookup_max / _min,
                                           one alone both, as in vLLM; neither: 4 and 1)
    method suffix                        -> --proposer suffix (a lookup in the route's
                                           earlier responses too, else the draft model);
                                           suffix_decoding_max_cached_requests 0: none kept
    num_speculative_tokens N             -> every route's num_draft_tokens (the most a round
                                           drafts; `auto` drafts fewer where fewer pay)
    num_speculative_tokens_per_batch_size -> its largest k as N, and no drafting past the
                                           largest batch size it gives a k > 0
    disable_by_batch_size B (vLLM 0.x)   -> no drafting where B or more run (as vLLM's)
    draft_tensor_parallel_size           -> 1 (one process drafts)

Methods that read the target's hidden states (EAGLE, MTP, Medusa, ...) are refused: specd's
drafter runs in a process of its own, beside the target, not inside it. So is any other key
vLLM has, naming the ones taken here: a setting that would be ignored is said, not dropped."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.policy import BUILTIN_POLICY
from specd.config import DrafterConfig, EngineConfig

PROPOSER_OF = {"draft_model": "draft", "ngram": "ngram", "ngram_gpu": "ngram", "suffix": "suffix"}
Positive = Annotated[int, Field(ge=1)]


class VllmSpeculativeConfig(BaseModel):
    """The keys of vLLM's SpeculativeConfig that specd has a meaning for."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    method: str | None = None
    model: str | None = None
    num_speculative_tokens: Positive | None = None
    # (first batch size, last batch size, k), both ends included
    num_speculative_tokens_per_batch_size: list[tuple[Positive, Positive, int]] | None = None
    disable_by_batch_size: Positive | None = None
    prompt_lookup_max: Positive | None = None
    prompt_lookup_min: Positive | None = None
    draft_tensor_parallel_size: Annotated[int, Field(ge=1, le=1)] | None = None
    suffix_decoding_max_cached_requests: Annotated[int, Field(ge=0)] | None = None


@dataclass
class Speculation:
    """What `specd up` runs for a speculative config: the drafter's model and proposer,
    flags for each role, and the router's policy (None: the built-in one or the file)."""

    draft: str
    proposer: str
    drafter_flags: list[str] = field(default_factory=list)
    verifier_flags: list[str] = field(default_factory=list)
    policy: dict | None = None


# SGLang's launch flags (`python -m sglang.launch_server --speculative-algorithm ...`) that
# specd has a meaning for, as `specd up` names them in its arguments
SGLANG_FLAGS = (
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_ngram_min_match_window_size",
    "speculative_ngram_max_match_window_size",
)
SGLANG_METHOD = {"STANDALONE": "draft_model", "NGRAM": "ngram"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def sglang_config(given: dict) -> tuple[VllmSpeculativeConfig, int | None]:
    """SGLang's flags (`given`: SGLANG_FLAGS' values given) as vLLM's config and the
    drafter's `alternatives` (None: its own). SGLang counts a round's verified tokens,
    the last committed one among them: its num_draft_tokens T is k + 1 for a chain, and a
    tree of depth num_steps with T - 1 drafts in all, where eagle_topk > 1. specd's tree
    hangs a draft's runner-up beside it: the T - 1 - k runner-ups of the first drafts."""
    for name, value in given.items():
        least = 2 if name == "speculative_num_draft_tokens" else 1  # k + 1 at the least
        if isinstance(value, int) and value < least:
            raise ValueError(f"{_flag(name)} must be >= {least}, got {value}")
    algorithm = given.get("speculative_algorithm")
    if algorithm is None:
        raise ValueError("give --speculative-algorithm (STANDALONE or NGRAM) with the others")
    method = SGLANG_METHOD.get(algorithm.upper())
    if method is None:
        raise ValueError(
            f"--speculative-algorithm {algorithm}: specd drafts with a draft model of its own "
            "(STANDALONE) or a lookup in the request's text (NGRAM); EAGLE, EAGLE3 and NEXTN "
            "read the target's hidden states, which specd's drafter, a process of its own, "
            "does not have"
        )
    steps = given.get("speculative_num_steps")
    topk = given.get("speculative_eagle_topk")
    tokens = given.get("speculative_num_draft_tokens")
    window = "speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size"
    k = steps if steps is not None else None if tokens is None else tokens - 1
    if method == "ngram":
        taken = [_flag(n) for n in given if n.endswith(("path", "steps", "topk"))]
        if taken:
            raise ValueError(
                f"{', '.join(taken)}: NGRAM takes a draft's length "
                "(--speculative-num-draft-tokens) and its match window"
            )
        low, high = (given.get(n) for n in window)
        if (low is None) != (high is None):  # one given: the other is SGLang's default
            low, high = low or 1, high or 12
        spec = VllmSpeculativeConfig(
            method=method, num_speculative_tokens=k, prompt_lookup_min=low, prompt_lookup_max=high
        )
        return spec, None
    if any(n in given for n in window):
        raise ValueError("the --speculative-ngram-* flags are for NGRAM")
    if "speculative_draft_model_path" not in given:
        raise ValueError("STANDALONE drafts with --speculative-draft-model-path")
    spec = VllmSpeculativeConfig(
        method=method, model=given.get("speculative_draft_model_path"), num_speculative_tokens=k
    )
    if steps is None and topk is None and tokens is None:
        return spec, None  # neither depth nor tree: specd's own, as vLLM's config without k
    if (topk or 1) == 1:  # a chain: SGLang takes T as num_steps + 1 whatever is given
        return spec, 0
    if steps is None or tokens is None:
        raise ValueError(
            "a tree (--speculative-eagle-topk over 1) takes its depth, "
            "--speculative-num-steps, and its size, --speculative-num-draft-tokens"
        )
    if not steps + 1 <= tokens <= 2 * steps + 1:
        raise ValueError(
            f"--speculative-num-draft-tokens {tokens} with --speculative-num-steps {steps}: "
            f"specd's tree holds the {steps} drafts and a runner-up beside each at most, "
            f"{steps + 1} to {2 * steps + 1} tokens with the last committed one"
        )
    return spec, tokens - 1 - steps


# llama-server's `--spec-type` names (its common/speculative.cpp): the lookups specd runs
# as its own, and the drafts that read the target's hidden states
LLAMA_LOOKUPS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
LLAMA_HIDDEN = ("draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark")


def llama_spec_type(types: str, draft: str) -> tuple[VllmSpeculativeConfig, bool]:
    """llama-server's `--spec-type` (comma-separated) as vLLM's config, and whether every
    route is off (`none`): draft-simple drafts with `draft` alone, the lookups are vLLM's
    ngram, both are specd's own drafter (the lookup where the text repeats, else the
    model)."""
    names = [name.strip() for name in types.split(",") if name.strip()]
    hidden = [name for name in names if name in LLAMA_HIDDEN]
    if hidden:
        raise ValueError(
            f"{', '.join(hidden)} read the target's hidden states, which specd's drafter, a "
            "process of its own, does not have; it takes draft-simple and the ngram-* types"
        )
    unknown = [name for name in names if name not in ("none", "draft-simple", *LLAMA_LOOKUPS)]
    if unknown or not names:
        raise ValueError(
            f"{', '.join(unknown) or 'nothing'}: give none, draft-simple or "
            f"{', '.join(LLAMA_LOOKUPS)}, comma-separated"
        )
    if "none" in names:
        if set(names) != {"none"}:
            raise ValueError("none and a type that drafts: give one")
        return VllmSpeculativeConfig(), True
    drafts, looks = "draft-simple" in names, any(name in LLAMA_LOOKUPS for name in names)
    if drafts and looks:
        return VllmSpeculativeConfig(), False
    if drafts:
        return VllmSpeculativeConfig(method="draft_model", model=draft), False
    return VllmSpeculativeConfig(method="ngram"), False


def parse(text: str) -> VllmSpeculativeConfig:
    """The JSON text as a config; ValueError names each key it refuses and why."""
    try:
        return VllmSpeculativeConfig.model_validate_json(text)
    except ValidationError as exc:
        taken = ", ".join(VllmSpeculativeConfig.model_fields)
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err["loc"])
            if err["type"] == "extra_forbidden":
                parts.append(f"{where}: not a key specd takes (it takes {taken})")
            elif err["type"].startswith("json"):
                parts.append(f"not a JSON object: {err['msg']}")
            else:
                parts.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
        raise ValueError("; ".join(parts)) from None


def speculation(args) -> Speculation:
    """`specd up`'s drafter, proposer and policy, with `--speculative-config` (JSON text,
    or None), SGLang's flags (SGLANG_FLAGS, None where not given), llama-server's
    `--spec-type` (None where not given) and `--draft-max` (its num_speculative_tokens; 0 =
    not given) over `--draft`, `--proposer` and `--policy-file`; ValueError where they ask
    what specd does not do or what those flags say otherwise."""
    text, draft_max, spec_type = args.speculative_config, args.draft_max, args.spec_type
    sglang = {n: getattr(args, n) for n in SGLANG_FLAGS if getattr(args, n) is not None}
    if text is None and not sglang and spec_type is None and draft_max == 0:
        return Speculation(args.draft, args.proposer)
    flag = "--speculative-config" if text is not None else "--draft-max"
    flag = "--spec-type" if spec_type is not None else flag
    flag = _flag(next(iter(sglang))) if sglang else flag
    try:
        alternatives, off = None, False
        given = [
            name
            for name, on in (
                ("--speculative-config", text is not None),
                (f"SGLang's {flag}", bool(sglang)),
                ("--spec-type", spec_type is not None),
            )
            if on
        ]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)}: give one")
        if sglang:
            spec, alternatives = sglang_config(sglang)
        elif spec_type is not None:
            spec, off = llama_spec_type(spec_type, args.draft)
        else:
            spec = VllmSpeculativeConfig() if text is None else parse(text)
        if draft_max < 0:
            raise ValueError(f"--draft-max must be >= 0, got {draft_max}")
        if draft_max:
            if spec.num_speculative_tokens not in (None, draft_max):
                raise ValueError(
                    f"--draft-max {draft_max} and num_speculative_tokens "
                    f"{spec.num_speculative_tokens}: give one"
                )
            spec = spec.model_copy(update={"num_speculative_tokens": draft_max})
        out = _speculation(args, spec)
        if off:
            _every_route_off(args, out)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    if alternatives is not None:
        out.drafter_flags += ["--alternatives", str(alternatives)]
    return out


def _every_route_off(args, out: Speculation) -> None:
    """llama-server's `--spec-type none`: the policy with every route `off` (a request may
    still ask for `on`)."""
    if args.policy_file:
        raise ValueError("none with --policy-file: set its routes' speculation: off there")
    policy = copy.deepcopy(out.policy or BUILTIN_POLICY)
    for entry in [policy["default"], *policy["routes"].values()]:
        entry["speculation"] = "off"
    out.policy = policy


def _speculation(args, spec: VllmSpeculativeConfig) -> Speculation:
    method = spec.method or ("draft_model" if spec.model else None)
    if method is not None and method not in PROPOSER_OF:
        raise ValueError(
            f"method {method!r}: specd drafts with a draft model of its own (draft_model), "
            "a lookup in the request's text (ngram) or in the route's earlier responses too "
            "(suffix); EAGLE, MTP and Medusa heads read the target's hidden states, which "
            "specd's drafter, a process of its own, does not have"
        )
    if method == "draft_model" and not spec.model:
        raise ValueError("method draft_model needs a model")
    if method is None:  # neither: specd's own drafter (--proposer, --draft)
        proposer = args.proposer
    else:
        proposer = PROPOSER_OF[method]
        _one_way("--proposer", args.proposer, DrafterConfig.proposer, proposer)
    # a lookup alone loads no model: it reads the target's vocabulary size
    draft = spec.model or (args.target if proposer == "ngram" else args.draft)
    if proposer == "ngram" and args.draft != DrafterConfig.model:
        raise ValueError(f"--draft {args.draft} and a lookup, which loads no draft model: give one")
    if spec.model:
        _one_way("--draft", args.draft, DrafterConfig.model, spec.model)
    out = Speculation(draft, proposer)
    _lookup_window(spec, proposer, out)
    if spec.suffix_decoding_max_cached_requests is not None:
        if proposer != "suffix":
            raise ValueError("suffix_decoding_max_cached_requests is for method suffix")
        if spec.suffix_decoding_max_cached_requests == 0:
            out.drafter_flags.append("--no-suffix-shared")
    k, batch = _depth_and_batch(spec)
    if k is None and batch is None:
        return out
    if args.policy_file:
        raise ValueError(
            "a route's k and batch bound are the policy's: with --policy-file, set its "
            "routes' num_draft_tokens and max_batch_size there"
        )
    policy = copy.deepcopy(BUILTIN_POLICY)
    entries = [policy["default"], *policy["routes"].values()]
    for entry in entries if k is not None else ():
        if entry.get("speculation") != "off":
            entry["num_draft_tokens"] = k
    if batch is not None:
        policy["default"]["max_batch_size"] = batch
    out.policy = policy
    for flags, config in ((out.verifier_flags, EngineConfig), (out.drafter_flags, DrafterConfig)):
        if k is not None and k > config.max_draft_tokens:  # the most a round may ask for
            flags += ["--max-draft-tokens", str(k)]
    return out


def _one_way(flag: str, given: str, default: str, wanted: str) -> None:
    if given not in (default, wanted):
        raise ValueError(f"{flag} {given} and the speculative config's {wanted}: give one")


def _lookup_window(spec: VllmSpeculativeConfig, proposer: str, out: Speculation) -> None:
    low, high = spec.prompt_lookup_min, spec.prompt_lookup_max
    if low is None and high is None:
        return
    if proposer != "ngram":
        raise ValueError("prompt_lookup_max and prompt_lookup_min are for method ngram")
    high, low = high or low, low or high  # one given: the other is the same, as in vLLM
    if low > high:
        raise ValueError(f"prompt_lookup_min {low} is over prompt_lookup_max {high}")
    # a lookup runs in the verifier (launcher/local_cluster.py)
    out.verifier_flags += ["--prompt-lookup-max", str(high), "--prompt-lookup-min", str(low)]


def _depth_and_batch(spec: VllmSpeculativeConfig) -> tuple[int | None, int | None]:
    """(every route's k, the policy's max_batch_size: none drafts where that many run),
    each None where not given."""
    k, batch = spec.num_speculative_tokens, spec.disable_by_batch_size
    schedule = spec.num_speculative_tokens_per_batch_size
    if schedule is None:
        return k, batch
    if batch is not None:
        raise ValueError(
            "disable_by_batch_size and num_speculative_tokens_per_batch_size: give one"
        )
    for first, last, depth in schedule:
        if first > last or depth < 0:
            raise ValueError(
                "num_speculative_tokens_per_batch_size: each entry is (first batch size, "
                f"last batch size, k >= 0), got {[first, last, depth]}"
            )
    drafting = [(last, depth) for _, last, depth in schedule if depth > 0]
    if not drafting:
        raise ValueError("num_speculative_tokens_per_batch_size gives no batch size a k > 0")
    deepest = max(depth for _, depth in drafting)
    if k is not None and k != deepest:
        raise ValueError(
            f"num_speculative_tokens {k} and the largest k of "
            f"num_speculative_tokens_per_batch_size, {deepest}: give one"
        )
    # a route drafts while fewer than its max_batch_size run: the last size given a k, + 1
    return deepest, 1 + max(last for last, _ in drafting)
