"""llama-server's native endpoints on the HTTP door, for the clients written against it
(llama.vscode and other IDE plugins send /infill):

    POST /completion (and /completions)  a prompt (text, ids, or both mixed) in
    POST /infill                         prefix, suffix and extra files in (FIM)
    GET  /props                          what the server runs, in llama-server's shape
    POST /apply-template                 a chat rendered by the template, as text
    POST /tokenize with `content`        llama-server's body (the door's /tokenize hands
                                         it over; vLLM's body has `prompt` or `messages`)

Bodies and defaults are router/llamacpp_schema.py's, answers router/llamacpp_answer.py's.
The door's bearer token guards them, as llama-server's --api-key does."""

from __future__ import annotations

import contextlib

from aiohttp import web

from router import sse
from router.body import BodyError, parse
from router.fim import infill_ids, repo_markers_of
from router.generation import side_by_side
from router.llamacpp_answer import LlamaAnswer
from router.llamacpp_schema import BATCH, InfillBody, LlamaCompletionBody, LlamaTokenizeBody
from router.openai_errors import error_event, error_response, request_error_response
from router.openai_request import request_timeout, to_request
from router.openai_schema import ChatBody
from router.prepare import Prepared, RequestError

PATHS = ("/completion", "/completions", "/infill", "/props", "/apply-template")


class LlamaCppRoutes:
    def __init__(self, door):
        """`door`: the HTTP door (router.openai_http.OpenAIDoor) whose router serves them."""
        self.door = door
        self.router = door.router
        self.repo = repo_markers_of(self.router.tokenizer)

    def routes(self) -> list:
        return [
            web.post("/completion", self.completion),
            web.post("/completions", self.completion),
            web.post("/infill", self.infill),
            web.get("/props", self.props),
            web.post("/apply-template", self.apply_template),
        ]

    async def completion(self, request):
        return await self._serve(request, LlamaCompletionBody)

    async def infill(self, request):
        if self.door.fim is None:
            return error_response(501, "infill: this model has no fill-in-the-middle tokens")
        return await self._serve(request, InfillBody)

    async def props(self, request):
        _, info = await self.door.replica_info()
        context = info.max_context if info is not None else None
        template = getattr(self.router.tokenizer, "chat_template", None) or ""
        settings = LlamaCompletionBody()
        return web.json_response(
            {
                "default_generation_settings": {
                    "n_ctx": context,
                    "params": {**settings.sampler_order(), "n_predict": settings.n_predict},
                },
                "total_slots": self.door.slots.total(),
                "model_alias": self.door.model,
                "model_path": info.model if info is not None else None,
                "chat_template": template,
                "build_info": "specd",
                "infill": self.door.fim is not None,
            }
        )

    async def tokenize(self, raw: bytes):
        """llama-server's /tokenize: `content` (text, ids, or both mixed) -> `tokens`, ids
        or, `with_pieces`, {id, piece} (a piece its own decoding, as the OpenAI door's
        log-probabilities show it)."""
        try:
            body = parse(raw, LlamaTokenizeBody)
        except BodyError as exc:
            return error_response(400, str(exc), exc.param)
        parts = body.content if isinstance(body.content, list) else [body.content]
        ids = self._mixed_ids(parts, body.add_special, split_special=not body.parse_special)
        if not body.with_pieces:
            return web.json_response({"tokens": ids})
        decode = self.router.tokenizer.decode
        return web.json_response({"tokens": [{"id": i, "piece": decode([i])} for i in ids]})

    async def apply_template(self, request):
        """llama-server's /apply-template: the chat body's prompt as the template renders
        it, as text (its ids decoded, special tokens shown)."""
        try:
            ids = self.door.chat_ids(parse(await request.read(), ChatBody))
        except BodyError as exc:
            return error_response(400, str(exc), exc.param)
        except RequestError as exc:
            return request_error_response(exc)
        return web.json_response({"prompt": self.router.tokenizer.decode(ids)})

    # -- serving -------------------------------------------------------------------------------
    async def _serve(self, request: web.Request, kind):
        try:
            body = parse(await request.read(), kind)
            headers = {k.lower(): v for k, v in request.headers.items()}
            prompts = await self._prompts(body)
            if body.stream and len(prompts) > 1:
                raise BodyError("a stream answers one prompt", "prompt")
            bias = self._bias(body)
            preps = []
            for ids in prompts:
                grpc = to_request(
                    body.completion_body(ids, bias, self.door.overrides, self.door.sampling.seed),
                    headers.get("x-speculation", ""),
                )
                preps.append(self.router.prepare(grpc, headers, request_timeout(headers)))
        except BodyError as exc:
            return error_response(400, str(exc), exc.param)
        except RequestError as exc:
            return request_error_response(exc)
        answers = [self._answer(body, p) for p in preps]
        if body.stream:
            return await self._stream(request, preps[0], answers[0])
        try:
            wholes = [self._whole(p, a) for p, a in zip(preps, answers, strict=True)]
            results = await side_by_side(wholes)
        except RequestError as exc:
            return request_error_response(exc)
        return web.json_response(results[0] if len(results) == 1 else results)

    async def _prompts(self, body) -> list[list[int]]:
        tokenizer = self.router.tokenizer
        if isinstance(body, InfillBody):
            room = await self.door.context() - BATCH - 2 * max(body.n_predict, 0)
            extra = [(c.filename, c.text) for c in body.input_extra]
            ids = infill_ids(
                tokenizer, self.door.fim, self.repo, body.input_prefix, body.input_suffix,
                extra, body.prompt, room, BATCH,
            )  # fmt: skip
            return [ids]
        out = []
        for prompt in body.prompts():
            parts = prompt if isinstance(prompt, list) else [prompt]
            out.append(self._mixed_ids(parts, add_special=True))
        return out

    def _mixed_ids(self, parts: list, add_special: bool, split_special: bool = False) -> list[int]:
        """Texts and ids in order, as llama.cpp reads a mixed prompt: a leading text gets
        the model's BOS where `add_special` and the model has one; `split_special`: a
        special token's text in a text stays text."""
        ids: list[int] = []
        for i, part in enumerate(parts):
            if isinstance(part, str):
                special = add_special and i == 0
                tokenized = self.router.tokenizer(
                    part, add_special_tokens=special, split_special_tokens=split_special
                )
                ids += tokenized["input_ids"]
            else:
                ids.append(part)
        return ids

    def _bias(self, body) -> dict[int, float]:
        """`logit_bias` by token id: a text's bias on each of its tokens."""
        out: dict[int, float] = {}
        for token, bias in body.bias_items():
            ids = [token] if isinstance(token, int) else self._text_ids(token)
            for t in ids:
                out[t] = bias
        return out

    def _text_ids(self, text: str) -> list[int]:
        return self.router.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _answer(self, body, prep: Prepared) -> LlamaAnswer:
        decode = self.router.tokenizer.decode
        return LlamaAnswer(
            body, self.door.model, decode(prep.prompt_ids), len(prep.prompt_ids), decode
        )

    async def _whole(self, prep: Prepared, answer: LlamaAnswer) -> dict:
        last = None
        async with contextlib.aclosing(self.router.stream(prep)) as messages:
            async for msg in messages:
                answer.feed(msg)
                last = msg
                if answer.done:  # a stop rule: closing the stream cancels the request
                    return answer.final(None, streamed=False)
        return answer.final(last, streamed=False)

    async def _stream(self, request, prep: Prepared, answer: LlamaAnswer):
        async with contextlib.aclosing(self.router.stream(prep)) as messages:
            response, msg = await sse.opened(request, messages)
            if msg is None:
                return response
            last = None
            try:
                while True:
                    event = answer.feed(msg)
                    if event is not None:
                        await sse.send(response, event)
                    if answer.done:
                        break
                    last = msg
                    if msg.finish_reason:
                        break
                    msg = await anext(messages)
                await sse.send(response, answer.final(None if answer.done else last, streamed=True))
            except RequestError as exc:  # mid-stream: the status is sent, so an error event
                await sse.send(response, error_event(exc))
            except ConnectionError:  # the client left: closing `messages` frees the request
                return response
            await response.write_eof()
            return response
