"""`dsv4c serve ART`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) for one compiled artifact.

    POST /v1/completions        prompt (text or token ids) -> text; stream=true: server-sent events
    POST /v1/chat/completions   messages rendered with the artifact's chat template (jinja2)
    GET  /v1/models             the served model
    GET  /health                200 once the artifact is loaded and its graphs are captured, else 503
    GET  /metrics               Prometheus text format, `dsv4c_` metrics

Requests go to an `Engine` (runtime/engine.py): continuous batching over the session's cache slots,
the steps in a worker thread. A client that goes away aborts its request. Errors are OpenAI error
objects, `{"error": {"message", "type", "param", "code"}}`, naming the field: 400 invalid request
(bad JSON, wrong types, out-of-range values, prompt + max_tokens over the artifact's max_tokens, an OpenAI
field this server cannot honour: `_refuse_unsupported`; unknown fields are ignored), 401
without the API key, 404 unknown model, 503 + Retry-After when the waiting queue is full or the model
is still loading, 500 when the step running the request failed (the server keeps serving).

Sampling: temperature, top_p, seed, stop, `presence_penalty`, `frequency_penalty`, `logit_bias` (penalties and biases
are applied by plain decoding: refused while the server runs MTP, runtime/sampling.py).
Extensions: `top_k` (0 or -1: off), `min_p`, `repetition_penalty` and `return_token_ids` (each choice carries
`token_ids`, and `prompt_token_ids` in the response / first chunk), as vLLM has them; on chat completions
`chat_template_kwargs` (extra variables of the chat template, e.g. `{"thinking": true}` for DeepSeek's
thinking mode) and, with a reasoning parser (`--reasoning-parser`, on by default for templates that
close `</think>`), the reasoning apart from the answer: `message.reasoning_content` / `delta.reasoning_content`
as DeepSeek's API has it.

Tool calling, where the chat template writes DeepSeek-V4's DSML (dsv4c's built-in V4 template does):
`tools` (functions) with `tool_choice` "auto" (the default) or "none", assistant turns with `tool_calls` and
`tool` turns with their results. The tools go into the prompt as the template writes them; a completion whose
answer ends in a DSML block comes back as `message.tool_calls` (OpenAI's shape: id, type, function name,
arguments as a JSON string) with finish_reason "tool_calls"; streamed, the answer's text before the block is
sent as it comes and the calls in one delta at the end. Forcing a call ("required", a named function) would
need constrained decoding and is refused.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from dsv4c.chat_templates import (DSML, END_THINK, THINK, TOOL_CALLS_START, ToolCallFormatError, load_chat_template,
                                  parse_tool_calls, text_decoder)
from dsv4c.runtime.engine import Engine, Handle, QueueFull, RequestFailed, RequestSpec
from dsv4c.runtime.sampling import SamplingParams

log = logging.getLogger("dsv4c.serve")


# ------------------------------------------------------------------------------------------------
# configuration and errors
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeConfig:
    artifact: Path
    served_model_name: str | None = None  # default: the artifact folder's name
    api_key: str | None = None
    max_waiting: int = 256
    mtp: int | str = "auto"
    device: str | None = None  # default: cuda when present
    graphs: str | None = None
    reasoning_parser: str = "auto"  # REASONING_PARSERS: auto = deepseek where the chat template closes </think>
    max_num_batched_tokens: int | None = None  # prompt tokens per prefill call (None: the Session's default)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.artifact).resolve().name


class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# ------------------------------------------------------------------------------------------------
# request bodies (strict: a string is not a number, 1.0 is not an int, "yes" is not a bool)
# ------------------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    return_token_ids: bool = False
    user: str | None = None
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)  # vLLM's extensions (runtime/sampling.py)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None  # token id (text) -> bias
    # known fields this server cannot honour: refused unless at their no-op value (`_refuse_unsupported`),
    # never ignored, since each changes what the model is asked for or how its tokens are chosen
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ToolFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON object's text


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning (DeepSeek's templates read it)
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's: the call it answers


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own variables (ChatTemplate.RESERVED not)
    tools: list[Any] | None = None  # [{"type": "function", "function": {"name", ...}}] (`_tools`)
    tool_choice: str | dict[str, Any] | None = None  # "auto" (default) or "none"
    functions: list[Any] | None = None  # the legacy form of tools: refused
    function_call: str | dict[str, Any] | None = None


# ------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)


class Metrics:
    """The server's Prometheus metrics (own registry) and the engine's observer."""

    def __init__(self, model_name: str, cache_slots: int = 0):
        r = self.registry = CollectorRegistry()
        lab = {"model_name": model_name}
        self.requests = Counter("dsv4c_requests", "Requests by outcome: stop, length, aborted (client gone), error "
                                "(failed step), rejected (4xx), queue_full (503)", ["model_name", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter("dsv4c_prompt_tokens", "Prompt tokens prefilled", ["model_name"], registry=r)
        self.generation_tokens = Counter("dsv4c_generation_tokens", "Tokens generated", ["model_name"], registry=r)
        self.ttft = Histogram("dsv4c_time_to_first_token_seconds", "Arrival to first token", ["model_name"],
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("dsv4c_time_per_output_token_seconds", "Mean time per output token after the first",
                              ["model_name"], buckets=_TPOT, registry=r)
        self.e2e = Histogram("dsv4c_e2e_request_latency_seconds", "Arrival to finish", ["model_name"],
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("dsv4c_request_queue_time_seconds", "Arrival to a cache slot", ["model_name"],
                               buckets=_LATENCY, registry=r)
        self.running = Gauge("dsv4c_requests_running", "Requests holding a cache slot", ["model_name"], registry=r)
        self.waiting = Gauge("dsv4c_requests_waiting", "Requests waiting for a cache slot", ["model_name"], registry=r)
        self.slots_in_use = Gauge("dsv4c_cache_slots_in_use", "Cache slots holding a sequence", ["model_name"],
                                  registry=r)
        self.slots = Gauge("dsv4c_cache_slots", "Cache slots for sequences (the artifact's max_batch)", ["model_name"],
                           registry=r)
        self.mtp_drafted = Counter("dsv4c_mtp_draft_tokens", "MTP draft tokens checked by verification",
                                   ["model_name"], registry=r)
        self.mtp_accepted = Counter("dsv4c_mtp_accepted_tokens", "MTP draft tokens accepted", ["model_name"],
                                    registry=r)
        # the prefix cache (runtime/prefix_cache.py, or the paged caches' block pool): blocks and token hits
        self.pc_blocks = Gauge("dsv4c_prefix_cache_blocks", "Blocks of the prefix cache's pool (0: no prefix cache)",
                               ["model_name"], registry=r)
        self.pc_in_use = Gauge("dsv4c_prefix_cache_blocks_in_use", "Pool blocks held by running requests",
                               ["model_name"], registry=r)
        self.pc_cached = Gauge("dsv4c_prefix_cache_blocks_cached", "Pool blocks whose prefix can be reused",
                               ["model_name"], registry=r)
        self.pc_counts = {  # the pool's counter name -> a Prometheus counter of it (raised by each step's delta)
            name: Counter(f"dsv4c_prefix_cache_{metric}", doc, ["model_name"], registry=r)
            for name, metric, doc in (("prompt_tokens", "queries", "Prompt tokens looked up in the prefix cache"),
                                      ("hit_tokens", "hits", "Prompt tokens served from cached blocks"),
                                      ("evictions", "evictions", "Cached blocks evicted (least recently used)"))}
        self._pc_seen = dict.fromkeys(self.pc_counts, 0)
        self._lab = lab
        self.slots.labels(**lab).set(cache_slots)
        for m in (self.prompt_tokens, self.generation_tokens, self.mtp_drafted, self.mtp_accepted, self.pc_blocks,
                  self.pc_in_use, self.pc_cached, *self.pc_counts.values()):
            m.labels(**lab)  # present (at 0) from the start

    def outcome(self, outcome: str) -> None:
        self.requests.labels(outcome=outcome, **self._lab).inc()

    # the engine's Observer (called from its worker thread; prometheus_client is thread-safe)
    def admitted(self, h: Handle) -> None:
        self.queue.labels(**self._lab).observe(h.t_admitted - h.t_arrival)
        self.prompt_tokens.labels(**self._lab).inc(len(h.spec.prompt_ids))

    def finished(self, h: Handle, stats: dict | None) -> None:
        lab = self._lab
        self.outcome(h.outcome)
        self.generation_tokens.labels(**lab).inc(h.n_generated)
        self.e2e.labels(**lab).observe(time.perf_counter() - h.t_arrival)
        if h.t_first is not None:
            self.ttft.labels(**lab).observe(h.t_first - h.t_arrival)
            if h.n_generated > 1:
                self.tpot.labels(**lab).observe((h.t_last - h.t_first) / (h.n_generated - 1))
        if stats and "proposed_per_position" in stats:
            self.mtp_drafted.labels(**lab).inc(sum(stats["proposed_per_position"]))
            self.mtp_accepted.labels(**lab).inc(stats["accepted_draft_tokens"])

    def gauges(self, running: int, waiting: int, slots_in_use: int) -> None:
        self.running.labels(**self._lab).set(running)
        self.slots_in_use.labels(**self._lab).set(slots_in_use)

    def prefix_cache(self, stats: dict) -> None:
        """The prefix cache's `stats()` (both pools name their fields alike): gauges set, counters raised by
        what the pool's own counters gained since the last call."""
        lab = self._lab
        self.pc_blocks.labels(**lab).set(stats["blocks_total"])
        self.pc_in_use.labels(**lab).set(stats["blocks_in_use"])
        self.pc_cached.labels(**lab).set(stats["blocks_cached"])
        for name, counter in self.pc_counts.items():
            counter.labels(**lab).inc(stats[name] - self._pc_seen[name])
            self._pc_seen[name] = stats[name]

    def watch(self, engine: Engine) -> None:
        """The waiting gauge reads the engine's count at scrape time: it changes on the event loop too."""
        self.waiting.labels(**self._lab).set_function(lambda: engine.waiting)


# ------------------------------------------------------------------------------------------------
# chat template (found by dsv4c.chat_templates.load_chat_template)
# ------------------------------------------------------------------------------------------------

class ChatTemplate:
    """A chat template rendered with jinja2's sandbox, as Hugging Face tokenizers render theirs."""

    def __init__(self, source: str, bos_token: str, eos_token: str):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = _tojson
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    RESERVED = ("messages", "bos_token", "eos_token", "add_generation_prompt", "raise_exception", "tools")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, extra: dict | None = None) -> str:
        """`extra`: the template's own variables (a request's chat_template_kwargs), none of RESERVED."""
        return self.template.render(**(extra or {}), messages=messages, bos_token=self.bos_token,
                                    eos_token=self.eos_token, add_generation_prompt=add_generation_prompt)


def _tojson(x, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """`tojson` as Hugging Face tokenizers give it to chat templates: json.dumps with non-ASCII kept, keys in
    their order and no HTML escaping (jinja2's own filter escapes <, >, &, ' and sorts keys)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def tool_parser_for(template_source: str | None) -> str | None:
    """"dsml" where the chat template writes DeepSeek-V4's tool calls, else None (tools are refused)."""
    return "dsml" if template_source and f"<{DSML}tool_calls>" in template_source else None


# ------------------------------------------------------------------------------------------------
# text
# ------------------------------------------------------------------------------------------------
class _Detokenizer:
    """Incremental text of a growing token list: holds back a possibly incomplete UTF-8 character and
    the tail that could still become a stop string; the text ends before the first stop string."""

    def __init__(self, decode, stops: list[str]):
        self.decode, self.stops = decode, [s for s in stops if s]  # decode: ids -> text (chat_templates.text_decoder)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0

    def push(self, ids: list[int], final: bool) -> str:
        self.ids += ids
        text = self.decode(self.ids)
        cuts = [text.find(s) for s in self.stops if s in text]
        if cuts:
            text, final = text[: min(cuts)], True
        end = len(text)
        if not final:
            end = max(self.sent, len(text.rstrip("\ufffd")) - self.hold)
        delta = text[self.sent:end]
        self.sent = max(self.sent, end)
        return delta


REASONING_PARSERS = ("auto", "deepseek", "none")
MAX_N = 16  # choices per request (`n`)


def reasoning_parser_for(setting: str, template_source: str | None) -> str:
    """The parser a server runs: `setting`, where auto is deepseek for a chat template that writes </think>."""
    if setting not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: expected one of {', '.join(REASONING_PARSERS)}, got {setting!r}")
    if setting == "auto":
        return "deepseek" if template_source and END_THINK in template_source else "none"
    return setting


def _held(text: str, tag: str) -> int:
    """How many trailing characters of `text` could still be the start of `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


class _ToolCallSplit:
    """DeepSeek-V4's tool calls: an answer's DSML block (`TOOL_CALLS_START` to the end). Fed the answer's text
    in pieces, it returns the text before the block as it comes (holding back a tail that could still be the
    block's start), keeps the block to the end and parses it there (`calls`). A block that does not parse
    goes out as text, unchanged (what the model wrote), and is logged."""

    def __init__(self):
        self.buf, self.block = "", None  # block: the text after TOOL_CALLS_START, once seen
        self.calls: list[dict] = []

    def push(self, text: str, final: bool) -> str:
        if self.block is None:
            self.buf += text
            i = self.buf.find(TOOL_CALLS_START)
            if i < 0:
                keep = 0 if final else _held(self.buf, TOOL_CALLS_START)
                out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return out
            out, self.block, self.buf = self.buf[:i], self.buf[i + len(TOOL_CALLS_START):], ""
        else:
            out, self.block = "", self.block + text
        if not final:
            return out
        try:
            self.calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": c}
                          for c in parse_tool_calls(self.block)]
            return out
        except ToolCallFormatError as e:
            log.warning("a completion's tool-call block does not parse (%s): returned as text", e)
            return out + TOOL_CALLS_START + self.block


class _ReasoningSplit:
    """DeepSeek's thinking format (R1, V3.1, V3.2, V4): the reasoning runs until the first `</think>`, and the
    answer follows it. The reasoning is open from the start when the rendered prompt left a `<think>` open
    (the template's thinking mode), or when the completion itself begins with `<think>` (R1-0528); else the
    whole completion is the answer. Fed a completion's text in pieces, it returns each piece's (reasoning,
    answer), holding back a tail that could still be the start of a tag until the next piece or the end."""

    def __init__(self, prompt_text: str):
        self.state = "reasoning" if prompt_text.rfind(THINK) > prompt_text.rfind(END_THINK) else "start"
        self.buf = ""

    def push(self, text: str, final: bool) -> tuple[str, str]:
        self.buf += text
        reasoning = answer = ""
        while self.buf:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(THINK):
                    self.buf, self.state = head[len(THINK):], "reasoning"
                elif not final and THINK.startswith(head):  # whitespace or a tag's start so far: wait
                    break
                else:
                    self.state = "answer"
            elif self.state == "reasoning":
                i = self.buf.find(END_THINK)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf, self.state = self.buf[i + len(END_THINK):], "answer"
                    continue
                keep = 0 if final else _held(self.buf, END_THINK)
                reasoning += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            else:
                answer, self.buf = answer + self.buf, ""
        return reasoning, answer


# ------------------------------------------------------------------------------------------------
# the app
# ------------------------------------------------------------------------------------------------
class _State:
    """What the routes need: filled in by the loader thread (or at once for a given session)."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.ready = False
        self.load_error: str | None = None
        self.sess = None
        self.engine: Engine | None = None
        self.chat: ChatTemplate | None = None
        self.chat_missing = ""
        self.reasoning = "none"  # the reasoning parser chat completions run (reasoning_parser_for)
        self.tool_parser: str | None = None  # tool_parser_for: "dsml" or None (tools refused)
        self.decode = None  # ids -> text with the parsers' markers kept (chat_templates.text_decoder)
        self.mtp: dict = {"k": 0, "policy": None}
        self.metrics: Metrics | None = None
        self.created = int(time.time())


def create_app(cfg: ServeConfig, session=None) -> FastAPI:
    """The FastAPI app. Without `session` it loads cfg.artifact in a thread when the app starts (GET
    /health answers 503 until then); with one (tests, embedding) it serves that session at once."""
    st = _State(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if session is None:
            threading.Thread(target=_load, args=(st,), name="dsv4c-load", daemon=True).start()
        yield
        if st.engine is not None:
            st.engine.stop()

    app = FastAPI(title="dsv4c", lifespan=lifespan)
    app.state.dsv4c = st
    if session is not None:
        _ready(st, session)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        if st.metrics is not None and e.code == "queue_full":
            st.metrics.outcome("queue_full")
        elif st.metrics is not None and e.status < 500 and e.status != 499:  # 499: counted as aborted
            st.metrics.outcome("rejected")
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        err = _validation_error(e.errors())
        if st.metrics is not None:
            st.metrics.outcome("rejected")
        return err.response()

    def auth(request: Request) -> None:
        if cfg.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), cfg.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'", None,
                           code="invalid_api_key")

    @app.get("/health")
    async def health():
        if st.ready:
            return {"status": "ok"}
        status = f"error: {st.load_error}" if st.load_error else "loading"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        if st.metrics is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models():
        return {"object": "list", "data": [_model_card(st)]}

    @app.get("/v1/models/{name}", dependencies=[Depends(auth)])
    async def model(name: str):
        _check_model(st, name)
        return _model_card(st)

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(body: CompletionRequest, request: Request):
        _check_ready(st)
        _check_model(st, body.model)
        ids, prompt_text = _completion_prompt(st, body)
        return await _run(st, request, body, ids, chat=False, echo_text=prompt_text if body.echo else None)

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat(body: ChatRequest, request: Request):
        _check_ready(st)
        _check_model(st, body.model)
        ids, text = _chat_prompt(st, body)
        return await _run(st, request, body, ids, chat=True, prompt_text=text)

    return app


def _validation_error(errors: list[dict]) -> APIError:
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
    if e.get("type") == "model_attributes_type" or not loc:
        return APIError(400, f"the body must be a JSON object: {e.get('msg')}")
    param = loc[0]
    msg = e.get("msg", "invalid value")
    return APIError(400, f"{'.'.join(loc)}: {msg}" + (f" (got {e['input']!r})" if "input" in e and
                                                       not isinstance(e["input"], (dict, list)) else ""), param)


def _model_card(st: _State) -> dict:
    card = {"id": st.cfg.model_name, "object": "model", "created": st.created, "owned_by": "dsv4c"}
    if st.sess is not None:
        card["max_model_len"] = st.sess.max_tokens
    return card


def _check_ready(st: _State) -> None:
    if not st.ready:
        raise APIError(503, "the model is still loading" if st.load_error is None else
                       f"the model failed to load: {st.load_error}", type_="server_error",
                       code="model_loading", headers={"Retry-After": "5"})


def _check_model(st: _State, name: str) -> None:
    if name != st.cfg.model_name:
        raise APIError(404, f"model: the model {name!r} does not exist; this server serves {st.cfg.model_name!r}",
                       "model", code="model_not_found")


def _completion_prompt(st: _State, body: CompletionRequest) -> tuple[list[int], str | None]:
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise APIError(400, f"prompt: one prompt per request (got a batch of {len(p)}); send concurrent "
                                f"requests instead", "prompt")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise APIError(400, "prompt: is empty", "prompt")
        if st.sess.tokenizer is None:
            raise APIError(400, "prompt: this artifact has no tokenizer.json; send token ids", "prompt")
        return st.sess._encode(p), p
    ids = list(p)
    V = st.sess.config.vocab_size
    if not ids:
        raise APIError(400, "prompt: is empty", "prompt")
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise APIError(400, f"prompt: token ids {bad[:5]} are outside the vocabulary (vocab_size={V})", "prompt")
    text = st.sess.tokenizer.decode(ids) if st.sess.tokenizer is not None else None
    return ids, text


def _chat_prompt(st: _State, body: ChatRequest) -> tuple[list[int], str]:
    """-> (the rendered prompt's token ids, its text)."""
    if st.chat is None:
        raise APIError(400, f"messages: this model has no chat template ({st.chat_missing}); use /v1/completions",
                       "messages", code="chat_template_missing")
    msgs = []
    for i, m in enumerate(body.messages):
        content = m.content if isinstance(m.content, str) or m.content is None else \
            "".join(part.text for part in m.content)
        msgs.append({"role": m.role, "content": content or ""})
        if m.reasoning_content is not None:
            msgs[-1]["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            msgs[-1]["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.function.name,
                    "arguments": _arguments(c.function.arguments, f"messages[{i}].tool_calls[{j}]")}}
                for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            msgs[-1]["tool_call_id"] = m.tool_call_id
    _in_call_order(msgs)
    extra = dict(body.chat_template_kwargs or {})
    taken = [k for k in extra if k in ChatTemplate.RESERVED]
    if taken:
        raise APIError(400, f"chat_template_kwargs: {taken[0]!r} is set by the server, not the request",
                       "chat_template_kwargs")
    if _tools_on(body):
        _check_tools(st, body.tools)
        extra["tools"] = body.tools
    from jinja2.exceptions import TemplateError

    try:
        text = st.chat.render(msgs, add_generation_prompt=True, extra=extra)
    except TemplateError as e:
        raise APIError(400, f"messages: the chat template rejected them: {e}", "messages") from None
    ids = st.sess.tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
        raise APIError(400, "messages: the rendered prompt is empty", "messages")
    return ids, text


def _logit_bias(st: _State, bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias {"token id": bias} -> ((id, bias), ...), ids checked against the vocabulary."""
    V, out = st.sess.config.vocab_size, []
    for key, b in bias.items():
        if not key.isdigit() or int(key) >= V:
            raise APIError(400, f"logit_bias: keys are token ids below the vocabulary size {V}, got {key!r}",
                           "logit_bias")
        out.append((int(key), float(b)))
    return tuple(out)


def _tools_on(body: ChatRequest) -> bool:
    """Tools go into the prompt and completions are parsed for calls (tool_choice "none": neither)."""
    return bool(body.tools) and body.tool_choice != "none"


def _check_tools(st: _State, tools: list) -> None:
    if st.tool_parser is None:
        raise APIError(400, "tools: this model's chat template writes no tool-call format this server parses "
                            "(DeepSeek-V4's DSML); send no tools or tool_choice 'none'", "tools")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str) or not f["name"]:
            raise APIError(400, f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                f"\"parameters\": ...}}}}", f"tools[{i}]")


def _arguments(args: str | dict, where: str) -> dict:
    """A past call's arguments as the template needs them: an object (OpenAI sends its JSON text)."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise APIError(400, f"{where}.function.arguments: not valid JSON ({e})", "messages") from None
    if not isinstance(args, dict):
        raise APIError(400, f"{where}.function.arguments: must be a JSON object", "messages")
    return args


def _in_call_order(msgs: list[dict]) -> None:
    """Tool results of one user turn (a run of user and tool messages) in the order of the latest assistant
    turn's calls, by tool_call_id (unknown ids first, as the model card's encoder orders them)."""
    order: dict[str, int] = {}
    i = 0
    while i < len(msgs):
        m = msgs[i]
        if m["role"] == "assistant" and m.get("tool_calls"):
            order = {c["id"]: j for j, c in enumerate(m["tool_calls"]) if c["id"]}
        if m["role"] not in ("user", "tool"):
            i += 1
            continue
        j = i
        while j < len(msgs) and msgs[j]["role"] in ("user", "tool"):
            j += 1
        slots = [k for k in range(i, j) if msgs[k]["role"] == "tool"]
        ordered = sorted((msgs[k] for k in slots), key=lambda t: order.get(t.get("tool_call_id") or "", 0))
        for k, t in zip(slots, ordered):
            msgs[k] = t
        i = j


def _refuse_unsupported(body: _Common, chat: bool) -> None:
    """400 naming the first field set to something this server does not do."""
    if body.n > MAX_N:
        raise APIError(400, f"n: at most {MAX_N} choices per request (got {body.n}); send concurrent requests "
                            f"instead", "n")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise APIError(400, f"response_format: only type 'text' is supported (no constrained decoding), got "
                            f"{body.response_format.get('type')!r}", "response_format")
    if not chat:
        return
    if body.tool_choice not in (None, "auto", "none"):
        raise APIError(400, f"tool_choice: only 'auto' and 'none' (forcing a call needs constrained decoding, "
                            f"which this server does not do); got {body.tool_choice!r}", "tool_choice")
    for name in ("functions", "function_call"):
        if getattr(body, name):
            raise APIError(400, f"{name}: function calling is not supported by this server", name)


def _sampling(st: _State, body: _Common, ids: list[int], chat: bool) -> list[RequestSpec]:
    """The engine requests of the body's `n` choices: choice i samples with seed + i (a given seed), or its own
    random seed."""
    limit = st.sess.max_tokens
    _refuse_unsupported(body, chat)
    max_tokens = body.max_tokens
    name = "max_tokens"
    if chat and body.max_completion_tokens is not None:
        max_tokens, name = body.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:  # chat default: the rest of the context
        max_tokens = limit - len(ids)
        if max_tokens < 1:
            raise APIError(400, f"messages: the prompt is {len(ids)} tokens, and this model's maximum context length "
                                f"(the artifact's max_tokens) is {limit}", "messages")
    if len(ids) + max_tokens > limit:
        raise APIError(400, f"{name}: this model's maximum context length is {limit} tokens (the artifact's "
                            f"max_tokens); you asked for {len(ids) + max_tokens} ({len(ids)} in the prompt, "
                            f"{max_tokens} for the completion)", name, code="context_length_exceeded")
    lp = None
    if chat and body.logprobs:
        lp = body.top_logprobs or 0
    elif chat and body.top_logprobs is not None:
        raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
    elif not chat and body.logprobs is not None:
        lp = body.logprobs
        if body.echo:
            raise APIError(400, "echo: with logprobs it needs the prompt's log-probabilities, which this server "
                                "does not compute", "echo")
    if lp is not None and st.mtp["k"]:
        raise APIError(400, f"logprobs: not available with MTP speculative decoding (this server runs k="
                            f"{st.mtp['k']}; serve with --mtp 0)", "logprobs")
    bias = _logit_bias(st, body.logit_bias or {})
    pen = SamplingParams(presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                         repetition_penalty=body.repetition_penalty, logit_bias=bias)
    if pen.penalized and st.mtp["k"]:
        raise APIError(400, pen.plain_only(f"this server runs k={st.mtp['k']}; serve with --mtp 0"),
                       pen.penalty_fields()[0])
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    seeds = [body.seed + i if body.seed is not None else secrets.randbelow(2**31) for i in range(body.n)]
    return [RequestSpec(tuple(ids), max_tokens, body.temperature, body.top_p, max(body.top_k, 0), seed,
                        tuple(stop), lp, body.presence_penalty, body.frequency_penalty, body.repetition_penalty,
                        body.min_p, bias) for seed in seeds]


async def _run(st: _State, request: Request, body, ids: list[int], chat: bool, echo_text: str | None = None,
               prompt_text: str | None = None):
    """Submit the request's `n` choices (engine requests), then answer with all of them, or stream them."""
    specs = _sampling(st, body, ids, chat)
    hs: list[Handle] = []
    try:
        for spec in specs:
            hs.append(st.engine.submit(spec))
    except QueueFull as e:
        for h in hs:
            st.engine.abort(h)
        raise APIError(503, f"{e}; retry later", type_="server_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    outs = [_Output(st, body, h, rid, chat, echo_text, prompt_text, i) for i, h in enumerate(hs)]
    streams = [st.engine.stream(h) for h in hs]
    watch = asyncio.create_task(_watch_disconnect(request, st.engine, hs))
    firsts = []
    try:
        for stream in streams:
            firsts.append(await anext(stream))  # errors before the first token still get their status code
    except BaseException as e:
        watch.cancel()
        for stream in streams:
            await stream.aclose()
        if isinstance(e, RequestFailed):
            raise _failed(e) from None
        raise
    if body.stream:
        watch.cancel()  # from here StreamingResponse watches for the client going away
        return StreamingResponse(_sse(outs, firsts, streams), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        for out, first, stream in zip(outs, firsts, streams):
            out.add(first)
            async for o in stream:
                out.add(o)
    except RequestFailed as e:
        raise _failed(e) from None
    finally:
        watch.cancel()
        for stream in streams:
            await stream.aclose()
    return _response(outs)


def _failed(e: RequestFailed) -> APIError:
    if e.status >= 500:
        return APIError(e.status, str(e), type_="server_error", code="step_failed")
    return APIError(e.status, str(e), code="aborted" if e.status == 499 else None)


async def _watch_disconnect(request: Request, engine: Engine, hs: list[Handle]) -> None:
    """Abort the handles when the client goes away while they have no response yet."""
    while any(h.outcome is None for h in hs):
        if await request.is_disconnected():
            for h in hs:
                engine.abort(h)
            return
        await asyncio.sleep(0.1)


async def _merged(streams: list) -> AsyncIterator[tuple[int, object]]:
    """(choice index, StepOutput) from several engine streams, as they come. Closing it cancels the reads in
    flight and waits for them, so the streams can be closed after it."""
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in sorted(done, key=pending.get):
                i = pending.pop(t)
                try:
                    o = t.result()
                except StopAsyncIteration:
                    continue
                yield i, o
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _sse(outs: list["_Output"], firsts: list, streams: list):
    """The chunks of every choice (one stream read directly; several merged as their steps come)."""
    rest = _merged(streams) if len(streams) > 1 else ((0, o) async for o in streams[0])
    try:
        for out, first in zip(outs, firsts):
            for chunk in out.chunks(first):
                yield _event(chunk)
        async for i, o in rest:
            for chunk in outs[i].chunks(o):
                yield _event(chunk)
        if outs[0].include_usage:
            c = outs[0].envelope([], True)
            c["usage"] = _usage(outs)
            yield _event(c)
    except RequestFailed as e:
        yield _event(_failed(e).body())
    finally:
        await rest.aclose()
        for stream in streams:  # a client gone away: closes the engine streams, which aborts the requests
            await stream.aclose()
    yield "data: [DONE]\n\n"


def _usage(outs: list["_Output"]) -> dict:
    """The prompt once, the completion tokens of every choice (OpenAI's usage of n choices)."""
    p, c = len(outs[0].h.spec.prompt_ids), sum(len(o.tokens) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _response(outs: list["_Output"]) -> dict:
    r = outs[0].envelope([o.choice() for o in outs], False)
    r["usage"] = _usage(outs)
    return r


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Output:
    """Builds one request's response (or its stream chunks) from its StepOutputs."""

    def __init__(self, st: _State, body, h: Handle, rid: str, chat: bool, echo_text: str | None,
                 prompt_text: str | None = None, index: int = 0):
        self.st, self.body, self.h, self.id, self.chat, self.index = st, body, h, rid, chat, index
        # chat with a reasoning parser: the text goes to reasoning_content and content
        self.split = _ReasoningSplit(prompt_text or "") if chat and st.reasoning == "deepseek" else None
        # chat with tools: the answer's DSML block goes to tool_calls
        self.tools = _ToolCallSplit() if chat and _tools_on(body) else None
        self.model, self.created = st.cfg.model_name, int(time.time())
        self.detok = _Detokenizer(st.decode, list(h.spec.stop)) if st.decode is not None else None
        self.echo = echo_text
        self.offset = len(echo_text or "")  # text_offset of the next token (completions logprobs)
        self.text, self.reasoning, self.tokens, self.lps = "", "", [], []
        self.finish: str | None = None
        self.started = False
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def _delta(self, o) -> tuple[str, str]:
        """The step's new text -> (reasoning, the rest); reasoning is "" without a reasoning parser."""
        final = o.finish_reason is not None
        text = "" if self.detok is None else self.detok.push(o.tokens, final)
        reasoning = ""
        if self.split is not None:
            reasoning, text = self.split.push(text, final)
        if self.tools is not None:
            text = self.tools.push(text, final)
        return reasoning, text

    def add(self, o) -> None:
        self.tokens += o.tokens
        self.lps += o.logprobs or []
        reasoning, text = self._delta(o)
        self.reasoning += reasoning
        self.text += text
        self.finish = o.finish_reason or self.finish

    def _finish_reason(self) -> str | None:
        if self.finish is None:
            return None
        if self.tools is not None and self.tools.calls:
            return "tool_calls"
        return "length" if self.finish == "length" else "stop"

    def _choice(self, text: str, tokens: list[int], lps: list, finish: str | None, stream: bool,
                reasoning: str = "") -> dict:
        if self.chat:
            key = "delta" if stream else "message"
            msg = {"role": "assistant", "content": text} if not stream or not self.started else \
                {"content": text}
            if self.split is not None and (reasoning or not stream):  # a message always says, a delta when some
                msg["reasoning_content"] = reasoning or None
            if self.tools is not None and self.tools.calls and finish is not None:  # parsed at the end
                msg["tool_calls"] = [{"index": j, **c} if stream else c for j, c in enumerate(self.tools.calls)]
                if not stream and not text:
                    msg["content"] = None
            c = {"index": self.index, key: msg, "logprobs": self._chat_logprobs(tokens, lps), "finish_reason": finish}
        else:
            c = {"index": self.index, "text": text, "logprobs": self._completion_logprobs(tokens, lps),
                 "finish_reason": finish}
        if self.body.return_token_ids:
            c["token_ids"] = list(tokens)
            if not self.started:
                c["prompt_token_ids"] = list(self.h.spec.prompt_ids)
        return c

    def _tok_text(self, t: int) -> str:
        tok = self.st.sess.tokenizer
        return tok.decode([t], skip_special_tokens=False) if tok is not None else str(t)

    def _completion_logprobs(self, tokens, lps):
        if self.h.spec.logprobs is None:
            return None
        texts = [self._tok_text(t) for t in tokens]
        offsets = []
        for t in texts:  # offsets into the echoed prompt + completion, counted per token's own text
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": texts, "token_logprobs": [lp for lp, _ in lps],
                "top_logprobs": [{self._tok_text(t): v for t, v in top} for _, top in lps], "text_offset": offsets}

    def _chat_logprobs(self, tokens, lps):
        if self.h.spec.logprobs is None:
            return None

        def entry(t, v):
            s = self._tok_text(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                            for t, (lp, top) in zip(tokens, lps)]}

    def envelope(self, choices: list, stream: bool) -> dict:
        obj = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunks(self, o) -> list[dict]:
        reasoning, delta = self._delta(o)
        if self.echo and not self.started:
            delta = self.echo + delta
        self.tokens += o.tokens
        self.finish = o.finish_reason or self.finish
        chunk = self.envelope([self._choice(delta, o.tokens, o.logprobs or [], self._finish_reason(), True,
                                             reasoning)], True)
        if self.include_usage:
            chunk["usage"] = None
        self.started = True
        return [chunk]

    def choice(self) -> dict:
        """The whole choice, once its request finished (`_response`)."""
        return self._choice((self.echo or "") + self.text, self.tokens, self.lps, self._finish_reason(), False,
                            self.reasoning)


# ------------------------------------------------------------------------------------------------
# loading and the command
# ------------------------------------------------------------------------------------------------
def _load(st: _State) -> None:
    """Load the artifact, warm up (captures the graphs on a GPU), decide MTP, start the engine."""
    from dsv4c.runtime import Session

    try:
        import torch

        cfg = st.cfg
        device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        t0 = time.perf_counter()
        sess = Session.load(cfg.artifact, device=device, graphs=cfg.graphs,
                            max_num_batched_tokens=cfg.max_num_batched_tokens)
        log.info("loaded %s in %.1fs", cfg.artifact, time.perf_counter() - t0)
        _ready(st, sess)
    except Exception as e:  # /health reports it; the process keeps answering
        log.exception("loading %s failed", st.cfg.artifact)
        st.load_error = f"{type(e).__name__}: {e}"


def _ready(st: _State, sess) -> None:
    cfg = st.cfg
    st.sess = sess
    warm = [sess.config.bos_token_id or 0] * 4
    if sess.device.type == "cuda":
        log.info("kernel warm-up (prefill shape classes): %s s", sess.warm_up())  # JIT compiles before /health
    sess.generate([warm] * min(2, sess.max_batch), max_new_tokens=2)  # captures decode on a GPU
    mtp = cfg.mtp
    if mtp == "auto" and not int(sess.manifest.get("mtp_k", 0)):
        mtp = 0
    st.mtp = sess.set_mtp(mtp)
    if st.mtp["k"]:
        sess.generate([warm], max_new_tokens=4, mtp=st.mtp["k"])  # captures verify / mtp
    src = load_chat_template(cfg.artifact)
    st.chat, st.chat_missing = _chat_template(cfg.artifact, src, sess)
    st.reasoning = reasoning_parser_for(cfg.reasoning_parser, src)
    st.tool_parser = tool_parser_for(src)
    st.decode = text_decoder(sess.tokenizer) if sess.tokenizer is not None else None
    st.metrics = Metrics(cfg.model_name, sess.max_batch)
    st.engine = Engine(sess, cfg.max_waiting, st.metrics)
    st.metrics.watch(st.engine)
    st.engine.start()
    st.ready = True
    log.info("ready: %s (max_tokens %d, max_batch %d, mtp k=%d%s; reasoning parser %s)", cfg.model_name,
             sess.max_tokens, sess.max_batch, st.mtp["k"],
             f": {st.mtp['policy']['reason']}" if st.mtp.get("policy") else "", st.reasoning)


def _chat_template(art: Path, src: str | None, sess) -> tuple[ChatTemplate | None, str]:
    if src is None:
        return None, f"{art}: neither chat_template.jinja nor a chat_template in tokenizer_config.json"
    if sess.tokenizer is None:
        return None, f"{art}: a chat template but no tokenizer.json"
    extra = json.loads((Path(art) / "tokenizer_config.json").read_text()) \
        if (Path(art) / "tokenizer_config.json").is_file() else {}

    def token(key: str, tid: int | None) -> str:
        v = extra.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if v is None and tid is not None:
            v = sess.tokenizer.id_to_token(tid)
        return v or ""

    return ChatTemplate(src, token("bos_token", sess.config.bos_token_id),
                        token("eos_token", sess.config.eos_token_id)), ""


def serve(cfg: ServeConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    import uvicorn

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvicorn.run(create_app(cfg), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
