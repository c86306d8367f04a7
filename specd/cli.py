"""`specd` command line: models, up, serve, generate, bench (services imported lazily)."""

from __future__ import annotations

import argparse
import sys


def _models(args) -> int:
    from specd.models.fetch import FetchError, fetch_set

    try:
        for folder in fetch_set(args.set):
            print(folder)
    except FetchError as exc:
        print(f"specd models fetch: {exc}", file=sys.stderr)
        return 1
    return 0


def _up(args) -> int:
    from specd.generate import generate_once

    text = generate_once(args.target, args.prompt, args.max_new_tokens)
    print(text)
    return 0


def _bench(args) -> int:
    if args.kind == "engine":
        from bench.engine import main as run
    else:
        from bench.speculative import main as run
    return run(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="manage the model cache")
    models_sub = models.add_subparsers(dest="action", required=True)
    fetch = models_sub.add_parser("fetch", help="download, verify and convert a model set")
    fetch.add_argument("set", nargs="?", default="default", choices=["default", "small"])
    fetch.set_defaults(func=_models)

    up = sub.add_parser("up", help="run the default pair locally")
    up.add_argument("--target", default="default-target")
    up.add_argument("--prompt", default="Write a Python function that checks if a number is prime.")
    up.add_argument("--max-new-tokens", type=int, default=64)
    up.set_defaults(func=_up)

    bench = sub.add_parser("bench", help="benchmarks (see bench/)")
    bench.add_argument("kind", choices=["engine", "spec"],
                       help="engine: decode speed + verify cost; spec: speculation vs none")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
