"""The tokenizer's endpoints on the HTTP door, as vLLM serves them (llama-server's bodies
for /tokenize and /detokenize are alike and answered too):

    POST /tokenize          a prompt's ids, or a chat's as the chat endpoint renders it
    POST /detokenize        ids to text, special tokens shown
    GET  /tokenizer_info    the tokenizer's settings and chat template (lm-evaluation-
                            harness tokenizes through these three when a server has it)

/tokenize and /detokenize are open, as vLLM's are; /tokenizer_info names the chat template
and the special tokens, so the door's bearer token guards it as llama-server's /props."""

from __future__ import annotations

from aiohttp import web

from router import openai_schema as schema
from router.body import BodyError, has_field, parse
from router.openai_errors import error_response, request_error_response
from router.prepare import RequestError

GUARDED_PATHS = ("/tokenizer_info",)
# settings that name files on the router's disk, not the tokenizer
_PATHS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


class TokenizerRoutes:
    def __init__(self, door):
        """`door`: the HTTP door (router.openai_http.OpenAIDoor) whose router tokenizes."""
        self.door = door
        self.tokenizer = door.router.tokenizer

    def routes(self) -> list:
        return [
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/tokenizer_info", self.tokenizer_info),
        ]

    async def tokenize(self, request):
        """A prompt's ids, or a chat's as the template renders it (llama-server's body,
        with `content`, is answered in its shape)."""
        raw = await request.read()
        if has_field(raw, "content"):
            return await self.door.llama.tokenize(raw)
        try:
            body = parse(raw, schema.TokenizeBody)
            if (refused := self.door.unknown(body.model)) is not None:
                return refused
            if body.prompt is not None:
                tokenized = self.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)
                ids = list(tokenized["input_ids"])
            else:
                ids = self.door.chat_ids(body)
        except BodyError as exc:
            return error_response(400, str(exc), exc.param)
        except RequestError as exc:
            return request_error_response(exc)
        _, info = await self.door.replica_info()
        length = info.max_context if info is not None else None
        return web.json_response({"count": len(ids), "max_model_len": length, "tokens": ids})

    async def detokenize(self, request):
        """Ids to text, special tokens shown; the text is both vLLM's `prompt` and
        llama-server's `content` (their bodies are alike)."""
        try:
            body = parse(await request.read(), schema.DetokenizeBody)
        except BodyError as exc:
            return error_response(400, str(exc), exc.param)
        if (refused := self.door.unknown(body.model)) is not None:
            return refused
        vocab = len(self.tokenizer)
        if any(t >= vocab for t in body.tokens):
            return error_response(400, f"tokens must be ids in [0, {vocab})", "tokens")
        text = self.tokenizer.decode(body.tokens)
        return web.json_response({"prompt": text, "content": text})

    async def tokenizer_info(self, request):
        return web.json_response(tokenizer_info(self.tokenizer))


def tokenizer_info(tokenizer) -> dict:
    """vLLM's answer: the settings the tokenizer was made with (transformers'
    `init_kwargs`, which the router's own tokenizer keeps too), special tokens as their
    text, less the paths of its files; its class, and its chat template."""
    info = {k: _as_json(v) for k, v in tokenizer.init_kwargs.items() if k not in _PATHS}
    info["tokenizer_class"] = info.get("tokenizer_class") or type(tokenizer).__name__
    info["chat_template"] = getattr(tokenizer, "chat_template", None)
    return info


def _as_json(value):
    """An AddedToken (transformers' or tokenizers') or a config's dict of one as its text;
    whatever JSON has no type for (a path) as text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return (
            value["content"] if "content" in value else {k: _as_json(v) for k, v in value.items()}
        )
    if isinstance(value, list | tuple):
        return [_as_json(v) for v in value]
    return value if value is None or isinstance(value, str | int | float | bool) else str(value)
