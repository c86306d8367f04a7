"""SGLang's native endpoints on the HTTP door, for the clients written against SGLang's
runtime (reinforcement-learning rollout frameworks send token ids to /generate):

    POST /generate                      text or input_ids in, one or a batch, with
                                        sampling_params (n samples each); text,
                                        output_ids and meta_info out; `stream: true`: a
                                        `data:` event per step with all so far, then
                                        `data: [DONE]`, as SGLang streams by default
    GET  /get_model_info, /model_info   what the server runs
    GET  /health_generate               200 once a one-token generation has run
    GET  /get_server_info, /server_info the model, its context, and speculation's mean
                                        accepted length since start
    GET  /get_load                      each replica's requests and KV tokens in use, as
                                        SGLang's Model Gateway polls a worker's load

Bodies are router/sglang_schema.py's. The door's bearer token guards them, as SGLang's
--api-key does."""

from __future__ import annotations

import contextlib
import time
import uuid

import grpc
from aiohttp import web

from router import sse
from router.body import BodyError, parse
from router.generation import side_by_side
from router.openai_errors import error_event, error_response, request_error_response
from router.openai_request import request_timeout, to_request
from router.prepare import Prepared, RequestError
from router.sglang_fields import salt
from router.sglang_schema import MAX_PROMPTS, GenerateBody, SglangSampling

PATHS = (
    "/generate",
    "/get_model_info",
    "/model_info",
    "/health_generate",
    "/get_server_info",
    "/server_info",
    "/get_load",
)
END = b"data: [DONE]\n\n"


class SglangRoutes:
    def __init__(self, door):
        """`door`: the HTTP door (router.openai_http.OpenAIDoor) whose router serves them."""
        self.door = door
        self.router = door.router

    def routes(self) -> list:
        return [
            web.post("/generate", self.generate),
            web.get("/get_model_info", self.model_info),
            web.get("/model_info", self.model_info),
            web.get("/health_generate", self.health_generate),
            web.get("/get_server_info", self.server_info),
            web.get("/server_info", self.server_info),
            web.get("/get_load", self.load),
        ]

    async def model_info(self, request):
        _, info = await self.door.replica_info()
        return web.json_response(
            {
                "model_path": info.model if info is not None else None,
                "tokenizer_path": self._tokenizer_path(),
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    async def server_info(self, request):
        """What clients read of SGLang's server info: the model, its context, the draft
        model, and in `internal_states` the generation rate and the mean accepted length
        (sglang.bench_serving prints it)."""
        _, info = await self.door.replica_info()
        metrics = self.router.metrics
        reports = [r.report for r in self.router.replicas.reporting()]
        state = {
            "avg_spec_accept_length": metrics.accept_length() if metrics is not None else None,
            "last_gen_throughput": sum(r.tokens_per_s for r in reports),
        }
        return web.json_response(
            {
                "model_path": info.model if info is not None else None,
                "served_model_name": self.door.model,
                "tokenizer_path": self._tokenizer_path(),
                "context_length": info.max_context if info is not None else None,
                "speculative_draft_model_path": (info.drafter or None) if info else None,
                "internal_states": [state],
                "version": "specd",
            }
        )

    async def load(self, request):
        """SGLang's per-rank load, as its Model Gateway polls it to balance (its load is
        `num_tokens`): one entry per replica reporting, from its last load report."""
        reporting = self.router.replicas.reporting()
        return web.json_response(
            [
                {
                    "dp_rank": rank,
                    "num_reqs": r.report.running + r.report.waiting,
                    "num_waiting_reqs": r.report.waiting,
                    "num_tokens": r.report.kv_blocks_used * r.report.kv_block_size,
                }
                for rank, r in enumerate(reporting)
            ]
        )

    def _tokenizer_path(self) -> str:
        """Where the router read its tokenizer (a gateway in front loads it from there)."""
        return getattr(self.router.tokenizer, "name_or_path", "") or self.door.model

    async def health_generate(self, request):
        """A one-token generation through a replica: 200 once it ran, else 503."""
        one = SglangSampling(max_new_tokens=1).completion_body([0], None, "", "")
        grpc_request = to_request(one)
        try:
            prep = self.router.prepare(grpc_request, {}, 20.0)
            await self.router.generate(prep)
        except (RequestError, grpc.aio.AioRpcError) as exc:
            return error_response(503, f"no generation: {exc}")
        return web.Response(status=200)

    async def generate(self, request):
        try:
            body = parse(await request.read(), GenerateBody)
            headers = {k.lower(): v for k, v in request.headers.items()}
            prompts = body.prompts(lambda text: self.router.tokenizer(text)["input_ids"])
            decode = self.router.tokenizer.decode
            jobs = [
                (ids, p)
                for ids, p in zip(prompts, body.sampling(len(prompts)), strict=True)
                for _ in range(p.n)
            ]
            if len(jobs) > MAX_PROMPTS:
                raise BodyError(f"at most {MAX_PROMPTS} prompts x n in one request", "text")
            if body.stream and len(jobs) > 1:
                raise BodyError("a stream answers one prompt", "stream")
            preps, answers = [], []
            for (ids, p), rid in zip(jobs, body.ids(len(jobs)), strict=True):
                start = body.prompt_logprobs_from(len(ids))
                completion = p.completion_body(
                    ids,
                    body.top,
                    body.route,
                    body.speculation,
                    prompt_logprobs=start is not None and start < len(ids),
                    cache_salt=salt(body.extra_key, body.cache_salt),
                )
                grpc_request = to_request(
                    completion, headers.get("x-speculation", ""), self.door.sampling
                )
                preps.append(self.router.prepare(grpc_request, headers, request_timeout(headers)))
                answers.append(SglangAnswer(rid, ids, start, p.max_new_tokens == 0, body, decode))
        except BodyError as exc:
            return error_response(400, str(exc), exc.param)
        except RequestError as exc:
            return request_error_response(exc)
        if body.stream:
            return await self._stream(request, preps[0], answers[0])
        try:
            await side_by_side([self._whole(p, a) for p, a in zip(preps, answers, strict=True)])
        except RequestError as exc:
            return request_error_response(exc)
        results = [a.result() for a in answers]
        return web.json_response(results if body.batch() or len(results) > 1 else results[0])

    async def _whole(self, prep: Prepared, answer: SglangAnswer) -> None:
        async with contextlib.aclosing(self.router.stream(prep)) as messages:
            async for msg in messages:
                answer.feed(msg)

    async def _stream(self, request, prep: Prepared, answer: SglangAnswer):
        async with contextlib.aclosing(self.router.stream(prep)) as messages:
            response, msg = await sse.opened(request, messages)
            if msg is None:
                return response
            try:
                while True:
                    answer.feed(msg)
                    await sse.send(response, answer.result())
                    if msg.finish_reason:
                        break
                    msg = await anext(messages)
            except RequestError as exc:  # mid-stream: the status is sent, so an error event
                await sse.send(response, error_event(exc))
            except ConnectionError:  # the client left: closing `messages` frees the request
                return response
            await response.write(END)
            await response.write_eof()
            return response


class SglangAnswer:
    """One generation's answer in SGLang's shape, built message by message."""

    def __init__(
        self,
        rid: str | None,
        prompt: list[int],
        prompt_from: int | None,
        prompt_only: bool,
        body: GenerateBody,
        decode,
    ):
        """`prompt_from`: the prompt position its log-probabilities start at (None:
        none); `prompt_only`: `max_new_tokens: 0`, the one token made is left out."""
        self.rid = rid or uuid.uuid4().hex
        self.prompt, self.prompt_from, self.prompt_only = prompt, prompt_from, prompt_only
        self.top = body.top
        self.prompt_ids = body.return_prompt_token_ids
        self.decode = decode if body.return_text_in_logprobs else None
        self.started = time.perf_counter()
        self.text, self.ids = "", []
        self.chosen, self.tops = [], []  # [logprob, id, text] per token, and its top ones
        self.prompt_chosen, self.prompt_tops = [], []  # the same for the prompt's tokens
        self.final = None  # the last message

    def feed(self, msg) -> None:
        """One message: its text, ids and log-probabilities, each put in SGLang's shape
        once (a stream's events then resend them as they are)."""
        if msg.prompt_logprobs and self.prompt_from is not None:
            self._prompt_logprobs(msg.prompt_logprobs)
        if not self.prompt_only:
            self.text += msg.text
            self.ids += msg.token_ids
            for token, entry in zip(msg.token_ids, msg.logprobs, strict=False):
                self.chosen.append([entry.logprob, token, self._text(token)])
                self.tops.append(self._top(entry))
        if msg.finish_reason:
            self.final = msg

    def _prompt_logprobs(self, entries) -> None:
        """SGLang's input log-probabilities: one per prompt token from `prompt_from`, the
        first without one (as SGLang reads no row before it); `entries`: one per prompt
        token after the first."""
        start = self.prompt_from
        for pos in range(start, len(self.prompt)):
            token = self.prompt[pos]
            entry = entries[pos - 1] if pos > start else None
            logprob = entry.logprob if entry is not None else None
            self.prompt_chosen.append([logprob, token, self._text(token)])
            self.prompt_tops.append(self._top(entry) if entry is not None else None)

    def result(self) -> dict:
        """{text, output_ids, meta_info} so far (finish_reason null until the end)."""
        meta = {
            "id": self.rid,
            "finish_reason": self._finish(),
            "prompt_tokens": len(self.prompt),
            "completion_tokens": len(self.ids),
            "cached_tokens": self.final.usage.cached_prompt_tokens if self.final else 0,
            "weight_version": "default",
        }
        if self.final is not None:
            meta["e2e_latency"] = time.perf_counter() - self.started
            spec = self.final.speculation
            if spec.rounds and not self.prompt_only:  # SGLang's, per drafting round
                meta |= {
                    "spec_verify_ct": spec.rounds,
                    "spec_proposed_drafts": spec.drafted,
                    "spec_accepted_drafts": spec.accepted,
                    "spec_accept_rate": spec.accepted / spec.drafted if spec.drafted else 0.0,
                    "spec_accept_length": 1 + spec.accepted / spec.rounds,
                }
        if self.top is not None:
            meta["input_token_logprobs"] = self.prompt_chosen
            meta["input_top_logprobs"] = self.prompt_tops if self.top else []
            meta["output_token_logprobs"] = self.chosen
            if self.top:
                meta["output_top_logprobs"] = self.tops
        out = {"text": self.text, "output_ids": list(self.ids), "meta_info": meta}
        if self.prompt_ids:
            out["prompt_token_ids"] = list(self.prompt)
        return out

    def _top(self, entry) -> list:
        tops = zip(entry.top_ids, entry.top_logprobs, strict=True)
        return [[lp, t, self._text(t)] for t, lp in tops]

    def _text(self, token: int) -> str | None:
        return self.decode([token]) if self.decode is not None else None

    def _finish(self) -> dict | None:
        msg = self.final
        if msg is None:
            return None
        if self.prompt_only and msg.finish_reason in ("length", "stop"):
            return {"type": "length", "length": 0}
        if msg.finish_reason == "length":
            return {"type": "length", "length": len(self.ids)}
        if msg.finish_reason == "stop":
            which = msg.WhichOneof("stop_reason")
            matched = getattr(msg, which) if which else (self.ids[-1] if self.ids else None)
            return {"type": "stop", "matched": matched}
        return {"type": "abort", "message": msg.finish_reason}
