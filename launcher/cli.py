"""`specd` command line: models, up, serve, generate, health, run-batch, bench (services
imported lazily, so `specd generate` and `specd run-batch` never load torch)."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import sys

from launcher.cli_parser import BENCHES, ROLES, build_parser
from launcher.peer_flags import api_key
from specd.config import ConfigError
from specd.config_flags import from_arguments
from specd.models.resolve import ModelNotFound
from specd.openmp import settle_spinning, settle_threads, too_late
from specd.serving import ListenError


def _models(args) -> int:
    from specd.models.catalog import MODEL_SETS
    from specd.models.fetch import FetchError
    from specd.models.resolve import resolve

    _keep_freed_memory()
    try:
        for name in MODEL_SETS.get(args.name, (args.name,)):  # a set, or one model's name
            folder = resolve(name)
            if args.weights != "none":  # the quantised cache too, now (an image build)
                from specd.models.loader import prepare_weights

                prepare_weights(folder, args.weights)
            print(folder)
    except FetchError as exc:
        print(f"specd models fetch: {exc}", file=sys.stderr)
        return 1
    return 0


def _keep_freed_memory() -> None:
    """Converting a model allocates and frees temporaries of up to a GB a matrix. glibc
    gives every freed block over 32 MB back to the kernel and faults the next one in page by
    page: ~8 M page faults and twice the time writing the 1.5B's int8. This process, which
    only converts and exits, keeps freed memory in its heap instead (mallopt M_MMAP_MAX = 0,
    no trimming) for a higher peak of resident memory. Not glibc: left as is."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(-4, 0)  # M_MMAP_MAX
    mallopt(-1, -1)  # M_TRIM_THRESHOLD


def _serve(args) -> int:
    config = from_arguments(ROLES[args.role], args)
    log, before = logging.getLogger("specd"), set(os.environ)
    if args.role in ("drafter", "verifier"):  # before torch loads (specd/openmp.py)
        log.info("%s: %s", args.role, settle_threads())
    if args.role == "drafter" or (args.role == "verifier" and config.drafter):
        settle_spinning()  # they take turns on the cores
    if warning := too_late([name for name in os.environ if name not in before]):
        log.warning("%s: %s", args.role, warning)
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
    token = api_key(args.auth_token)  # as `specd up` takes it
    metadata = [("authorization", f"Bearer {token}")] if token else None
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
    from specd.channels import health_status

    said = health_status(args.address, args.timeout, args.service, args.tls_ca)
    print(said)
    return 0 if said == "SERVING" else 1


def _up(args) -> int:
    from launcher.local_cluster import run_local_cluster

    return run_local_cluster(args)


def _run_batch(args) -> int:
    from launcher.run_batch import main as run_batch

    return run_batch(args)


def _bench(args) -> int:
    import importlib

    return importlib.import_module(BENCHES[args.kind]).main(args.rest)


COMMANDS = {
    "models": _models,
    "serve": _serve,
    "generate": _generate,
    "health": _health,
    "up": _up,
    "run-batch": _run_batch,
    "bench": _bench,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "--soak"]:  # the spelling issue #8 uses
        argv[1] = "soak"
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        return COMMANDS[args.command](args)
    except Exception as exc:
        said = _users_error(exc)
        if said is None:
            raise
        command = f"{args.command} {args.role}" if args.command == "serve" else args.command
        print(f"specd {command}: {said}", file=sys.stderr)
        return 2


def _users_error(exc: BaseException) -> str | None:
    """A mistyped model, a flag value its config refuses, a port in use, or a server that
    refused or could not be reached (a bench's --target), alone or as a task group's one
    error (the group cancels the rest at the first): said in one line, no traceback (None:
    anything else, raised as is)."""
    import grpc

    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):  # sync and aio calls
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) if isinstance(exc, (ModelNotFound, ConfigError, ListenError)) else None


if __name__ == "__main__":
    sys.exit(main())
