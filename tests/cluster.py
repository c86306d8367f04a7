"""Three specd servers in-process on ephemeral loopback ports, for tests.

The servers run on an event loop in a background thread, so tests talk to them with the
ordinary synchronous client, like users do.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from pathlib import Path

from drafter_service.draft_model import DraftModelProposer
from drafter_service.server import DrafterServicer
from protos.specd.v1 import (
    drafter_pb2,
    drafter_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from router.generation import Router
from router.openai_http import OpenAIDoor
from router.openai_http import start as start_http
from router.policy import Policy
from router.replicas import ReplicaSet
from router.server import GenerationServicer
from specd.config import EngineConfig
from specd.serving import start_server
from verifier_service.drafter_client import RemoteProposer
from verifier_service.engine import Engine
from verifier_service.frontend import AsyncEngine
from verifier_service.server import VerifierServicer

TINY_MODEL_ID = "tiny"  # the model id the router's HTTP door serves
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def char_tokenizer():
    """96 printable ASCII characters = the tiny models' 96-token vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(32 + i): i for i in range(96)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="?")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@dataclass
class Cluster:
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    router: str = ""
    drafter: str = ""
    verifiers: list[str] = field(default_factory=list)
    engines: list[Engine] = field(default_factory=list)
    verifier_servicers: list[VerifierServicer] = field(default_factory=list)
    drafter_servicer: DrafterServicer | None = None
    proposer: DraftModelProposer | None = None
    servers: dict = field(default_factory=dict)
    metrics_urls: dict = field(default_factory=dict)  # service -> scrape URL
    http_servers: list = field(default_factory=list)
    router_core: Router | None = None
    http: str = ""  # the router's OpenAI-compatible door, http://host:port
    http_runner: object = None

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop_drafter(self) -> None:
        self.run(self.servers["drafter"].stop(0))

    def start_drafter(self) -> None:
        port = int(self.drafter.rsplit(":", 1)[1])
        self.servers["drafter"] = self.run(self._drafter_server(port))[0]

    async def _drafter_server(self, port: int):
        return await start_server(
            "127.0.0.1",
            port,
            lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(self.drafter_servicer, s),
            [drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name],
        )

    def close(self) -> None:
        async def shutdown():
            for httpd in self.http_servers:
                httpd.shutdown()
            if self.http_runner is not None:
                await self.http_runner.cleanup()
            for server in self.servers.values():
                await server.stop(0)
            await self.replicas.close()
            for servicer in self.verifier_servicers:
                await servicer.close()

        self.run(shutdown())
        for engine in self.engines:
            if engine.proposer is not None:
                engine.proposer.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _telemetry(c: Cluster, service: str, span_exporter, metrics: bool):
    if span_exporter is None and not metrics:
        return None
    from prometheus_client import start_http_server

    from specd.telemetry import setup

    t = setup(service, span_exporter=span_exporter, metrics=metrics)
    if metrics:
        httpd, _ = start_http_server(0, addr="127.0.0.1", registry=t.registry)
        c.metrics_urls[service] = f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
        c.http_servers.append(httpd)
    return t


def start_cluster(
    target,
    draft,
    policy: Policy | None = None,
    replicas: int = 1,
    drafter_timeout_ms: int = 2000,
    engine_config: EngineConfig | None = None,
    span_exporter=None,
    metrics: bool = False,
    alternatives: int = 0,
    draft_ahead: bool = False,
    load_tokenizer=char_tokenizer,
    drafter_prefix_cache: bool = False,
) -> Cluster:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    c = Cluster(loop, thread)

    async def boot():
        c.proposer = DraftModelProposer(
            draft,
            num_blocks=256,
            block_size=4,
            alternatives=alternatives,
            prefix_cache=drafter_prefix_cache,
        )
        c.drafter_servicer = DrafterServicer(
            c.proposer,
            draft.args.vocab_size,
            telemetry=_telemetry(c, "drafter", span_exporter, metrics),
            draft_ahead=draft_ahead,
            name="tiny-draft",
            load_tokenizer=load_tokenizer,
        )
        server, port, _ = await c._drafter_server(0)
        c.servers["drafter"], c.drafter = server, f"127.0.0.1:{port}"
        for i in range(replicas):
            cfg = engine_config or EngineConfig(num_blocks=256, block_size=4)
            t = _telemetry(c, f"verifier{i}", span_exporter, metrics)
            engine = Engine(
                target,
                cfg,
                RemoteProposer(c.drafter, drafter_timeout_ms, 200, t),
                eos_ids=set(),
                telemetry=t,
                load_tokenizer=load_tokenizer,
            )
            servicer = VerifierServicer(AsyncEngine(engine), "tiny", telemetry=t)
            server, port, _ = await start_server(
                "127.0.0.1",
                0,
                lambda s, v=servicer: verifier_pb2_grpc.add_VerifierServicer_to_server(v, s),
                [verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name],
            )
            c.servers[f"verifier{i}"] = server
            c.verifiers.append(f"127.0.0.1:{port}")
            c.engines.append(engine)
            c.verifier_servicers.append(servicer)
        c.replicas = ReplicaSet(c.verifiers)
        await c.replicas.start()
        telemetry = _telemetry(c, "router", span_exporter, metrics)
        c.router_core = Router(
            char_tokenizer(),
            c.replicas,
            policy or Policy.from_dict({}),
            telemetry=telemetry,
            model_name=TINY_MODEL_ID,
        )
        gen = GenerationServicer(c.router_core)
        server, port, _ = await start_server(
            "127.0.0.1",
            0,
            lambda s: router_pb2_grpc.add_GenerationServicer_to_server(gen, s),
            [router_pb2.DESCRIPTOR.services_by_name["Generation"].full_name],
        )
        c.servers["router"], c.router = server, f"127.0.0.1:{port}"
        registry = telemetry.registry if telemetry is not None else None
        door = OpenAIDoor(c.router_core, TINY_MODEL_ID, ("tiny-alias",), registry=registry)
        c.http_runner, http_port = await start_http(door, "127.0.0.1", 0)
        c.http = f"http://127.0.0.1:{http_port}"
        assert await c.replicas.wait_ready(10)
        for _ in range(200):  # and until every replica's drafter handshake is done
            reports = [r.report for r in c.replicas.replicas.values()]
            if all(r is not None and r.drafter_available for r in reports):
                break
            await asyncio.sleep(0.05)
        else:
            raise TimeoutError("a verifier never reported its drafter available")

    c.run(boot())
    return c


def save_tiny_cluster_model(folder: Path) -> Path:
    """A tiny random Qwen2 (the default pair's architecture: plain RoPE, QKV bias, tied
    embeddings) with the char tokenizer beside it, loadable by every service."""
    from tests.conftest import make_tiny

    make_tiny("qwen2", folder)
    char_tokenizer().save_pretrained(folder)
    return folder
