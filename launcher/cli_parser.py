"""The `specd` command line's arguments: one sub-parser per command (what each runs is
specd/cli.py); the services' flags are derived from their config classes."""

from __future__ import annotations

import argparse
import os
import re
import shlex

from launcher.config_file import CONFIG_FLAG, CONFIG_TARGET, ConfigTarget, expand
from launcher.llama_env import llama_env_flags
from launcher.peer_flags import (
    DEFAULT_TARGET,
    Target,
    add_device_flags,
    add_serving_flags,
    add_sglang_flags,
)
from specd.config import (
    PROPOSERS,
    DrafterConfig,
    RouterConfig,
    VerifierConfig,
)
from specd.config_flags import add_arguments, field_docs, from_arguments
from specd.models.catalog import ALIASES, CATALOG, MODEL_SETS

ROLES = {"drafter": DrafterConfig, "verifier": VerifierConfig, "router": RouterConfig}

BENCHES = {  # `specd bench KIND` -> the module whose main() runs it
    "engine": "bench.engine",
    "spec": "bench.speculative",
    "split": "bench.split",
    "sweep": "bench.sweep",
    "soak": "bench.soak",
    "quality": "bench.quality",
    "kernel": "bench.kernel",
    "faults": "bench.faults",
    "doors": "bench.doors",
    "structured": "bench.structured",
    "parity": "bench.parity",
    "controller": "bench.controller_sim",
    "controller-batch": "bench.controller_batch",
    "matches": "bench.match_traces",
    "steps": "bench.step_costs",
    "gpu": "bench.gpu.run",
    "suffix": "bench.suffix",
    "infill": "bench.infill",
    "turns": "bench.turns",
    "predict": "bench.predict",
}


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class Parser(argparse.ArgumentParser):
    """argparse's, which with `whole_flags` (`specd up`) refuses a single-dash word that is
    none of its flags, where argparse reads it as a flag and its value glued: llama-server's
    -mlock as -m lock (a value glued to a short flag, such as -c4096, is still taken)."""

    whole_flags = False
    # `--config FILE` read (launcher.config_file), and llama-server's environment
    # (launcher.llama_env)
    config_file = False

    def parse_known_args(self, args=None, namespace=None):
        if self.config_file and args is not None:
            # llama-server's environment, a config file's flags, then the command line's
            args = llama_env_flags(os.environ, self.error) + expand(list(args), self)
        words = list(args or ()) if self.whole_flags else []
        for arg in words[: words.index("--")] if "--" in words else words:
            if (
                re.fullmatch(r"-[A-Za-z][A-Za-z_-]+", arg)
                and arg not in self._option_string_actions
            ):
                self.error(f"unrecognized argument: {arg} (see specd {self.prog.split()[-1]} -h)")
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="specd",
        description="speculative decoding services: models, up, serve, generate, health, "
        "run-batch, bench",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="the least a log line must matter to be written (default: %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    adders = (_add_models, _add_serve, _add_generate, _add_health, _add_up, _add_run_batch)
    for add in (*adders, _add_bench):
        add(sub)
    return parser


def _add_models(sub) -> None:
    models = sub.add_parser("models", help="manage the model cache")
    models_sub = models.add_subparsers(dest="action", required=True)
    fetch = models_sub.add_parser(
        "fetch", help="download, verify and convert a model set or one catalogued model"
    )
    fetch.add_argument(
        "name",
        nargs="?",
        metavar="NAME",
        default="default",
        choices=sorted({*MODEL_SETS, *ALIASES, *CATALOG}),
        help="a set (default: the Qwen2.5-Coder 1.5B/0.5B pair; small: SmolLM2-135M-Instruct)"
        " or one of its models, by an alias (default-target, default-draft) or its catalogue"
        " name; one of %(choices)s",
    )
    fetch.add_argument(
        "--weights",
        choices=["none", "int8", "int4"],
        default="none",
        help="int8 or int4: also write that quantised weights cache now (the first start "
        "does it otherwise; default %(default)s)",
    )


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="run one service")
    roles = serve.add_subparsers(dest="role", required=True)
    for role, cls in ROLES.items():
        p = roles.add_parser(role, help=cls.__doc__)
        add_arguments(p, cls)


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="send a prompt to the router")
    gen.add_argument("prompt", help="the user's message (a raw prompt with --raw)")
    gen.add_argument("--address", default="127.0.0.1:50051", help="the router (%(default)s)")
    gen.add_argument("--route", default="", help='the policy route ("": the default route)')
    gen.add_argument("--stream", action="store_true", help="print tokens as they come")
    gen.add_argument(
        "--speculation",
        choices=["auto", "on", "off"],
        default="auto",
        help="override the route's speculation (default: %(default)s, the route decides)",
    )
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        default=0,
        help="0: the router's default (256); -1: what the context leaves",
    )
    gen.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default %(default)s)"
    )
    gen.add_argument("--stop", action="append", help="a stop string (repeat for several)")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.add_argument("--tls-ca", default="", help="PEM of the router's CA (TLS)")
    gen.add_argument(
        "--auth-token",
        default="",
        help="bearer token, if the router wants one (default: $SPECD_API_KEY, else none)",
    )


def _add_health(sub) -> None:
    health = sub.add_parser("health", help="grpc.health.v1 check of ADDR (exit 0 if serving)")
    health.add_argument("address", help="host:port of any specd service")
    health.add_argument("--timeout", type=float, default=2.0, help="seconds (%(default)s)")
    health.add_argument("--tls-ca", default="", help="PEM of the CA, for a TLS listener")
    health.add_argument("--service", default="", help='e.g. specd.v1.Generation ("": overall)')


_EXAMPLE_FLAGS = {
    "drafter": "'--top-m 16'",
    "verifier": "'--max-batch-size 32 --horizon 16'",
    "router": "'--metrics-port 9090'",
}


def _add_up(sub) -> None:
    # no abbreviations: a peer's flag that is a prefix of one here (llama-server's -n, its
    # n_predict, of -np) is refused, not taken as another
    up = sub.add_parser("up", help="drafter + verifier + router on localhost", allow_abbrev=False)
    up.whole_flags = up.config_file = True
    up.add_argument(
        CONFIG_FLAG,
        metavar="FILE",
        help="vLLM's: a YAML file of these flags (`max-num-seqs: 8`, `model: NAME`), as if "
        "given before the command line's, which win where both name one",
    )
    up.add_argument(
        CONFIG_TARGET,
        dest="target",
        action=ConfigTarget,
        default=argparse.SUPPRESS,  # --target's default stands
        help=argparse.SUPPRESS,
    )
    models = (
        "catalogue name, Hugging Face folder, .gguf file or hub id, REPO:QUANT for one of its "
        "GGUF files (default: %(default)s)"
    )
    up.add_argument(
        "--target",
        "--model",
        "--model-path",
        "-m",
        "--hf-repo",
        "-hf",
        default=DEFAULT_TARGET,
        action=Target,
        help=f"the target model (vLLM's --model, SGLang's --model-path, llama-server's -m and "
        f"-hf): {models}",
    )
    up.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        action=Target,
        help="the target model, as `vllm serve MODEL` names it (the same as --target)",
    )
    up.add_argument(
        "--draft",
        "--model-draft",
        "-md",
        "--spec-draft-model",
        "--hf-repo-draft",
        "-hfd",
        "--spec-draft-hf",
        "-hfrd",
        default="default-draft",
        help=f"the draft model (llama-server's -md and -hfd): {models}",
    )
    up.add_argument("--host", default="127.0.0.1", help="where all three listen (%(default)s)")
    up.add_argument("--router-port", type=int, default=RouterConfig.port, help="gRPC (%(default)s)")
    up.add_argument(
        "--verifier-port",
        type=int,
        default=VerifierConfig.port,
        help="the first verifier's gRPC port; more replicas take the next (%(default)s)",
    )
    up.add_argument(
        "--drafter-port", type=int, default=DrafterConfig.port, help="gRPC (%(default)s)"
    )
    up.add_argument(
        "--http-port",
        "--port",
        type=int,
        default=8000,
        help="the OpenAI-compatible API (%(default)s; 0 = off; vLLM's, SGLang's and "
        "llama-server's --port)",
    )
    up.add_argument(
        "--policy-file",
        default="",
        help='the per-route policy YAML (deploy/policy.yaml shows its fields; "": built in)',
    )
    up.add_argument(
        "--proposer",
        choices=list(PROPOSERS),
        default=DrafterConfig.proposer,
        help="how the drafter drafts where a route does not say (default: %(default)s; "
        "suffix serves every way a route may name)",
    )
    up.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='vLLM\'s speculative config, e.g. \'{"model": "default-draft", '
        '"num_speculative_tokens": 5}\' or \'{"method": "ngram"}\': its method, draft model, k '
        "and batch sizes as specd's --draft, --proposer and policy (README: Coming from "
        "vLLM, SGLang or llama-server)",
    )
    up.add_argument(
        "--draft-max",
        "--spec-draft-n-max",
        type=int,
        default=0,
        help="the most drafts a round may have, on every route (llama-server's flag; vLLM's "
        "num_speculative_tokens); under auto a cap (default 0: each route's num_draft_tokens)",
    )
    up.add_argument(
        "--spec-type",
        metavar="TYPES",
        help="llama-server's: draft-simple (the draft model alone), ngram-simple and the other "
        "ngram-* (a lookup in the request's own text, in the verifier), both (specd's own: "
        "the lookup where the text repeats, else the model), or none (every route off); "
        "comma-separated",
    )
    add_sglang_flags(up)
    add_serving_flags(up)
    add_device_flags(up)
    up.add_argument(
        "--draft-p-min",
        "--spec-draft-p-min",
        type=float,
        default=DrafterConfig.p_min,
        help="a drafting round stops after a draft the draft model gave a probability under "
        "this (that draft is still verified; 0 = always draft k; default %(default)s)",
    )
    up.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds for every process to be healthy, the first start's model conversion "
        "and kernel build included (%(default)s)",
    )
    up.add_argument(
        "--verifiers",
        "--data-parallel-size",
        "-dp",
        "--dp-size",
        "--dp",
        type=int,
        default=1,
        help="verifier replicas (ports from --verifier-port; vLLM's --data-parallel-size, "
        "SGLang's --dp-size; %(default)s)",
    )
    said = field_docs(VerifierConfig)
    up.add_argument("--dtype", default="", help=f"both models' {said['dtype']} (default: auto)")
    up.add_argument(
        "--kv-dtype",
        "--kv-cache-dtype",
        default="",
        help=f"for both models, {said['kv_dtype']} (default: auto; vLLM's --kv-cache-dtype)",
    )
    for role in ("drafter", "verifier", "router"):
        up.add_argument(
            f"--{role}-flags",
            default="",  # argparse passes a string default through `type` too: []
            type=_flag_string,
            metavar="FLAGS",
            help=f"more flags for {'every' if role == 'verifier' else 'the'} {role}, as one "
            f"string after `=` (`specd serve {role} --help` lists them; not one specd up "
            f"sets itself), e.g. --{role}-flags={_EXAMPLE_FLAGS[role]}",
        )


def _flag_string(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:  # an unclosed quote
        raise argparse.ArgumentTypeError(f"{exc}: {text}") from None


def _add_run_batch(sub) -> None:
    batch = sub.add_parser(
        "run-batch", help="an OpenAI batch file (JSONL) through a running specd, as vLLM's"
    )
    batch.add_argument(
        "-i", "--input-file", required=True, help="the batch: one request a line (JSONL)"
    )
    batch.add_argument(
        "-o", "--output-file", required=True, help="the answers, a line each, in input order"
    )
    batch.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the specd HTTP door (default: %(default)s, specd up's)",
    )
    batch.add_argument(
        "--concurrency", type=int, default=16, help="requests at once (default: %(default)s)"
    )
    batch.add_argument(
        "--api-key", default="", help="the door's bearer token (default: $OPENAI_API_KEY)"
    )
    batch.add_argument(
        "--route",
        default="",
        help="the policy route of every request, where a body names none (e.g. batch: the "
        "built-in policy's, which does not speculate; default: the default route)",
    )


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (see bench/)")
    bench.add_argument(
        "kind",
        choices=list(BENCHES),
        help="engine: decode speed + verify cost; spec: speculation vs none; "
        "quality: NLL and greedy agreement of each weight format; "
        "kernel: one matrix's matmul per weight format and row count; "
        "split: the router vs the in-process engine; sweep: concurrency x mode; "
        "soak (or --soak): many mixed requests, then no leaks; "
        "faults: SIGKILL a drafter and a verifier under load in specd up; "
        "doors: the OpenAI HTTP door vs gRPC, same router; "
        "structured: JSON-schema output on/off and vs unconstrained; "
        "parity: greedy output with speculation on vs off, every workload prompt; "
        "gpu: the CUDA step on random weights of real shapes (bench/gpu/check.sh); "
        "suffix: the suffix drafter's shared memory, lookups at 100k tokens",
    )
    bench.add_argument(
        "rest", nargs=argparse.REMAINDER, help="the benchmark's own flags (specd bench KIND -h)"
    )


def serve_config(argv: list[str]):
    """The config `specd serve ROLE FLAGS...` (argv) runs with; ConfigError names a value
    its config refuses (`specd up` checks its children's flags so before starting them)."""
    args = build_parser().parse_args(argv)
    return from_arguments(ROLES[args.role], args)
