"""`specd` command line: models, up, serve, generate, health, bench (services imported
lazily, so `specd generate` never loads torch)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from specd.config import (
    DrafterConfig,
    RouterConfig,
    VerifierConfig,
    add_arguments,
    from_arguments,
)

ROLES = {"drafter": DrafterConfig, "verifier": VerifierConfig, "router": RouterConfig}


def _models(args) -> int:
    from specd.models.fetch import FetchError, fetch_set

    try:
        for folder in fetch_set(args.set):
            if args.weights != "none":  # the quantised cache too, now (an image build)
                from specd.models.loader import prepare_weights

                prepare_weights(folder, args.weights)
            print(folder)
    except FetchError as exc:
        print(f"specd models fetch: {exc}", file=sys.stderr)
        return 1
    return 0


def _serve(args) -> int:
    config = from_arguments(ROLES[args.role], args)
    if args.role == "drafter":
        from drafter_service.server import serve
    elif args.role == "verifier":
        from verifier_service.startup import serve
    else:
        from router.server import serve
    asyncio.run(serve(config))
    return 0


def _generate(args) -> int:
    import grpc

    from router.client import SpecdClient

    kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        route=args.route,
        speculation=args.speculation,
        stop=args.stop or [],
    )
    if args.raw:
        kwargs["prompt"] = args.prompt
    else:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
    metadata = [("authorization", f"Bearer {args.auth_token}")] if args.auth_token else None
    kwargs["metadata"] = metadata
    with SpecdClient(args.address, tls_ca=args.tls_ca) as client:
        try:
            if args.stream:
                final = None
                for msg in client.stream(**kwargs):
                    print(msg.text, end="", flush=True)
                    final = msg
                print()
            else:
                final = client.generate(**kwargs)
                print(final.text)
        except grpc.RpcError as exc:
            print(f"specd generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    s = final.speculation
    print(
        f"[{final.finish_reason}; {final.usage.completion_tokens} tokens; speculation "
        f"{s.reason}, k={s.num_draft_tokens}, acceptance {s.acceptance_rate:.0%}, "
        f"mean accepted length {s.mean_accepted_length:.2f}]",
        file=sys.stderr,
    )
    return 0


def _health(args) -> int:
    from specd.serving import check_health

    ok = check_health(args.address, timeout=args.timeout, service=args.service, tls_ca=args.tls_ca)
    print("SERVING" if ok else "NOT_SERVING")
    return 0 if ok else 1


def _up(args) -> int:
    from specd.local_cluster import run_local_cluster

    return run_local_cluster(args)


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
}


def _bench(args) -> int:
    import importlib

    return importlib.import_module(BENCHES[args.kind]).main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_models, _add_serve, _add_generate, _add_health, _add_up, _add_bench):
        add(sub)
    return parser


def _add_models(sub) -> None:
    models = sub.add_parser("models", help="manage the model cache")
    models_sub = models.add_subparsers(dest="action", required=True)
    fetch = models_sub.add_parser("fetch", help="download, verify and convert a model set")
    fetch.add_argument("set", nargs="?", default="default", choices=["default", "small"])
    fetch.add_argument(
        "--weights",
        choices=["none", "int8", "int4"],
        default="none",
        help="also write the quantised weights cache (the first start does it otherwise)",
    )
    fetch.set_defaults(func=_models)


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="run one service")
    roles = serve.add_subparsers(dest="role", required=True)
    for role, cls in ROLES.items():
        p = roles.add_parser(role, help=cls.__doc__)
        add_arguments(p, cls)
        p.set_defaults(func=_serve)


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="send a prompt to the router")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:50051")
    gen.add_argument("--route", default="")
    gen.add_argument("--stream", action="store_true")
    gen.add_argument("--speculation", choices=["auto", "on", "off"], default="auto")
    gen.add_argument("--max-new-tokens", type=int, default=0)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--stop", action="append")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.add_argument("--tls-ca", default="", help="PEM of the router's CA (TLS)")
    gen.add_argument("--auth-token", default="", help="bearer token, if the router wants one")
    gen.set_defaults(func=_generate)


def _add_health(sub) -> None:
    health = sub.add_parser("health", help="grpc.health.v1 check of ADDR (exit 0 if serving)")
    health.add_argument("address")
    health.add_argument("--timeout", type=float, default=2.0)
    health.add_argument("--tls-ca", default="", help="PEM of the CA, for a TLS listener")
    health.add_argument("--service", default="", help='e.g. specd.v1.Generation ("": overall)')
    health.set_defaults(func=_health)


def _add_up(sub) -> None:
    up = sub.add_parser("up", help="drafter + verifier + router on localhost")
    up.add_argument("--target", default="default-target")
    up.add_argument("--draft", default="default-draft")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--router-port", type=int, default=RouterConfig.port)
    up.add_argument("--verifier-port", type=int, default=VerifierConfig.port)
    up.add_argument("--drafter-port", type=int, default=DrafterConfig.port)
    up.add_argument(
        "--http-port", type=int, default=8000, help="the OpenAI-compatible API (0 = off)"
    )
    up.add_argument("--policy-file", default="")
    up.add_argument(
        "--proposer", choices=["draft", "ngram", "combined"], default=DrafterConfig.proposer
    )
    up.add_argument("--ready-timeout", type=float, default=600.0)
    up.add_argument(
        "--verifiers", type=int, default=1, help="verifier replicas (ports from --verifier-port)"
    )
    up.add_argument("--dtype", default="", help="activations of both models (default: auto)")
    up.set_defaults(func=_up)


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
        "parity: greedy output with speculation on vs off, every workload prompt",
    )
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "--soak"]:  # the spelling issue #8 uses
        argv[1] = "soak"
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
