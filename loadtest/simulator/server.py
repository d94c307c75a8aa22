"""One simulated SGLang server: its HTTP surface on top of an `Engine`.

aiohttp serves it because the simulator must never be what limits a measurement: its writes go
straight to the transport, and `handler_cancellation` cancels a handler the moment its client
disconnects, which is how a client going away aborts the generation here as in SGLang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..prompts import repetitiveness
from .engine import Engine
from .metrics import build_registry
from .profile import Profile, Role
from .radix import PrefixCache
from .responses import NotFound, ResponsesStream, ResponseStore, chat_of, response_id
from .responses import full_response as responses_body
from .speed import CurveSpeed, Speed, TableSpeed
from .state import Sequence, SharedGpu
from .steptimes import H200_GPU_GIB, AdaptiveSteps, StepTimes
from .wire import (
    GenRequest,
    Kind,
    RequestError,
    StreamFormatter,
    check_context,
    error_body,
    fit_pool,
    full_response,
    parse_request,
    token_text,
)

log = logging.getLogger("loadtest.simulator")

# Paths SGLang serves without checking --api-key.
_OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
_MAX_BODY_BYTES = 64 * 1024 * 1024


# A step-time profile's default acceptance (at --spec-steps draft steps): EAGLE-3 with three chain
# steps on chat traffic; the table's own crossovers are given at 1.5, 2.0 and 2.5.
TABLE_ACCEPT_LENGTH = 2.5


@dataclass(frozen=True)
class ServerConfig:
    role: Role
    # A throughput curve (CSV), or a measured step-time table (the H200 profiles).
    profile: Profile | StepTimes
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str = "default"
    # What /get_server_info reports as model_path (SGLang's --model-path); the served name if unset.
    model_path: str | None = None
    api_key: str | None = None
    time_scale: float = 1.0
    max_running_requests: int = 256
    warmup_s: float = 0.0
    load_s: float = 0.0
    # Every request's acceptance length (speculative role); None: the profile's.
    accept_length: float | None = None
    # Derive each request's acceptance from how repetitive its prompt is, up to max_accept_length
    # (None: the profile's).
    accept_from_prompt: bool = False
    max_accept_length: float | None = None
    fail_rate: float = 0.0
    stall_rate: float = 0.0
    ttft_base_ms: float = 20.0
    prefill_tok_s: float = 50_000.0
    default_max_tokens: int = 256
    max_model_len: int = 131_072
    # The KV pool in tokens (SGLang's --max-total-tokens); None: a step-time profile's memory
    # arithmetic on a GPU of gpu_memory_gb (split as the compose file splits it when shared_gpu),
    # else CSV_KV_CAPACITY_TOKENS.
    max_total_tokens: int | None = None
    gpu_memory_gb: float = H200_GPU_GIB
    shared_gpu: bool = False
    # Draft steps of the speculative role (and the depth --accept-length is given at).
    spec_steps: int = 3
    chunked_prefill_size: int = 8192
    # SGLang's --enable-cache-report: usage.prompt_tokens_details.cached_tokens in responses.
    enable_cache_report: bool = False
    disable_radix_cache: bool = False
    metrics_prefix: str = "sglang:"
    live_gauges: bool = False
    # How long /health takes while requests are running (real time: a probe's timeout is real too).
    busy_health_s: float = 0.0
    metrics: bool = True
    created: int | None = None
    seed: int | None = None

    @property
    def step_accept_length(self) -> float:
        """The acceptance at which a decode step takes the time a CSV profile gives."""
        if self.role == "baseline" or isinstance(self.profile, StepTimes):
            return 1.0
        return self.profile.speculative_accept_length

    @property
    def default_accept_length(self) -> float:
        if self.role == "baseline":
            return 1.0
        if self.accept_length:
            return self.accept_length
        if isinstance(self.profile, StepTimes):
            return min(TABLE_ACCEPT_LENGTH, self.spec_steps + 1.0)
        return self.profile.speculative_accept_length

    @property
    def max_accept(self) -> float:
        if self.max_accept_length:
            return self.max_accept_length
        if isinstance(self.profile, StepTimes):
            return self.spec_steps + 1.0  # every draft accepted, and the bonus token
        return self.profile.speculative_max_accept_length

    @property
    def kv_capacity_tokens(self) -> int:
        if self.max_total_tokens is not None:
            return self.max_total_tokens
        if isinstance(self.profile, StepTimes):
            return self.profile.pool_tokens(self.gpu_memory_gb, self.role, self.shared_gpu)
        return CSV_KV_CAPACITY_TOKENS

    def accept_for(self, prompt_text: str) -> float | None:
        """A request's acceptance length; None: the default. With accept_from_prompt,
        1 + (max - 1) * r, r the prompt's `repetitiveness`."""
        if self.role == "baseline" or not self.accept_from_prompt:
            return None
        return 1.0 + (self.max_accept - 1.0) * repetitiveness(prompt_text)

    def speed(self) -> Speed:
        scale = self.time_scale
        profile, role = self.profile, self.role
        if isinstance(profile, StepTimes):
            adaptive = AdaptiveSteps() if role == "adaptive" else None
            return TableSpeed(profile, role, self.spec_steps, scale, adaptive)
        curve_role: Role = "baseline" if role == "baseline" else "speculative"
        return CurveSpeed(
            lambda c: profile.throughput(curve_role, c) * scale,
            self.step_accept_length,
            self.ttft_base_ms / 1000 / scale,
            self.prefill_tok_s * scale,
        )


# The KV pool of a server on a CSV profile, which gives no memory figures: room for any test.
CSV_KV_CAPACITY_TOKENS = 2_000_000
# Tokens a page of the prefix cache holds (SGLang's radix cache with --page-size 16).
PAGE_TOKENS = 16


class SimServer:
    def __init__(self, config: ServerConfig, gpu: SharedGpu | None = None) -> None:
        self.config = config
        self.engine = Engine(
            speed=config.speed(),
            accept_length=config.default_accept_length,
            max_running=config.max_running_requests,
            kv_capacity_tokens=config.kv_capacity_tokens,
            speculative=config.role != "baseline",
            cache=None if config.disable_radix_cache else PrefixCache(PAGE_TOKENS),
            chunk_tokens=config.chunked_prefill_size,
            gpu=gpu,
            live_gauges=config.live_gauges,
        )
        self.registry = build_registry(self.engine, config.served_model_name, config.metrics_prefix)
        self._rng = random.Random(config.seed)
        self._ready_at = 0.0
        self._runner: web.AppRunner | None = None
        self._created_at = int(time.time())
        self.responses = ResponseStore()

    # ----- lifecycle -----
    def app(self) -> web.Application:
        app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[self._auth])
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/get_load", self.get_load)
        if self.config.metrics:
            app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/chat/completions", self._generation("chat"))
        app.router.add_post("/v1/completions", self._generation("completion"))
        app.router.add_post("/v1/responses", self._generation("responses"))
        app.router.add_post("/generate", self._generation("generate"))
        return app

    async def start(self) -> None:
        cfg = self.config
        if cfg.load_s > 0:
            # Loading weights: nothing listens yet, connections are refused.
            await asyncio.sleep(cfg.load_s / cfg.time_scale)
        self.engine.start()
        self._ready_at = time.monotonic() + cfg.warmup_s / cfg.time_scale
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.host, cfg.port, backlog=4096, reuse_address=True)
        await site.start()
        if cfg.role == "baseline":
            accept = "no speculation"
        elif isinstance(cfg.profile, StepTimes):
            accept = (
                f"acceptance from prompts, 1 to {cfg.max_accept:g}"
                if cfg.accept_from_prompt
                else f"acceptance {cfg.default_accept_length:g}"
            ) + (f" at {cfg.spec_steps} draft steps" + (", steps adaptive" if cfg.role == "adaptive" else ""))
        elif cfg.accept_from_prompt:
            accept = f"acceptance from prompts, 1 to {cfg.max_accept:g}, profile at {cfg.step_accept_length:g}"
        else:
            accept = f"acceptance {cfg.default_accept_length:g}, profile at {cfg.step_accept_length:g}"
        log.info(
            "simulated SGLang %s on http://%s:%d (profile %s, %s, KV pool %d tokens, time scale %g)",
            cfg.role,
            cfg.host,
            cfg.port,
            cfg.profile.name,
            accept,
            self.engine.kv_capacity,
            cfg.time_scale,
        )

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self.engine.stop()

    # ----- middleware -----
    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.config.api_key
        if key and request.path not in _OPEN_PATHS:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return web.Response(status=401, body=b'{"error":"Unauthorized"}', content_type="application/json")
        return await handler(request)

    # ----- small endpoints -----
    async def health(self, request: web.Request) -> web.Response:
        if time.monotonic() < self._ready_at:
            return web.Response(status=503)
        if self.config.busy_health_s > 0 and self.engine.num_running + self.engine.num_queued > 0:
            await asyncio.sleep(self.config.busy_health_s)
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        name = self.config.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": self._created_at,
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": self.config.max_model_len,
        }
        return _json({"object": "list", "data": [card]})

    async def server_info(self, request: web.Request) -> web.Response:
        cfg = self.config
        state: dict[str, object] = {"last_gen_throughput": self.engine.gauges().gen_throughput}
        if cfg.role != "baseline":
            state["avg_spec_accept_length"] = self.engine.avg_accept_length()
        return _json(
            {
                "model_path": cfg.model_path or cfg.served_model_name,
                "served_model_name": cfg.served_model_name,
                "tp_size": 1,
                "max_running_requests": cfg.max_running_requests,
                "speculative_algorithm": None if cfg.role == "baseline" else "EAGLE3",
                "speculative_num_steps": None if cfg.role == "baseline" else cfg.spec_steps,
                "speculative_adaptive": cfg.role == "adaptive",
                "max_total_num_tokens": self.engine.kv_capacity,
                "chunked_prefill_size": cfg.chunked_prefill_size,
                "disable_radix_cache": cfg.disable_radix_cache,
                "version": "simulated",
                "internal_states": [state],
            }
        )

    async def get_load(self, request: web.Request) -> web.Response:
        e = self.engine
        return _json(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": e.num_running + e.num_queued,
                    "num_waiting_reqs": e.num_queued,
                    "num_tokens": e.kv_tokens(),
                }
            ]
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ----- generation -----
    def _generation(self, kind: Kind) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self.generate(request, kind)

        return handler

    async def generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        cfg = self.config
        try:
            req, convo = await self._parse(request, kind)
            check_context(req, cfg.max_model_len)
            req = fit_pool(req, self.engine.kv_capacity)
        except NotFound as exc:
            return _error(exc.message, 404, "invalid_request_error")
        except RequestError as exc:
            return _error(exc.message, 400, "BadRequestError")
        if cfg.fail_rate and self._rng.random() < cfg.fail_rate:
            return _error("Injected failure (--fail-rate).", 500, "InternalServerError")
        stall_at = None
        if cfg.stall_rate and self._rng.random() < cfg.stall_rate:
            stall_at = self._rng.randrange(0, req.max_new_tokens)
        seq = Sequence(
            rid=req.rid,
            prompt_tokens=req.prompt_tokens,
            max_new_tokens=req.max_new_tokens,
            accept_length=cfg.accept_for(req.prompt_text),
            stall_at=stall_at,
            cache_data=req.cache_data,
        )
        created = cfg.created if cfg.created is not None else int(time.time())
        stored = convo is not None and convo[1]

        def done() -> None:
            # Stored before the client can see the end: its next turn may name this response at once.
            if convo is not None and convo[1]:
                self.responses.save(req.rid, convo[0], token_text(0, seq.generated))

        self.engine.submit(seq)
        try:
            if req.stream:
                return await self._stream(request, req, seq, created, done, stored)
            while not seq.done:
                await seq.wait()
            if not seq.finished:
                return _error("The request was aborted.", 500, "InternalServerError")
            done()
            if req.kind == "responses":
                body = responses_body(req, created, stored, seq.generated, seq.cached_tokens)
            else:
                latency = asyncio.get_running_loop().time() - seq.arrived
                report, verify = cfg.enable_cache_report, self._verify_steps(seq)
                body = full_response(req, created, seq.generated, latency, seq.cached_tokens, report, verify)
            return web.Response(body=body, content_type="application/json")
        finally:
            # Client gone (handler cancelled), write failed, or server stopping: free the slot.
            self.engine.abort(seq)

    def _verify_steps(self, seq: Sequence) -> int | None:
        """What SGLang's native API says of a finished request's verify steps: only a speculative
        server's."""
        return seq.verify_steps if self.config.role == "speculative" else None

    async def _stream(
        self,
        request: web.Request,
        req: GenRequest,
        seq: Sequence,
        created: int,
        done: Callable[[], None],
        stored: bool,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        fmt: StreamFormatter | ResponsesStream = (
            ResponsesStream(req, created, stored)
            if req.kind == "responses"
            else StreamFormatter(req, created, self.config.enable_cache_report)
        )
        if opening := fmt.opening():
            await resp.write(opening)
        sent = 0
        while True:
            steps = await seq.wait()
            if not steps:
                break
            parts = [fmt.first()] if sent == 0 else []
            for n in steps:
                parts.append(fmt.content(sent, n))
                sent += n
            if seq.finished and not seq.pending:
                parts.append(fmt.finish(sent, seq.cached_tokens, self._verify_steps(seq)))
                done()
            try:
                await resp.write(b"".join(parts))
            except ConnectionResetError:
                return resp  # the client left between two steps; the caller aborts the sequence
            if seq.finished and not seq.pending:
                break
        await resp.write_eof()
        return resp

    async def _parse(
        self, request: web.Request, kind: Kind
    ) -> tuple[GenRequest, tuple[tuple[dict[str, Any], ...], bool] | None]:
        """The request, and for the Responses API the conversation it ends with and whether its
        response is stored."""
        ctype = request.headers.get("Content-Type", "")
        if ctype and ctype.split(";")[0].strip().lower() != "application/json":
            raise RequestError(f"Content-Type must be application/json, got {ctype!r}.")
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise RequestError(f"Invalid JSON body: {exc}") from None
        cfg = self.config
        if kind != "responses":
            return parse_request(kind, body, cfg.served_model_name, cfg.default_max_tokens), None
        chat, store = chat_of(body, self.responses)
        req = parse_request("chat", chat, cfg.served_model_name, cfg.default_max_tokens)
        req = dataclasses.replace(req, kind="responses", rid=response_id(), include_usage=True)
        return req, (tuple(chat["messages"]), store)


def _json(obj: object) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


def _error(message: str, status: int, err_type: str) -> web.Response:
    return web.Response(status=status, body=error_body(message, status, err_type), content_type="application/json")
