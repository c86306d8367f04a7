"""A vLLM, SGLang or llama-server launch command's flags on `specd up`, under their names:
the target in `vllm serve`'s place, the serving flags each role owns (launcher.local_cluster
hands them on) and SGLang's speculative flags (launcher.speculative_config reads them)."""

from __future__ import annotations

import argparse
import os

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
        named = getattr(namespace, "target", DEFAULT_TARGET)
        if named not in (DEFAULT_TARGET, value):
            parser.error(f"the target model named twice: {named} and {value}")
        namespace.target = value


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
        "--served-model-name", "--alias", "-a", default="", help="the model id HTTP clients name"
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
        type=int,
        default=0,
        help="tokens a verifier's forward feeds at most, prompt chunks and verification (its "
        "--max-batched-tokens; default 0: its own, 128 on a CPU, 512 on a GPU)",
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
