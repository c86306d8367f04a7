"""`specd up`: drafter, verifier(s) and router as supervised child processes on localhost
(launcher.supervisor restarts one that dies while the others keep serving)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile

from launcher.peer_flags import api_key, forward_tokens, generation_overrides
from launcher.speculative_config import speculation
from launcher.supervisor import Child, Supervisor

CLI = (sys.executable, "-m", "launcher")  # how a child runs `specd`
# vLLM's --generation-config: the model's generation_config.json, or vLLM's own defaults
SAMPLING_DEFAULTS = {"auto": "model", "vllm": "openai"}


def _serve(role: str, flags, extra=(), log_level: str = "info") -> list[str]:
    """`specd --log-level LOG_LEVEL serve ROLE` with what `up` sets (`flags`), then the
    user's `extra` flags for the role, none of which may be one `up` sets: a port or
    address changed behind its back would have it wait on the wrong one (ValueError)."""
    own = {f.split("=")[0] for f in flags if f.startswith("--")}
    taken = [f for f in extra if f.split("=")[0] in own]
    if taken:
        raise ValueError(
            f"--{role}-flags: {', '.join(taken)} is set by specd up itself (see its own flags)"
        )
    return [*CLI, "--log-level", log_level, "serve", role, *flags, *extra]


def _log_level(args) -> str:
    """The services': `up`'s --log-level (vLLM's trace is debug), else `specd`'s own."""
    level = args.child_log_level or ("debug" if args.verbose else args.log_level)
    return "debug" if level == "trace" else level


def cluster_children(args, token_file: str = "") -> list[Child]:
    """The drafter (none for a lookup), `args.verifiers` verifiers and the router, in
    start order (the router wanting the bearer token in `token_file`, where one is
    named)."""
    spec = speculation(args)
    host = args.host
    drafter = f"{host}:{args.drafter_port}"
    # a lookup in the request's own text runs in each verifier, as vLLM's ngram method runs
    # in its engine: no drafter process, no round trip a round
    lookup = spec.proposer == "ngram"
    if lookup and args.drafter_flags:
        raise ValueError(
            "--drafter-flags: with a lookup (ngram) no drafter runs; each verifier looks up"
        )
    model_flags = [
        *(["--dtype", args.dtype] if args.dtype else []),
        *(["--kv-dtype", args.kv_dtype] if args.kv_dtype else []),
    ]
    if args.prefix_caching is not None:  # vLLM's --enable-prefix-caching, or its no-
        model_flags += ["--prefix-cache", "on" if args.prefix_caching else "off"]
    model_flags += _given(args, enforce_eager="enforce_eager")
    children = []
    if not lookup:
        flags = (
            *_listen(host, args.drafter_port),
            *("--model", spec.draft, "--proposer", spec.proposer),
            *("--p-min", str(args.draft_p_min)),
            *model_flags,
            *_given(args, device="draft_device"),
            *spec.drafter_flags,
        )
        argv = _serve("drafter", flags, args.drafter_flags, _log_level(args))
        draft_threads = args.threads_draft or args.threads  # llama-server's -td, else its -t
        children.append(Child("drafter", argv, drafter, env=_threads(draft_threads)))
    verifiers = [f"{host}:{args.verifier_port + i}" for i in range(args.verifiers)]
    overrides, batched = generation_overrides(args), forward_tokens(args)
    for i, address in enumerate(verifiers):
        flags = (
            *_listen(host, args.verifier_port + i),
            *("--model", args.target),
            *(("--lookup",) if lookup else ("--drafter", drafter)),
            *model_flags,
            *spec.verifier_flags,
            *_given(
                args,
                device="target_device",
                max_batch_size="max_num_seqs",
                max_model_len="max_model_len",
                gpu_memory_utilization="gpu_memory_utilization",
            ),
            *(["--max-batched-tokens", str(batched)] if batched else []),
            *(["--seed", str(args.seed)] if args.seed is not None else []),  # 0 too
            *(["--log-stats-interval", "0"] if args.disable_log_stats else []),
        )
        name = "verifier" if i == 0 else f"verifier-{i + 1}"
        argv = _serve("verifier", flags, args.verifier_flags, _log_level(args))
        children.append(Child(name, argv, address, env=_threads(args.threads)))
    router_flags = (
        *_listen(host, args.router_port),
        *[x for v in verifiers for x in ("--verifier", v)],
        *("--tokenizer", args.target, "--http-port", str(args.http_port)),
        *(["--policy-file", args.policy_file] if args.policy_file else []),
        *(["--policy", json.dumps(spec.policy)] if spec.policy else []),
        *(["--auth-token-file", token_file] if token_file else []),
        *_given(
            args,
            http_tls_cert="ssl_certfile",
            http_tls_key="ssl_keyfile",
            default_max_new_tokens="n_predict",
            chat_template="chat_template",
            tool_call_parser="tool_call_parser",
            reasoning_parser="reasoning_parser",
            allowed_origins="allowed_origins",
            allowed_methods="allowed_methods",
            allowed_headers="allowed_headers",
            allow_credentials="allow_credentials",
            served_model_name="served_model_name",
        ),
        *(
            ["--sampling-defaults", SAMPLING_DEFAULTS[args.generation_config]]
            if args.generation_config
            else []
        ),
        *(["--override-generation-config", overrides] if overrides else []),
        *(["--default-seed", str(args.default_seed)] if args.default_seed is not None else []),
        *([] if args.slots else ["--no-slots"]),
    )
    children.append(
        Child(
            "router",
            _serve("router", router_flags, args.router_flags, _log_level(args)),
            f"{host}:{args.router_port}",
            ready_service="specd.v1.Generation",  # ready once a verifier is
        )
    )
    return children


def _given(args, **flags: str) -> list[str]:
    """`--FLAG VALUE` for each of a role's flags (named as keywords, each with the `up`
    argument that sets it) that `specd up` was given (not 0, empty or false): a switch
    alone, a list's values a flag each."""
    out = []
    for flag, name in flags.items():
        value, option = getattr(args, name), "--" + flag.replace("_", "-")
        if value is True:
            out.append(option)
        elif isinstance(value, list):
            out += [x for item in value for x in (option, str(item))]
        elif value:
            out += [option, str(value)]
    return out


def _threads(count: int) -> dict[str, str]:
    """A model service's environment for `count` threads (0: its own choice,
    specd.openmp.settle_threads)."""
    return {"OMP_NUM_THREADS": str(count)} if count else {}


@contextlib.contextmanager
def _token_file(token: str):
    """The bearer token in a file only this user may read, for the router (its flag
    names a file, not the token: the token stays out of its command line), removed after;
    "" where there is no token."""
    if not token:
        yield ""
        return
    with tempfile.TemporaryDirectory(prefix="specd-up-") as folder:
        path = os.path.join(folder, "api-key")
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(token)
        yield path


def in_use(host: str, port: int) -> bool:
    """Whether something listens on host:port already (a port in TIME_WAIT is free)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:  # a host this machine cannot resolve: the service will say so
        return False
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError:
            return True
    return False


def _listen(host: str, port: int) -> tuple[str, ...]:
    return ("--host", host, "--port", str(port))


def run_local_cluster(args) -> int:
    with _token_file(api_key(args.api_key)) as token_file:
        return _run_local_cluster(args, token_file)


def _run_local_cluster(args, token_file: str) -> int:
    from launcher.cli_parser import serve_config
    from specd.config import ConfigError
    from specd.models.catalog import ALIASES
    from specd.models.resolve import resolve

    if args.verifiers < 1:
        print("specd up: --verifiers must be at least 1", file=sys.stderr)
        return 2
    try:
        children = cluster_children(args, token_file)
    except ValueError as exc:
        print(f"specd up: {exc}", file=sys.stderr)
        return 2
    configs = {}
    for child in children:  # a value a child's config refuses: said before anything starts
        try:
            configs[child.role] = serve_config(child.argv[len(CLI) :])
        except ConfigError as exc:
            print(f"specd up: {child.role}: {exc}", file=sys.stderr)
            return 2
        except SystemExit:  # a flag `specd serve ROLE` does not take: argparse said which
            print(f"specd up: {child.role}: see `specd serve {child.role} --help`", file=sys.stderr)
            return 2
    listeners = [(c.role, int(c.address.rsplit(":", 1)[1])) for c in children]
    listeners += [("OpenAI HTTP API", args.http_port)] if args.http_port else []
    for role, port in listeners:
        if in_use(args.host, port):  # its health would answer for ours: said, not restarted
            print(
                f"specd up: {args.host}:{port} ({role}) is in use, another specd up? Choose "
                "others with --router-port, --verifier-port, --drafter-port, --http-port",
                file=sys.stderr,
            )
            return 2
    # fetch (and convert) missing models once, before the processes race for them
    resolve(args.target)
    if "drafter" in configs:
        resolve(configs["drafter"].model)
    router = children[-1].address
    model = (args.served_model_name or [ALIASES.get(args.target, args.target)])[0]
    token = " --auth-token <the --api-key>" if token_file else ""
    bearer = " -H 'authorization: Bearer <the --api-key>'" if token_file else ""
    scheme = "https" if args.ssl_certfile else "http"
    http = (
        f"\n  or:  curl {scheme}://{args.host}:{args.http_port}/v1/chat/completions{bearer} "
        f'-H \'content-type: application/json\' -d \'{{"model": "{model}", '
        '"messages": [{"role": "user", "content": "Reverse a string in Python."}]}\''
        if args.http_port
        else ""
    )

    def ready() -> None:
        print(
            f"\nspecd is up: router on {router}\n  try: specd generate "
            f'--address {router}{token} --stream "Write a Python function that reverses a '
            f'string."{http}\nA process that dies is restarted; Ctrl-C stops them all.',
            flush=True,
        )

    return Supervisor(children, ready_timeout=args.ready_timeout, on_ready=ready).run()
