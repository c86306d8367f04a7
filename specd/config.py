"""Typed settings for the services, one dataclass each, validated when built."""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass

DEFAULT_KV_TOKENS = 8192


@dataclass
class EngineConfig:
    """The verifier's engine: KV pool, batching, speculation."""

    # The KV pool: `num_blocks` blocks where > 0, else `kv_cache_bytes` of K/V where > 0,
    # else room for DEFAULT_KV_TOKENS tokens, the model deciding the bytes (as llama.cpp's
    # `-c` counts tokens): 224 MiB for the 1.5B target in a 16-bit cache (the default;
    # 448 MiB with --kv-dtype fp32), 896 MiB for a Llama-3.2-3B (BENCHMARKS.md, resident
    # memory).
    kv_cache_bytes: int = 0
    num_blocks: int = 0
    block_size: int = 16
    max_batch_size: int = 16  # running sequences
    max_batched_tokens: int = 512  # tokens per forward (prefill chunks + verification)
    max_draft_tokens: int = 8  # upper bound on k per sequence
    # decode and verification forwards take the same shapes (attention query tiles of 16;
    # dense bf16 matmuls in 16-row tiles; the int8/int4 kernel is invariant by itself), so
    # greedy output is identical with and without speculation (BENCHMARKS.md: its cost)
    batch_invariant: bool = True
    # `auto` requests: pick k per step from measured costs (verifier_service/controller.py).
    # On by default since round 14: fixed bounds cannot know what rows cost on the CPU at
    # hand. On an AVX2 CPU, where a 7-row verification costs 3x a plain step, `auto`
    # without it drafted the route's k at 0.74x of plain decoding (c = 1, code); with it
    # 0.95-1.03x at c = 1-8 (BENCHMARKS.md section 22). `--no-cost-model`: `auto` drafts
    # the route's k within its batch/KV bounds; acceptance still decays and probes
    cost_model: bool = True
    draft_gate_memory_s: float = 1.0  # draft_below_batch compares the largest batch seen
    # a drafter's alternative leaves are verified while a step feeds at most this many
    # tokens (up to 16 rows cost about one row on a GPU or with AMX); 0 = never. With the
    # cost model, only as many as the measured forward prices near free (none on an AVX2
    # CPU, where each row costs ~0.4 of a step: BENCHMARKS.md section 29)
    max_tree_tokens: int = 16
    # reuse the K/V of a prompt's longest cached prefix (whole blocks; specd.kvcache).
    # auto: on where the model's forward is chunk-invariant (integer kernels + paged
    # attention: the default CPU formats), so a cached prefix cannot change an output;
    # on: also for dense weights, where the rows after a cached prefix may round
    # differently (as vLLM's and llama-server's prompt caches do)
    prefix_cache: str = "auto"
    draft_top_m: int = 32  # support size of a sampled draft's q

    def __post_init__(self):
        if self.block_size <= 0 or self.max_batch_size <= 0:
            raise ValueError("block_size and max_batch_size must be positive")
        if self.max_batched_tokens < self.max_draft_tokens + 1:
            raise ValueError("max_batched_tokens must hold one verification (k + 1 tokens)")
        if self.max_draft_tokens < 0 or self.draft_top_m <= 0:
            raise ValueError("max_draft_tokens must be >= 0 and draft_top_m > 0")
        _check_prefix_cache(self.prefix_cache)


PREFIX_CACHE = ("auto", "on", "off")


def _check_prefix_cache(value: str) -> None:
    if value not in PREFIX_CACHE:
        raise ValueError(f"prefix_cache must be one of {', '.join(PREFIX_CACHE)}, got {value!r}")


def chunk_invariant(model) -> bool:
    """Whether every row of the model's forward is computed from its own inputs and its
    sequence's cache alone (specd.models.llama; False for a model that cannot say)."""
    return bool(getattr(model, "chunk_invariant", lambda: False)())


def prefix_cache_on(setting: str, model) -> bool:
    """A `prefix_cache` setting for this model: `auto` is on where a cached prefix cannot
    change an output (the model's forward is chunk-invariant)."""
    if setting == "auto":
        return chunk_invariant(model)
    return setting == "on"


@dataclass
class DrafterConfig:
    """`specd serve drafter`."""

    host: str = "127.0.0.1"
    port: int = 50061
    model: str = "default-draft"
    proposer: str = "combined"  # draft (the small model), ngram, or combined (ngram, else draft)
    dtype: str = "auto"
    kv_dtype: str = "auto"  # as the verifier's
    device: str = ""  # "" = cuda if present, else cpu
    kv_cache_bytes: int = 1 << 29
    top_m: int = 32  # support size of a sampled draft's q
    max_draft_tokens: int = 16
    # the draft model adds its runner-up token as an alternative beside each of its first
    # `alternatives` drafts (verifier_service/tree.py; the verifier keeps them while a step
    # feeds <= 16 tokens); 0 = a plain chain. +1-5% on code, +15% on chat (BENCHMARKS.md)
    alternatives: int = 8
    # between rounds, draft the next round as if every draft will be accepted (pays only
    # where the drafter has cores or a device of its own; BENCHMARKS.md)
    draft_ahead: bool = False
    weights: str = "auto"  # bf16 | int8 | int4 | auto, as the verifier's (specd.models.weights)
    prefix_cache: str = "auto"  # auto | on | off, as the verifier's (EngineConfig)
    vocab: int = 49152  # score only the `vocab` most frequent tokens (trimmed head); 0 = all
    # a round stops after a draft the draft model gave a probability under p_min (greedy:
    # its top token's; sampling: the drawn token's in q). That draft is still verified: a
    # verification row costs a third of a draft forward (BENCHMARKS.md section 43). So the
    # route's k is a cap, reached where the draft model is sure. 0 = always draft k
    p_min: float = 0.7
    metrics_port: int = 0  # 0 = no Prometheus endpoint
    # on SIGTERM: draft streams get this long (a verifier decodes without drafts meanwhile)
    drain_seconds: float = 2.0
    tls_cert: str = ""  # PEM; with tls_key, this listener speaks TLS only
    tls_key: str = ""

    def __post_init__(self):
        if self.proposer not in ("draft", "ngram", "combined"):
            raise ValueError(f"proposer must be draft, ngram or combined, got {self.proposer!r}")
        _check_weights(self.weights)
        _check_kv_dtype(self.kv_dtype)
        _check_prefix_cache(self.prefix_cache)
        if self.vocab < 0 or self.alternatives < 0:
            raise ValueError("vocab and alternatives must be >= 0")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"p_min must be in [0, 1], got {self.p_min}")


WEIGHT_FORMATS = ("auto", "bf16", "int8", "int4")  # specd.models.weights


def _check_weights(value: str) -> None:
    if value not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {value!r}")


KV_DTYPES = ("auto", "fp32", "fp16", "bf16")  # specd.models.paged_kv.kv_dtype


def _check_kv_dtype(value: str) -> None:
    if value not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {value!r}")


@dataclass
class VerifierConfig:
    """`specd serve verifier`."""

    host: str = "127.0.0.1"
    port: int = 50062
    model: str = "default-target"
    dtype: str = "auto"
    # matrices in bf16 (the model's dtype), int8 or int4 (groups of 32, from the GGUF's own
    # blocks where it has them); auto: int4 on a CPU with AVX512-VNNI or AVX2, else bf16
    # (specd.models.weights; speed and quality in BENCHMARKS.md)
    weights: str = "auto"
    # the K/V cache: auto = fp16 where activations are fp32 (a CPU without bf16 hardware:
    # half the bytes, as llama.cpp's default f16 cache), else the activations' dtype;
    # fp32 | fp16 | bf16 (specd.models.paged_kv; quality in BENCHMARKS.md)
    kv_dtype: str = "auto"
    device: str = ""
    drafter: str = ""  # host:port of the drafter; "" = no speculation
    drafter_timeout_ms: int = 3000  # per round; past it the round decodes with k = 0
    drafter_reconnect_ms: int = 1000
    drafter_startup_wait_ms: int = 30000  # at start, wait this long for the drafter to answer
    max_queue: int = 256  # waiting requests past which Generate is RESOURCE_EXHAUSTED
    metrics_port: int = 0
    # on SIGTERM: NOT_SERVING, new calls refused, running requests get this long to finish
    drain_seconds: float = 30.0
    tls_cert: str = ""  # PEM; with tls_key, this listener speaks TLS only
    tls_key: str = ""
    tls_ca: str = ""  # PEM of the CA that signed the drafter's certificate
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        _check_weights(self.weights)
        _check_kv_dtype(self.kv_dtype)


@dataclass
class RouterConfig:
    """`specd serve router`."""

    host: str = "127.0.0.1"
    port: int = 50051
    verifier: list[str] = field(default_factory=list)  # host:port, repeat for replicas
    verifier_dns: list[str] = field(default_factory=list)  # name:port resolved to replicas
    dns_refresh_s: float = 5.0
    tokenizer: str = "default-target"  # model name or folder with the tokenizer files
    policy_file: str = ""  # per-route YAML; "" = built-in default policy
    default_max_new_tokens: int = 256
    max_new_tokens_cap: int = 4096
    auth_token_file: str = ""  # clients must send "authorization: Bearer <token>"
    tls_cert: str = ""  # PEM; with tls_key, this listener speaks TLS only
    tls_key: str = ""
    tls_ca: str = ""  # PEM of the CA that signed the verifiers' certificates
    metrics_port: int = 0
    # on SIGTERM: NOT_SERVING, new calls refused, running requests get this long to finish
    drain_seconds: float = 30.0
    # the OpenAI-compatible HTTP API (same token and certificate); 0 = off. `specd up`,
    # compose and the Kubernetes manifests serve it on 8000
    http_port: int = 0
    served_model_name: str = ""  # the model id HTTP clients name; "" = --tokenizer's


# -- the CLI is derived from these dataclasses, so defaults live in one place -------------
def add_arguments(parser, cls, prefix: str = "") -> None:
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        kind = hints[f.name]
        if is_dataclass(kind):
            add_arguments(parser, kind, prefix=f"{prefix}{f.name}.")
            continue
        flag = "--" + f.name.replace("_", "-")
        dest = prefix + f.name
        default = f.default if f.default is not MISSING else None
        if kind is bool:
            parser.add_argument(
                flag, dest=dest, action=argparse.BooleanOptionalAction, default=default
            )
        elif typing.get_origin(kind) is list:
            parser.add_argument(
                flag, dest=dest, action="append", default=None, help="repeat for several"
            )
        else:
            parser.add_argument(
                flag, dest=dest, type=kind, default=default, help=f"default: {default}"
            )


def from_arguments(cls, namespace, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            values[f.name] = from_arguments(hints[f.name], namespace, f"{prefix}{f.name}.")
            continue
        value = getattr(namespace, prefix + f.name, None)
        if value is not None:
            values[f.name] = value
    return cls(**values)
