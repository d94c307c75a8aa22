"""Shadow probes: the adaptive policy's way to re-measure the speculative server's acceptance on
today's traffic while everything goes to the baseline, at a small, bounded cost.

A probe is a copy of a client's chat, completion or Responses API request, capped to a few output tokens,
streamed, and sent to the idle speculative server; the client's own request goes where the mode
says, untouched, and never sees the copy. Its acceptance comes from its own stream where the
engine sends one content event per decode step (adapter.Engine.stream_steps): tokens over events,
at once, instead of waiting for a gauge that SGLang refreshes every 40 decode steps. Elsewhere the
copy still moves the engine's acceptance counters, which the health poll reads.

Why a copy and not the request itself (SPECGATE_ADAPTIVE_PROBE_MODE=request): on a GPU shared
with the baseline, every speculative step of a probe takes the GPU from the baseline's whole
batch. A whole response (128 tokens, say) costs the batch about 8 times what a 16-token copy does;
the copy costs its prompt's prefill too, which a request probe pays as well.

At most one copy runs at a time; it holds a lease on the speculative server like any request, is
bounded by the read timeout, and is cancelled when the app stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

import orjson

from ..kinds import GENERATIONS
from ..policy.base import Role
from ..policy.evidence import MIN_STREAM_EVENTS
from ..transport.forwarding import renamed
from ..transport.upstream import UpstreamError
from .sse import ResponseEvents, completion_tokens, content_events, response_deltas

if TYPE_CHECKING:
    from ..edge.call import ProxyCall
    from ..observability.metrics import Metrics
    from ..routing.router import Router
    from ..transport.upstream import Upstream

log = logging.getLogger("specgate.probe")

# A capped stream is a few KB; anything much larger is not what was asked for.
BODY_LIMIT = 256 * 1024
# What a copy keeps of its request: what the prompt is and how one sequence is sampled from it.
# Everything else is left out, so that a copy never asks more of the server than its client did:
# no logprobs of any kind, no beam search or n, no tools or grammar to compile, no other limits.
_KEPT = frozenset(
    (
        "model", "messages", "prompt", "suffix",
        "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos",
        "skip_special_tokens", "spaces_between_special_tokens", "add_special_tokens",
        "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
        "reasoning_effort", "lora_path",
    )
)  # fmt: skip
# The same for a Responses API request: its input and sampling. `previous_response_id` and
# `conversation` are left out by not being copied at all: such a request is not copied (below).
_KEPT_RESPONSES = frozenset(
    (
        "model", "input", "instructions",
        "temperature", "top_p", "top_k", "min_p", "seed", "stop",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "reasoning",
    )
)  # fmt: skip
# A copy shorter than this cannot show enough decode steps to read acceptance from (MIN_STREAM_EVENTS).
MIN_SHADOW_TOKENS = 2 * MIN_STREAM_EVENTS


def shadow_body(body: bytes, max_tokens: int, typed: bool = False) -> bytes | None:
    """The copy to send: the request's prompt (the first, of a list of prompts) and sampling, streamed
    with usage, capped to `max_tokens` output tokens and to the client's own limit; None for a body
    that is not a JSON object, that cannot be written back, or whose limit is too short to measure.
    `typed`: a Responses API request, whose copy is never stored by the server, and which is not
    copied when it continues a stored conversation (that lives on one server, and not the copy's)."""
    try:
        payload: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(payload, dict):
        return None
    fields = ("max_output_tokens",) if typed else ("max_tokens", "max_completion_tokens")
    limits = [v for k in fields if (v := _count(payload.get(k))) is not None]
    tokens = min([max_tokens, *limits])
    if tokens < MIN_SHADOW_TOKENS:
        return None
    if typed:
        if payload.get("previous_response_id") is not None or payload.get("conversation") is not None:
            return None
        copy = {k: v for k, v in payload.items() if k in _KEPT_RESPONSES}
        copy.update(max_output_tokens=tokens, stream=True, store=False)
    else:
        copy = {k: v for k, v in payload.items() if k in _KEPT}
        prompt = copy.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            copy["prompt"] = prompt[0]  # a batch of prompts (strings, or token lists): one
        copy["max_tokens"] = tokens
        copy["stream"] = True
        copy["stream_options"] = {"include_usage": True}
    try:
        return orjson.dumps(copy)
    except orjson.JSONEncodeError:  # nested past orjson's depth: no copy, rather than an error
        return None


def _output_tokens(data: bytes) -> int | None:
    """A Responses stream's output tokens (its `response.completed` event's usage)."""
    events = ResponseEvents()
    events.feed(data)
    events.flush()
    found = events.usage()
    return found[1] if found is not None else None


def _count(v: object) -> int | None:
    """A client's token limit, when it set a sane one (anything else is the server's to refuse)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


class Prober:
    """Sends shadow probes; the Router learns what they measured (Router.note_shadow)."""

    def __init__(self, upstream: Upstream, metrics: Metrics, max_tokens: int) -> None:
        self._upstream = upstream
        self._metrics = metrics
        self._max_tokens = max_tokens
        # One copy at a time, whichever group it probes: they are rare, and this bounds them.
        self._task: asyncio.Task[None] | None = None
        # A probe that failed for a reason of specgate's own (a bug): logged once, until one works.
        self._failing = False

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self, call: ProxyCall, router: Router) -> bool:
        """Send a copy of `call` to the group's speculative server unless a copy is under way or it
        cannot be copied; True if sent."""
        if self.busy or call.endpoint not in GENERATIONS or not router.wants_shadow_of(call.client):
            return False
        body = shadow_body(call.body, self._max_tokens, call.endpoint == "responses")
        if body is None:
            return False
        self._task = asyncio.get_running_loop().create_task(self._run(call, body, router), name="specgate-probe")
        return True

    async def _run(self, call: ProxyCall, body: bytes, router: Router) -> None:
        typed = call.endpoint == "responses"
        lease = router.admit(Role.SPECULATIVE, tokens=call.prompt_tokens)
        outcome = "error"
        resp = None
        span = None
        try:
            headers = renamed(call.headers, call.request_id, call.request_id + "-probe")
            if call.trace is not None:
                headers, span = call.trace.shadow(headers, lease.server)
            resp = await self._upstream.send(lease.server, call.target, body, headers)
            parts: list[bytes] = []
            size = 0
            while chunk := await resp.read_chunk():
                size += len(chunk)
                if size > BODY_LIMIT:
                    raise UpstreamError("protocol", "a shadow probe's body grew past its limit", retryable=False)
                parts.append(chunk)
            data = b"".join(parts)
            tokens = (_output_tokens(data) if typed else completion_tokens(data)) if resp.status == 200 else None
            if tokens is not None:
                resp.release()
                router.note_shadow(tokens, response_deltas(data) if typed else content_events(data), call.client)
                outcome = "ok"
                if self._failing:
                    self._failing = False
                    log.info("shadow probes work again")
            else:
                outcome = "no_usage" if resp.status == 200 else "error"
        except UpstreamError as err:
            log.debug("shadow probe %s failed: %s", call.request_id, err)
        except Exception:
            # Never a task that dies unseen: said once, with its traceback, until a probe works.
            if not self._failing:
                self._failing = True
                log.exception("shadow probe %s failed; probes go on (said once until one works)", call.request_id)
        finally:
            if resp is not None:
                resp.close()  # nothing to do once released
            lease.release()
            self._metrics.shadow_probes.labels(outcome).inc()
            if span is not None and call.trace is not None:
                call.trace.shadow_end(span, outcome, resp.status if resp is not None else None)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
