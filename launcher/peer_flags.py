"""A vLLM, SGLang or llama-server launch command's flags on `specd up`, under their names:
the target in `vllm serve`'s place, the serving, device, thread and cache flags each role
owns (launcher.local_cluster hands them on), SGLang's speculative flags
(launcher.speculative_config reads them), and those that ask for what specd does anyway."""

from __future__ import annotations

import argparse
import json
import os

from specd.params import sampling_overrides

DEFAULT_TARGET = "default-target"  # specd up's target where none is named


def api_key(given: str) -> str:
    """The bearer token: the one given (`--api-key`, `--auth-token`), else $SPECD_API_KEY
    (which keeps it off the command line, as vLLM's VLLM_API_KEY), else none."""
    return given or os.environ.get("SPECD_API_KEY", "")


class Target(argparse.Action):
    """`specd up`'s target, from `--target` (or its peers' names) or `vllm serve`'s place
    for it: named twice, the names must agree."""

    def __call__(self, parser, namespace, value, option_string=None):
        if value is None:  # the place left empty
            return
        named = getattr(namespace, "target_named", None)  # by an earlier flag
        if named not in (None, value):
            parser.error(f"the target model named twice: {named} and {value}")
        namespace.target = namespace.target_named = value


# llama-server's sampling flags: the defaults of requests that leave them out
LLAMA_SAMPLERS = (
    (("--temp", "--temperature"), float, "temperature"),
    (("--top-k",), int, "top_k"),
    (("--top-p",), float, "top_p"),
    (("--min-p",), float, "min_p"),
)


def add_serving_flags(up) -> None:
    """What a vLLM, SGLang or llama-server launch command sets, under its names, for the
    role that owns it (launcher.local_cluster)."""
    serving = up.add_argument_group(
        "serving flags", "as vLLM's, SGLang's and llama-server's (0 or empty: the role's own)"
    )
    serving.add_argument(
        "--api-key",
        default="",
        help="clients send it as a bearer token, on both doors (the router reads it from a "
        "private file specd up writes; default: $SPECD_API_KEY, else none)",
    )
    serving.add_argument(
        "--served-model-name",
        "--alias",
        "-a",
        nargs="+",
        default=[],
        metavar="NAME",
        help="the model's ids to HTTP clients: the first answers, /v1/models lists each (vLLM's; "
        "the router's; default: the target's catalogue name)",
    )
    serving.add_argument(
        "--ssl-certfile",
        "--ssl-cert-file",
        default="",
        help="the HTTP port speaks HTTPS with this PEM certificate, the gRPC ports staying "
        "plain (the router's --http-tls-cert; llama-server's --ssl-cert-file)",
    )
    serving.add_argument(
        "--ssl-keyfile",
        "--ssl-key-file",
        default="",
        help="its PEM key (the router's --http-tls-key; llama-server's --ssl-key-file)",
    )
    serving.add_argument(
        "--slots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="llama-server's GET /slots on the HTTP port: a slot per sequence a verifier runs "
        "at once (the router's --slots; default: on, as llama-server's)",
    )
    serving.add_argument(
        "--max-num-seqs",
        "--max-running-requests",
        "--parallel",
        "-np",
        type=int,
        default=0,
        help="sequences each verifier runs at once (its --max-batch-size; default 0: its own)",
    )
    serving.add_argument(
        "--max-num-batched-tokens",
        "--chunked-prefill-size",
        "--ubatch-size",
        "-ub",
        type=int,
        default=0,
        help="tokens a verifier's forward feeds at most, prompt chunks and verification (its "
        "--max-batched-tokens; default 0: its own, 128 on a CPU, 512 on a GPU)",
    )
    serving.add_argument(
        "--batch-size",
        "-b",
        type=int,
        default=0,
        help="llama-server's logical batch: with -ub, a forward feeds the smaller of the two "
        "(default 0: none)",
    )
    serving.add_argument(
        "--n-predict",
        "--predict",
        "-n",
        type=int,
        default=0,
        help="the tokens a request that names no limit generates at most, -1: what the context "
        "leaves (the router's --default-max-new-tokens; default 0: its own, 256)",
    )
    serving.add_argument(
        "--max-model-len",
        "--context-length",
        "--ctx-size",
        "-c",
        type=int,
        default=0,
        help="the longest prompt + generation a request may ask for (the verifiers' "
        "--max-model-len; default 0: the model's context; llama-server divides -c among its "
        "-np slots, specd does not)",
    )
    serving.add_argument(
        "--chat-template",
        "--chat-template-file",
        default="",
        help="in place of the model's: a file, or the template's text (the router's)",
    )
    serving.add_argument(
        "--generation-config",
        choices=["auto", "vllm"],
        help="what a request's absent temperature, top_p, ... mean: auto, the model's "
        "generation_config.json; vllm, the OpenAI API's (the router's --sampling-defaults "
        "model or openai; default: the router's, model)",
    )
    serving.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no stats lines in the verifiers' logs (their --log-stats-interval 0)",
    )
    serving.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's, which specd does always: with tools and tool_choice auto, the model's "
        "calls are parsed (--tool-call-parser)",
    )
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        serving.add_argument(flag, default="", help="the router's (specd serve router --help)")
    serving.add_argument(
        "--seed",
        "--random-seed",
        type=int,
        metavar="N",
        help="sampled requests that name no seed take seeds of a sequence started from N, "
        "as if they had named them (the verifiers' --seed; SGLang's --random-seed; "
        "default: none, each its own random seed, as -1)",
    )
    serving.add_argument(
        "-s",
        dest="default_seed",
        type=int,
        metavar="N",
        help="llama-server's: the seed of every HTTP request that names none, so the same "
        "prompt samples alike (the router's --default-seed; default: none)",
    )
    serving.add_argument(
        "--override-generation-config",
        metavar="JSON",
        default="",
        help="sampling defaults for fields a request leaves out, e.g. '{\"temperature\": 0.2}' "
        "(the router's; default: none)",
    )
    for flag, what in (
        ("origins", "the sites whose pages may call the HTTP port (CORS)"),
        ("methods", "the methods those pages may use"),
        ("headers", "the headers those pages may send"),
    ):
        serving.add_argument(
            f"--allowed-{flag}",
            metavar="JSON",
            default="",
            help=f"vLLM's: {what}, a JSON list (the router's; default: its own, any)",
        )
    serving.add_argument(
        "--allow-credentials",
        action="store_true",
        help="vLLM's: those pages may send the browser's cookies (the router's)",
    )
    serving.add_argument(
        "--log-level",
        "--uvicorn-log-level",
        dest="child_log_level",
        choices=["trace", "debug", "info", "warning", "error", "critical"],
        help="SGLang's and vLLM's: the services' log level (their `specd --log-level`; trace "
        "is debug; default: `specd`'s own, info)",
    )
    for names, kind, key in LLAMA_SAMPLERS:
        serving.add_argument(
            *names,
            dest=key,
            type=kind,
            metavar="X",
            help=f"llama-server's: the default {key} (--override-generation-config's)",
        )


def forward_tokens(args) -> int:
    """The tokens a verifier's forward feeds at most (0: its own): llama-server's physical
    and logical batches (-ub, -b), a forward the smaller, or vLLM's and SGLang's names."""
    given = [n for n in (args.max_num_batched_tokens, args.batch_size) if n]
    return min(given, default=0)


def generation_overrides(args) -> str:
    """The router's --override-generation-config: vLLM's JSON with llama-server's sampling
    flags added (ValueError where both name one field, or the JSON is malformed)."""
    given = sampling_overrides(args.override_generation_config)
    for _, _, key in LLAMA_SAMPLERS:
        value = getattr(args, key)
        if value is None:
            continue
        if key in given:
            raise ValueError(f"{key} given in --override-generation-config and by its own flag")
        given[key] = value
    return json.dumps(given) if given else ""


def add_sglang_flags(up) -> None:
    """SGLang's speculative launch flags (launcher.speculative_config.sglang_config)."""
    sglang = up.add_argument_group(
        "SGLang's speculative flags",
        "as sglang.launch_server's (README: Coming from vLLM, SGLang or llama-server)",
    )
    sglang.add_argument(
        "--speculative-algorithm",
        metavar="STANDALONE|NGRAM",
        help="STANDALONE: the draft model alone; NGRAM: a lookup in the request's own text",
    )
    sglang.add_argument(
        "--speculative-draft-model-path", metavar="MODEL", help="STANDALONE's draft model"
    )
    for name, said in (
        ("num-steps", "drafts a round (k)"),
        ("eagle-topk", "1: a chain; more: a draft's runner-up beside it too"),
        ("num-draft-tokens", "tokens a round verifies, the last committed one among them"),
        ("ngram-min-match-window-size", "NGRAM: the shortest run of last tokens looked up"),
        ("ngram-max-match-window-size", "NGRAM: the longest run of last tokens looked up"),
    ):
        sglang.add_argument(f"--speculative-{name}", type=int, metavar="N", help=said)


def one_device(text: str) -> int:
    """A tensor or pipeline parallel size, which must be 1: specd runs each model whole on
    one device."""
    try:
        size = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if size != 1:
        raise argparse.ArgumentTypeError(
            f"{size}: specd runs each model whole on one device; for more throughput run "
            "replicas (--data-parallel-size N, specd's --verifiers N)"
        )
    return size


def gpu_layers(text: str) -> str:
    """llama-server's -ngl as a specd device: 0 layers on the GPU is the CPU ("cpu"); more,
    `auto` or `all` is the service's default, the whole model on the GPU where there is one
    ("")."""
    if text in ("auto", "all"):
        return ""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a count of layers, auto or all, not {text!r}")
    return "cpu" if int(text) == 0 else ""


def threads(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"a count of threads >= 1, not {text!r}")
    return count


# flags that ask for what specd does without being asked, each with what it does
ALWAYS = (
    (("--trust-remote-code",), "specd runs no code of a model's folder: it loads its "
     "Llama, Mistral and Qwen2/3 architectures itself"),
    (("--jinja",), "chats are rendered by the model's Jinja template (or --chat-template)"),
    (("--cont-batching", "-cb"), "the verifier batches continuously"),
    (("--enable-chunked-prefill",), "prompts are fed in chunks (--max-num-batched-tokens)"),
    (("--metrics", "--enable-metrics"), "the HTTP door serves Prometheus metrics on /metrics"),
    (("--enable-server-load-tracking",), "the HTTP door's /load counts requests in flight"),
    (("--no-webui",), "specd serves no web page"),
    (("--disable-log-requests", "--disable-uvicorn-access-log"), "specd logs no line per "
     "request"),
    (("--disable-fastapi-docs",), "specd serves no OpenAPI page (/docs, /openapi.json)"),
    (("--enable-prompt-tokens-details",), "usage counts cached prompt tokens always"),
)  # fmt: skip


def add_device_flags(up) -> None:
    """What a launch command says of devices, threads and caches, under the peers' names
    (launcher.local_cluster hands them on), and the flags it takes that ask for what specd
    does anyway."""
    devices = up.add_argument_group(
        "devices, threads and caches", "as vLLM's, SGLang's and llama-server's"
    )
    for names, which in (
        (("--tensor-parallel-size", "-tp", "--tp-size", "--tp"), "tensor"),
        (("--pipeline-parallel-size", "-pp", "--pp-size"), "pipeline"),
    ):
        devices.add_argument(
            *names,
            type=one_device,
            default=1,
            metavar="N",
            help=f"{which} parallel size: 1, the only one (specd runs each model whole on one "
            "device; more throughput comes from --data-parallel-size)",
        )
    for names, model, dest in (
        (("--n-gpu-layers", "--gpu-layers", "-ngl"), "target", "target_device"),
        (
            ("--n-gpu-layers-draft", "--gpu-layers-draft", "-ngld", "--spec-draft-ngl"),
            "draft",
            "draft_device",
        ),
    ):
        devices.add_argument(
            *names,
            dest=dest,
            type=gpu_layers,
            default=None,
            metavar="N",
            help=f"llama-server's: 0 runs the {model} model on the CPU; more, auto or all runs "
            "it whole on the GPU where there is one, else on the CPU (default: so)",
        )
    devices.add_argument(
        "--gpu-memory-utilization",
        "--mem-fraction-static",
        type=float,
        metavar="F",
        help="on a GPU, the share of its memory each verifier may take, its K/V pool what "
        "the weights and the steps leave (their --gpu-memory-utilization; SGLang's "
        "--mem-fraction-static); a CPU ignores it (default: none, the pool sized for the "
        "context)",
    )
    devices.add_argument(
        "--enforce-eager",
        "--disable-cuda-graph",
        action="store_true",
        help="on a GPU, both models' steps eager, no CUDA graphs captured (their "
        "--enforce-eager; SGLang's --disable-cuda-graph); a CPU captures none anyway",
    )
    devices.add_argument(
        "--threads",
        "-t",
        type=threads,
        default=0,
        help="the threads each model's forward runs on (OMP_NUM_THREADS; the draft model's "
        "too unless --threads-draft; default 0: the cores this process may run on)",
    )
    devices.add_argument(
        "--threads-draft",
        "-td",
        type=threads,
        default=0,
        help="the threads the draft model's forward runs on (default 0: --threads')",
    )
    devices.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        dest="prefix_caching",
        default=None,
        help="reuse a cached prompt prefix's K/V, in both models (their --prefix-cache on; "
        "no-: off; default: theirs, auto, on where a cached prefix cannot change an output)",
    )
    devices.add_argument(
        "--disable-radix-cache",
        action="store_false",
        dest="prefix_caching",
        default=None,
        help="SGLang's: --no-enable-prefix-caching",
    )
    taken = up.add_argument_group(
        "taken without effect", "peers' flags that ask for what specd does anyway"
    )
    for names, does in ALWAYS:
        taken.add_argument(*names, action="store_true", help=does)
    taken.add_argument(
        "--defrag-thold",
        "-dt",
        type=float,
        metavar="X",
        help="llama-server's: specd's K/V pool is paged, so it needs no defragmentation",
    )
    taken.add_argument(
        "--cache-reuse",
        type=int,
        metavar="N",
        help="llama-server's: specd reuses a cached prompt's prefix (--prefix-cache), not the "
        "chunks past where a prompt changed; the output is the same",
    )
    taken.add_argument(
        "--flash-attn",
        "-fa",
        nargs="?",
        choices=["on", "off", "auto"],
        help="llama-server's: specd's own paged attention computes the same softmax either way",
    )
