"""llama-server's `GET /slots` on the HTTP door, for the balancers and dashboards written
against it (they count idle and processing slots): one slot per sequence each healthy
verifier replica runs at once (its batch limit), numbered across the replicas in the
order of their addresses, in llama-server's shape with its metrics only (as it answers
without `--slots-debug`: no prompt or generated text).

    GET  /slots                      every slot; `?fail_on_no_slot=1`: 503 when none is idle
    POST /slots/{id}?action=...      501: specd saves and restores no slot's KV to files
                                     (llama-server's without --slot-save-path)

A slot processing one of this router's requests shows its task: its prompt's tokens, the
tokens decoded and left, its sampling parameters. A replica's sequences that another
router sent show as processing, without a task. `specd up --no-slots` turns the endpoint
off, as llama-server's does. The door's bearer token guards it, as llama-server's
--api-key does."""

from __future__ import annotations

from aiohttp import web

from router.openai_errors import error_response
from router.replicas import Serving

RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a request that named none


class SlotsRoutes:
    def __init__(self, door, enabled: bool = True):
        """`door`: the HTTP door (router.openai_http.OpenAIDoor) whose router's replicas
        the slots are; `enabled`: False answers 501, as llama-server's `--no-slots`."""
        self.door = door
        self.router = door.router
        self.enabled = enabled

    def routes(self) -> list:
        return [web.get("/slots", self.slots), web.post("/slots/{id_slot}", self.action)]

    async def slots(self, request):
        if not self.enabled:
            message = "This server does not support slots endpoint. Start it with `--slots`"
            return error_response(501, message)
        context = await self.door.context()
        slots: list[dict] = []
        for replica in self._healthy():
            report, own = replica.report, sorted(replica.serving.values(), key=lambda s: s.task)
            busy = max(report.running, len(own))
            for i in range(_size(replica)):
                slot = {
                    "id": len(slots),
                    "n_ctx": context,
                    "speculative": report.drafter_available,
                    "is_processing": i < busy,
                }
                slots.append(slot | (_task(own[i]) if i < len(own) else {}))
        if request.query.get("fail_on_no_slot") and all(s["is_processing"] for s in slots):
            return error_response(503, "no slot available")
        return web.json_response(slots)

    def total(self) -> int:
        """The slots of every healthy replica (/props' `total_slots`)."""
        return sum(_size(replica) for replica in self._healthy())

    def _healthy(self) -> list:
        replicas = self.router.replicas.replicas
        return [replicas[a] for a in sorted(replicas) if replicas[a].healthy]

    async def action(self, request):
        message = "This server does not support slots action. Start it with `--slot-save-path`"
        return error_response(501, message)


def _size(replica) -> int:
    """A replica's slots: its batch limit, or as many as run there if more do."""
    report = replica.report
    return max(report.max_batch_size, report.running, len(replica.serving))


def _task(serving: Serving) -> dict:
    """What llama-server's slot shows of its task, metrics only."""
    params = serving.params
    # the prompt's tokens not found cached are processed once the first token came
    processed = serving.prompt_tokens - serving.cached if serving.decoded else 0
    return {
        "id_task": serving.task,
        "n_prompt_tokens": serving.prompt_tokens,
        "n_prompt_tokens_processed": processed,
        "n_prompt_tokens_cache": serving.cached,
        "params": {
            "max_tokens": serving.max_new_tokens,
            "n_predict": serving.max_new_tokens,
            "seed": params.seed if params.seed is not None else RANDOM_SEED,
            "temperature": params.temperature,
            "top_k": params.top_k,
            "top_p": params.top_p,
            "min_p": params.min_p,
            "repeat_penalty": params.repetition_penalty,
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty,
        },
        "next_token": [
            {
                "has_next_token": True,
                "has_new_line": serving.new_line,
                "n_remain": serving.max_new_tokens - serving.decoded,
                "n_decoded": serving.decoded,
            }
        ],
    }
