"""Typed settings for the services, one dataclass each, validated when built."""

from __future__ import annotations

import json
import re
import ssl
from dataclasses import dataclass, field

from specd.params import sampling_overrides
from specd.speculation_config import SpeculationConfig

# how a drafter may draft (the drafter's `--proposer`, a route's `proposer`)
PROPOSERS = ("draft", "ngram", "combined", "suffix")


def check_proposer(name: str, empty_ok: bool = True) -> None:
    """ValueError unless `name` is one of PROPOSERS (or "", the drafter's own way)."""
    if name not in PROPOSERS and not (empty_ok and name == ""):
        choices = ", ".join(PROPOSERS) + (" or empty" if empty_ok else "")
        raise ValueError(f"proposer must be one of {choices}, got {name!r}")


DEFAULT_KV_BYTES = 2 << 30  # the verifier's KV pool at most, unless sized (EngineConfig)
# batch-invariant mode: the rows of a dense bf16 matmul, and of a query tile of SDPA, that
# every decode and verification forward takes (specd.models.matmul), so a row rounds the
# same in a step of 1 or of k + 1 rows; a tree of alternatives fits in one such tile
INVARIANT_TILE = 16


@dataclass
class EngineConfig:
    """The verifier's engine: KV pool, batching, speculation."""

    # the KV pool's size in bytes of K/V, where > 0 (else `num_blocks`, else room for the
    # model's whole context, as llama-server's `-c 0`, within 2 GiB (DEFAULT_KV_BYTES):
    # 32,768 tokens, 896 MiB, for the 1.5B target in a 16-bit cache; 18,724 of a
    # Llama-3.2-3B's 131,072); a request that cannot fit is refused
    kv_cache_bytes: int = 0
    num_blocks: int = 0  # the KV pool's size in blocks, where > 0
    # on a GPU, where the two above are not given: the share of its memory this verifier
    # may take, weights, steps and K/V pool together, the pool what the rest leave
    # (vLLM's --gpu-memory-utilization); 0 = as above. A CPU ignores it, as vLLM's does
    gpu_memory_utilization: float = 0.0
    # the longest prompt + generation a request may ask for (vLLM's --max-model-len; the
    # KV pool is sized for it unless sized above); 0 = the model's context
    max_model_len: int = 0
    block_size: int = 16  # tokens per KV block
    max_batch_size: int = 16  # sequences running at once (more wait)
    # tokens per forward (prefill chunks + verification); 0 = auto: 512 on a GPU, 128 on a
    # CPU, whose forward takes time by its rows: a prompt's chunk holds every decoding
    # sequence for that forward, and smaller chunks prefill as fast there
    max_batched_tokens: int = 0
    max_draft_tokens: int = 8  # the most drafts per round for any request
    # decode and verification rows round alike (fixed-shape matmul and attention tiles;
    # the CPU's int8/int4 kernels and the GPU step are so by themselves): greedy output is
    # the same with speculation on and off. --no-batch-invariant trades that for speed
    batch_invariant: bool = True
    # `auto` requests draft where the step's predicted tokens/s, from measured costs and
    # acceptance, beat plain decoding; --no-cost-model: they draft their route's k within
    # its batch and KV bounds (acceptance still decays, and a route off probes)
    cost_model: bool = True
    # the speculation control's tuned numbers (specd/speculation_config.py)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    # a drafter's alternative leaves are verified while a step feeds at most this many
    # tokens (0 = never); with the cost model only as many as the measured forward prices
    # near free
    max_tree_tokens: int = 16
    # reuse the K/V of a prompt's longest cached prefix (whole blocks): auto = on where a
    # cached prefix cannot change an output (every row of the forward computed on its own:
    # the CPU's integer kernels, the GPU step); on = also where it may round differently
    # (as vLLM's and llama-server's prompt caches); off
    prefix_cache: str = "auto"
    draft_top_m: int = 32  # support size of a sampled draft's q
    # N >= 0: a sampled request that names no seed takes the next of a sequence of seeds
    # started from N, as if it had named it (vLLM's --seed); -1: each its own random seed
    seed: int = -1
    # on a GPU: every step eager, no CUDA graphs captured (less memory, a faster start,
    # slower steps; vLLM's --enforce-eager); nothing is captured on a CPU
    enforce_eager: bool = False

    def __post_init__(self):
        if self.block_size <= 0 or self.max_batch_size <= 0:
            raise ValueError("block_size and max_batch_size must be positive")
        if not 0.0 <= self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in [0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if self.max_batched_tokens < 0 or 0 < self.max_batched_tokens < self.max_draft_tokens + 1:
            raise ValueError("max_batched_tokens must hold one verification (k + 1 tokens)")
        if self.max_draft_tokens < 0 or self.draft_top_m <= 0:
            raise ValueError("max_draft_tokens must be >= 0 and draft_top_m > 0")
        _check_prefix_cache(self.prefix_cache)
        if self.seed < -1:
            raise ValueError(f"seed must be >= 0, or -1: random; got {self.seed}")


PREFIX_CACHE = ("auto", "on", "off")


def _check_prefix_cache(value: str) -> None:
    if value not in PREFIX_CACHE:
        raise ValueError(f"prefix_cache must be one of {', '.join(PREFIX_CACHE)}, got {value!r}")


def chunk_invariant(model) -> bool:
    """Whether every row of the model's forward is computed from its own inputs and its
    sequence's cache alone (specd.models.llama; False for a model that cannot say)."""
    return bool(getattr(model, "chunk_invariant", lambda: False)())


BATCHED_TOKENS = {"cpu": 128, "cuda": 512}  # EngineConfig.max_batched_tokens's auto


def batched_tokens(config: EngineConfig, device: str) -> int:
    """`max_batched_tokens` on a device type: auto (0) by the device, at least one
    verification of the largest k."""
    if config.max_batched_tokens:
        return config.max_batched_tokens
    return max(BATCHED_TOKENS.get(device, BATCHED_TOKENS["cpu"]), config.max_draft_tokens + 1)


CPU_CONTEXT_WINDOW = 256  # DrafterConfig.context_window's auto on a CPU


def context_window(setting: str, device: str) -> int:
    """A `context_window` setting on a drafter's device type -> tokens (0: no window)."""
    if setting == "auto":
        return CPU_CONTEXT_WINDOW if device == "cpu" else 0
    if not setting.isdigit():
        raise ValueError(f"context_window must be auto or a count of tokens >= 0, got {setting!r}")
    return int(setting)


def prefix_cache_on(setting: str, model) -> bool:
    """A `prefix_cache` setting for this model: `auto` is on where a cached prefix cannot
    change an output (the model's forward is chunk-invariant)."""
    if setting == "auto":
        return chunk_invariant(model)
    return setting == "on"


@dataclass
class DrafterConfig:
    """`specd serve drafter`."""

    host: str = "127.0.0.1"  # the address to listen on
    port: int = 50061  # the gRPC port
    model: str = "default-draft"  # catalogue name, Hugging Face folder, .gguf file or hub id
    # draft (the small model), ngram (a lookup in the request's own text), combined (the
    # lookup where the text repeats, else the model) or suffix (combined's, plus a lookup in
    # what earlier responses of the request's route said: drafter_service/suffix.py)
    proposer: str = "combined"
    # suffix: share earlier responses within a route (off: each request's own text only)
    suffix_shared: bool = True
    suffix_memory_tokens: int = 1 << 20  # suffix: earlier responses kept per route, in tokens
    prompt_lookup_max: int = 4  # ngram: the longest run of the text's last tokens looked up
    prompt_lookup_min: int = 1  # ngram: the shortest run looked up (fewer: no drafts)
    dtype: str = "auto"  # activations: auto (bf16 where the hardware has it), bf16, fp32, fp16
    kv_dtype: str = "auto"  # the K/V cache's dtype, as the verifier's
    device: str = ""  # cpu, cuda or cuda:N; "" = cuda if present, else cpu
    kv_cache_bytes: int = 1 << 29  # the draft model's KV pool, in bytes
    top_m: int = 32  # support size of a sampled draft's q
    max_draft_tokens: int = 16  # the most drafts a round may ask for
    # the runner-up token as an alternative leaf beside each of the first `alternatives`
    # drafts, verified in the same forward (0 = a plain chain)
    alternatives: int = 8
    # between rounds, draft the next rounds as if every draft will be accepted, and push
    # them to the verifier, which takes them without asking where they hold (pays where the
    # drafter has cores or a device of its own; an n-gram drafter always does)
    draft_ahead: bool = False
    weights: str = "auto"  # bf16 | int8 | int4 | auto, as the verifier's
    prefix_cache: str = "auto"  # auto | on | off, as the verifier's
    vocab: int = 49152  # score only the `vocab` most frequent tokens (trimmed head); 0 = all
    # a round stops after a draft the draft model gave a probability under p_min (greedy:
    # its top token's; sampling: the drawn token's in q); that draft is still verified,
    # so the route's k is a cap, reached where the draft model is sure. 0 = always draft k
    p_min: float = 0.7
    # N: the draft model drafts a long prompt from its last N to 2N tokens, where more than
    # N would need computing (its prefill and attention stay bounded; the output is the
    # target's either way); 0 = from the first token; auto = 256 on a CPU (where that
    # prefill takes the cores the target decodes on), 0 on a GPU
    context_window: str = "auto"
    enforce_eager: bool = False  # on a GPU: no CUDA graphs, as the verifier's
    metrics_port: int = 0  # the Prometheus endpoint's port; 0 = none
    # on SIGTERM: draft streams get this long (a verifier decodes without drafts meanwhile)
    drain_seconds: float = 2.0
    tls_cert: str = ""  # PEM certificate; with tls_key, this listener speaks TLS only
    tls_key: str = ""  # PEM key of tls_cert

    def __post_init__(self):
        check_tls(self.tls_cert, self.tls_key)
        check_proposer(self.proposer, empty_ok=False)
        if self.suffix_memory_tokens < 0:
            raise ValueError("suffix_memory_tokens must be >= 0")
        _check_lookup_window(self.prompt_lookup_min, self.prompt_lookup_max)
        _check_dtype(self.dtype)
        _check_weights(self.weights)
        _check_kv_dtype(self.kv_dtype)
        _check_prefix_cache(self.prefix_cache)
        if self.vocab < 0 or self.alternatives < 0:
            raise ValueError("vocab and alternatives must be >= 0")
        context_window(self.context_window, "cpu")  # refused here if malformed
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"p_min must be in [0, 1], got {self.p_min}")


# activations (specd.models.args.parse_dtype), and the other spellings of the three that
# torch and vLLM's --dtype take
DTYPE_SPELLINGS = {
    "bfloat16": "bf16",
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
}
DTYPES = ("auto", "bf16", "fp32", "fp16", *DTYPE_SPELLINGS)


def _check_lookup_window(low: int, high: int) -> None:
    if not 1 <= low <= high:
        raise ValueError(
            f"prompt_lookup_min and prompt_lookup_max must be 1 <= min <= max, got {low} and {high}"
        )


def _check_dtype(value: str) -> None:
    if value not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES[:4])}, got {value!r}")


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

    host: str = "127.0.0.1"  # the address to listen on
    port: int = 50062  # the gRPC port
    model: str = "default-target"  # catalogue name, Hugging Face folder, .gguf file or hub id
    dtype: str = "auto"  # activations: auto (bf16 where the hardware has it), bf16, fp32, fp16
    # matrices in bf16 (the model's dtype), int8 or int4 (groups of 32, from the GGUF's own
    # blocks where it has them); auto: int4 on a CPU with AVX512-VNNI or AVX2, else bf16
    # (a GPU runs bf16)
    weights: str = "auto"
    # the K/V cache: auto = fp16 under fp32 activations (a CPU without bf16: half the
    # bytes, as llama.cpp's default f16 cache), else the activations' dtype; fp32, fp16,
    # bf16
    kv_dtype: str = "auto"
    device: str = ""  # cpu, cuda or cuda:N; "" = cuda if present, else cpu
    drafter: str = ""  # host:port of the drafter; "" = no speculation (unless `lookup`)
    # draft by a lookup in the request's own text, in this process, with no drafter (as
    # vLLM's ngram method: no round trip a round); the drafter's `--proposer ngram` alike
    lookup: bool = False
    prompt_lookup_max: int = 4  # lookup: the longest run of the text's last tokens looked up
    prompt_lookup_min: int = 1  # lookup: the shortest run looked up (fewer: no drafts)
    drafter_timeout_ms: int = 3000  # per round; past it the round decodes with k = 0
    drafter_reconnect_ms: int = 1000  # between attempts to reach a drafter that went away
    drafter_startup_wait_ms: int = 30000  # at start, wait this long for the drafter to answer
    # ask an n-gram drafter (one whose rounds run no model) for a sequence's next round as
    # soon as its step's tokens are committed: the round trip runs beside the rest of the
    # step and the next plan
    drafter_prefetch: bool = True
    max_queue: int = 256  # waiting requests past which Generate is RESOURCE_EXHAUSTED
    metrics_port: int = 0  # the Prometheus endpoint's port; 0 = none
    # seconds between the stats lines in the log while requests run (throughput, requests,
    # KV cache, prefix cache hits, acceptance; vLLM's); 0 = none (vLLM's --disable-log-stats)
    log_stats_interval: float = 10.0
    # on SIGTERM: NOT_SERVING, new calls refused, running requests get this long to finish
    drain_seconds: float = 30.0
    tls_cert: str = ""  # PEM certificate; with tls_key, this listener speaks TLS only
    tls_key: str = ""  # PEM key of tls_cert
    tls_ca: str = ""  # PEM of the CA that signed the drafter's certificate
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        check_tls(self.tls_cert, self.tls_key)
        if self.lookup and self.drafter:
            raise ValueError(
                f"lookup and drafter {self.drafter}: the verifier drafts by its own lookup or "
                "asks a drafter; give one (a drafter's --proposer ngram looks up there)"
            )
        _check_lookup_window(self.prompt_lookup_min, self.prompt_lookup_max)
        _check_dtype(self.dtype)
        _check_weights(self.weights)
        _check_kv_dtype(self.kv_dtype)


@dataclass
class RouterConfig:
    """`specd serve router`."""

    host: str = "127.0.0.1"  # the address to listen on
    port: int = 50051  # the gRPC port
    verifier: list[str] = field(default_factory=list)  # a verifier's host:port
    verifier_dns: list[str] = field(default_factory=list)  # name:port resolved to replicas
    dns_refresh_s: float = 5.0  # how often verifier_dns names are resolved again
    # send a prompt to a replica that likely holds its prefix in its cache (within a
    # couple of requests of the least loaded; router/affinity.py), else the least loaded
    prefix_affinity: bool = True
    tokenizer: str = "default-target"  # model name or folder with the tokenizer files
    policy_file: str = ""  # per-route YAML; "" = built-in default policy
    policy: str = ""  # the per-route policy as YAML text, where no policy_file is named
    default_max_new_tokens: int = 256  # a request that names no limit
    max_new_tokens_cap: int = 0  # the most any request may ask for; 0 = what verifiers take
    auth_token_file: str = ""  # clients must send "authorization: Bearer <token>"
    tls_cert: str = ""  # PEM certificate; with tls_key, this listener speaks TLS only
    tls_key: str = ""  # PEM key of tls_cert
    tls_ca: str = ""  # PEM of the CA that signed the verifiers' certificates
    # the HTTP port's own certificate (`specd up`'s --ssl-certfile, vLLM's: HTTPS there,
    # the gRPC port plain); "" = tls_cert's
    http_tls_cert: str = ""
    http_tls_key: str = ""  # PEM key of http_tls_cert
    metrics_port: int = 0  # the Prometheus endpoint's port; 0 = none
    # on SIGTERM: NOT_SERVING, new calls refused, running requests get this long to finish
    drain_seconds: float = 30.0
    # the OpenAI-compatible HTTP API (same token and certificate); 0 = off. `specd up`,
    # compose and the Kubernetes manifests serve it on 8000
    http_port: int = 0
    # the model's ids to HTTP clients (vLLM's): the first answers; none = --tokenizer's
    served_model_name: list[str] = field(default_factory=list)
    # the chat template in place of the model's: a file, or the template's text, as
    # vLLM's --chat-template takes it; "" = the model's
    chat_template: str = ""
    # what an HTTP request's absent temperature, top_p, top_k, min_p and repetition_penalty
    # mean: model = the values the model's generation_config.json recommends, where it
    # names them (as vLLM and SGLang serve it), else the OpenAI API's; openai = the OpenAI
    # API's (temperature 1, the rest off)
    sampling_defaults: str = "model"
    # vLLM's: a JSON object of defaults over those, e.g. {"temperature": 0.2} (any of
    # temperature, top_p, top_k, min_p, repetition_penalty); on llama-server's /completion
    # and /infill over its own defaults too
    override_generation_config: str = ""
    # the seed of a sampled HTTP request that names none, as llama-server's -s gives it
    # (the same prompt then samples alike; n choices take seed + i); -1 = none (vLLM's)
    default_seed: int = -1
    # how the model writes a tool call, for `tool_choice: auto` (vLLM's flag): hermes,
    # llama3_json, or auto = the format its chat template teaches
    tool_call_parser: str = "auto"
    # the thinking a reasoning model writes between <think> and </think>, answered apart
    # (chat's reasoning_content; the Responses API's reasoning item; Anthropic's thinking
    # block), vLLM's flag: deepseek_r1 or qwen3; "" = none, the thinking stays in the text
    reasoning_parser: str = ""
    # with a reasoning parser, a chat's constraint (structured output, a forced tool call)
    # holds after the thinking; this holds it from the first token, thinking included
    # (vLLM's structured_outputs_config.enable_in_reasoning)
    structured_outputs_in_reasoning: bool = False
    # the sites whose pages may call the HTTP port (CORS): a JSON list, e.g.
    # ["https://chat.example.com"], or comma-separated; "*" = any (as vLLM, SGLang and
    # llama-server allow by default); [] = none
    allowed_origins: str = '["*"]'
    allowed_methods: str = '["*"]'  # the methods such a page may use; "*" = any
    allowed_headers: str = '["*"]'  # the headers it may send; "*" = any
    allow_credentials: bool = False  # with the browser's cookies and HTTP authentication
    # llama-server's GET /slots on the HTTP port (router/slots_http.py), as it serves it
    slots: bool = True

    def __post_init__(self):
        check_tls(self.tls_cert, self.tls_key)
        check_tls(self.http_tls_cert, self.http_tls_key, "http_tls_cert", "http_tls_key")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            string_list(getattr(self, name), name)  # refused here if malformed
        if self.policy and self.policy_file:
            raise ValueError("policy and policy_file: name one")
        if self.chat_template:
            from specd.chat_template import read_chat_template

            read_chat_template(self.chat_template)  # refused here if it cannot be read
        if self.default_max_new_tokens < 1 and self.default_max_new_tokens != -1:
            raise ValueError(
                "default_max_new_tokens must be >= 1, or -1: what the context leaves; got "
                f"{self.default_max_new_tokens}"
            )
        sampling_overrides(self.override_generation_config)  # refused here if malformed
        if not -1 <= self.default_seed < 1 << 64:
            raise ValueError(f"default_seed must be in [0, 2**64), or -1; got {self.default_seed}")
        if self.sampling_defaults not in ("model", "openai"):
            raise ValueError(
                f"sampling_defaults must be model or openai, got {self.sampling_defaults!r}"
            )


def check_tls(cert: str, key: str, cert_name="tls_cert", key_name="tls_key") -> None:
    """A listener's certificate and key: both or neither, and they load together."""
    if not cert and not key:
        return
    if not (cert and key):
        raise ValueError(f"{cert_name} and {key_name}: give both, or neither")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
        return
    except ssl.SSLError as exc:  # its reason, e.g. KEY_VALUES_MISMATCH: a key of another
        why = (exc.reason or "unreadable").lower().replace("_", " ")
        why = f"not a PEM certificate and its key ({why})"
    except OSError as exc:
        why = exc.strerror
    raise ValueError(f"{cert_name} {cert} with {key_name} {key}: {why}")


def string_list(text: str, name: str) -> tuple[str, ...]:
    """A flag's list of strings: a JSON list (as vLLM takes it), or comma-separated."""
    text = text.strip()
    if not text.startswith("["):
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        if any(re.search(r'[\s"\[\]{}]', item) for item in items):
            raise ValueError(f"{name}: a JSON list, or comma-separated words; got {text!r}")
        return items
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not a JSON list ({exc.msg}): {text!r}") from None
    if not all(isinstance(i, str) and i for i in items):
        raise ValueError(f"{name}: a JSON list of non-empty strings, got {text!r}")
    return tuple(items)


class ConfigError(ValueError):
    """A flag's value its config refuses (said to the user in one line)."""
