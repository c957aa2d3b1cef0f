"""The HTTP app: OpenAI-style routes on Starlette, served by uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/explain``,
``POST /v1/explore`` (the explorer's data, :func:`tinylm.use.explorer.explorer_data`), the
explorer page in live mode at ``/explorer``,
``GET /v1/models``, ``GET /health`` (503 while the model loads), ``GET /metrics``
(Prometheus text) and the web page at ``/``. With an API key every ``/v1`` route and
``/metrics`` need ``Authorization: Bearer KEY`` (compared in constant time, as UTF-8
bytes). Every client error is a 4xx in OpenAI's shape ``{"error": {message, type, param,
code}}``. Only requests whose ``Host`` names this server are answered
(:mod:`tinylm.serve.guard`), POST bodies must be ``application/json`` (else 415) and arrive
within ``BODY_TIMEOUT`` (else 408); explore and explain requests are admitted within a
memory budget (:mod:`tinylm.serve.admission`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from tinylm.core.errors import NonFiniteError, TinyLMError
from tinylm.data.chat import stop_ids
from tinylm.serve.admission import (
    MIB,
    WorkQueue,
    check_explore_size,
    explain_bytes,
    explore_bytes,
)
from tinylm.serve.constrain import constraints_for, parse_output
from tinylm.serve.engine import Engine, NeverFits, QueueFull
from tinylm.serve.guard import HostGuard, host_names
from tinylm.serve.lifecycle import Tracker, request_id
from tinylm.serve.metrics import Metrics
from tinylm.serve.responses import (
    Run,
    Stopped,
    chat_logprobs,
    check_prompt,
    collect,
    completion_logprobs,
    score_prompts,
)
from tinylm.serve.schemas import (
    ChatRequest,
    CompletionRequest,
    Limits,
    RequestError,
    parse_chat,
    parse_completion,
    parse_explain,
    parse_json,
)
from tinylm.serve.tools import (
    CallStream,
    ToolSpec,
    chat_prompt,
    output_of,
    parse_tools,
    reply_message,
)
from tinylm.use.explorer import explorer_data, explorer_layers, render_explorer
from tinylm.use.inspection import explain

log = logging.getLogger(__name__)

BODY_TIMEOUT = 10.0  # seconds for a request body to arrive


@dataclass(frozen=True)
class Settings:
    """How the server runs (the ``tinylm serve`` flags)."""

    model_name: str = "tinylm"
    api_key: str | None = None
    max_batch: int = 16
    max_queue: int = 64
    max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    timeout: float = 60.0  # seconds per request
    threads: int | None = None  # torch threads of the decoding loop (None: torch's default)
    host: str = "127.0.0.1"  # the address bound: a name the Host check accepts
    port: int | None = None  # the port bound (None: a Host may name any port)
    allowed_hosts: tuple[str, ...] = ()  # more Host names; "*" turns the check off
    max_explore_tokens: int = 256  # prompt tokens of /v1/explore and /v1/explain
    explore_memory: int = 2048 * MIB  # bytes all explore/explain requests may use at once
    prefix_cache: int = 256 * MIB  # bytes of reusable prompt keys/values (0: off)
    speculate: str | None = None  # "ngram": prompt-lookup decoding of greedy requests
    draft_tokens: int = 8  # the longest prompt-lookup draft verified per step


class Server:
    """The model, its tokenizer and engine, once loaded; ``ready`` until then False."""

    def __init__(self, settings: Settings,
                 loader: Callable[[], tuple[Any, Any]] | None = None) -> None:
        self.settings = settings
        self.loader = loader
        self.metrics = Metrics(settings.max_batch)
        self.tracker = Tracker(self.metrics)  # requests in flight; the drain at shutdown
        self.model = self.tokenizer = self.engine = self.limits = self.explorer = None
        self.load_error: str | None = None

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def load(self, model: Any, tokenizer: Any) -> None:
        s = self.settings
        self.limits = Limits(model.config.context_length, s.max_tokens,
                             max_body_bytes=s.max_body_bytes)
        self.model, self.tokenizer = model, tokenizer
        self.engine = Engine(model, max_batch=s.max_batch, max_queue=s.max_queue,
                             threads=s.threads, metrics=self.metrics,
                             prefix_cache=s.prefix_cache, speculate=s.speculate,
                             draft_tokens=s.draft_tokens).start()
        self.explorer = WorkQueue(s.explore_memory, max_running=s.max_batch,
                                  max_waiting=s.max_queue)

    def load_in_background(self) -> None:
        def run() -> None:
            try:
                self.load(*self.loader())
            except TinyLMError as exc:
                self.load_error = str(exc)
                log.error("could not load the model: %s", exc)
        threading.Thread(target=run, name="tinylm-load", daemon=True).start()

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()


# --- plumbing: errors, auth, body -----------------------------------------------------------


def error_response(exc: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _key_matches(key: str, request: Request) -> bool:
    """Whether the request's ``Authorization: Bearer KEY`` is ``key``, compared in
    constant time as UTF-8 bytes (the header's raw bytes: a key outside Latin-1 too)."""
    given = [v for k, v in request.scope["headers"] if k == b"authorization"]
    raw = given[0].strip() if len(given) == 1 else b""
    token = raw[7:].strip() if raw[:7].lower() == b"bearer " else b""
    return hmac.compare_digest(token, key.encode("utf-8"))


def _authorize(server: Server, request: Request) -> None:
    key = server.settings.api_key
    if key is not None and not _key_matches(key, request):
        raise RequestError("invalid or missing API key; send 'Authorization: Bearer KEY'",
                           status=401, code="invalid_api_key")


def _require_ready(server: Server) -> None:
    if not server.ready:
        why = f" ({server.load_error})" if server.load_error else "; retry in a few seconds"
        raise RequestError(f"the model is not loaded{why}", status=503, type="server_error",
                           code="model_not_ready")


class Cancelled(Exception):
    """The client went away before its request was read (a cancelled request)."""


def _check_json(request: Request) -> None:
    """415 unless the body is declared ``application/json`` (a cross-site form or
    ``text/plain`` POST from a web page is refused before anything runs)."""
    declared = request.headers.get("content-type", "")
    if declared.split(";")[0].strip().lower() != "application/json":
        raise RequestError(f"the request body must be JSON sent with 'Content-Type: "
                           f"application/json', got {declared[:60]!r}", status=415,
                           code="unsupported_media_type")


async def _body(server: Server, request: Request) -> dict[str, Any]:
    _check_json(request)
    limit = server.settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"the request body is {declared} bytes, more than the limit of "
                           f"{limit}; send a shorter prompt", status=413)
    chunks, size = [], 0
    stream = request.stream()
    deadline = time.monotonic() + BODY_TIMEOUT
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(stream.__anext__(),
                                               max(deadline - time.monotonic(), 0.0))
            except StopAsyncIteration:
                break
            size += len(chunk)
            if size > limit:
                raise RequestError(f"the request body is more than the limit of {limit} "
                                   f"bytes; send a shorter prompt", status=413)
            chunks.append(chunk)
    except (TimeoutError, asyncio.TimeoutError):
        raise RequestError(f"the request body did not arrive within {BODY_TIMEOUT:g} s; "
                           f"send it at once", status=408, code="body_timeout") from None
    except ClientDisconnect:
        raise Cancelled from None
    return parse_json(b"".join(chunks))


def _check_model(server: Server, name: str | None) -> None:
    if name is not None and name != server.settings.model_name:
        raise RequestError(f"the model '{name}' does not exist; this server has "
                           f"'{server.settings.model_name}' (GET /v1/models)", param="model",
                           status=404, code="model_not_found")


def _shutting_down() -> RequestError:
    return RequestError("the server is shutting down and takes no new requests; send it "
                        "again once the server is back", status=503, type="server_error",
                        code="server_shutting_down")


def _endpoint(name: str, handler: Callable, prefix: str = "req-") -> Callable:
    """Wrap a handler: the request's id (``X-Request-Id``, see
    :func:`~tinylm.serve.lifecycle.request_id`), auth, readiness, 503 while shutting
    down, RequestError -> its 4xx, 429 on a full queue, and the request counted in the
    metrics."""
    async def wrapped(request: Request) -> Response:
        server: Server = request.app.state.server
        rid, request.state.hex_id = request_id(request.headers.get("x-request-id"), prefix)
        request.state.request_id = rid
        try:
            _authorize(server, request)
            _require_ready(server)
            if server.tracker.draining:
                raise _shutting_down()
            response = await handler(server, request)
        except RequestError as exc:
            response = error_response(exc)
        except QueueFull as exc:
            response = error_response(
                RequestError(str(exc), status=429, type="rate_limit_error",
                             code="queue_full"), {"Retry-After": str(exc.retry_after)})
        except NeverFits as exc:
            response = error_response(_never_fits(server, exc))
        except TinyLMError as exc:  # e.g. a prompt the tokenizer cannot encode
            response = error_response(RequestError(str(exc)))
        except Cancelled:
            log.info("request %s: cancelled (the client left while sending its request to "
                     "%s)", rid, request.url.path)
            server.metrics.cancel("body")
            response = Response(status_code=499)  # not delivered: nobody is listening
        server.metrics.request(name, response.status_code)
        response.headers["X-Request-Id"] = rid
        return response
    return wrapped


def _never_fits(server: Server, exc: NeverFits) -> RequestError:
    s = server.settings
    return RequestError(f"this request asks for {exc.count} sequences (prompts x n) but the "
                        f"server holds at most {exc.capacity} at once (--max-batch "
                        f"{s.max_batch} + --max-queue {s.max_queue}); send fewer prompts or "
                        f"a smaller n", param="n", code="too_many_choices")


# --- generation routes ----------------------------------------------------------------------


def _encode(server: Server, prompt: str | tuple[int, ...]) -> list[int]:
    tok = server.tokenizer
    ids = list(prompt) if isinstance(prompt, tuple) else tok.encode_prompt(prompt)
    if not ids and tok.eos_id is not None:
        ids = [tok.eos_id]  # an empty prompt starts from end-of-text, as tinylm sample
    check_prompt(ids, server.limits.context_length, server.model.config.vocab_size)
    return ids


def _eos(server: Server) -> list[int]:
    eos = server.tokenizer.eos_id
    return [] if eos is None else [eos]


async def completions(server: Server, request: Request) -> Response:
    req = parse_completion(await _body(server, request), server.limits)
    _check_model(server, req.model)
    prompts = [_encode(server, p) for p in req.prompts]
    scored = given = None  # echo + logprobs: each prompt's own tokens, scored
    if req.echo and req.gen.logprobs is not None:
        pairs = await asyncio.to_thread(score_prompts, server.model, prompts, req.gen.logprobs,
                                        server.tokenizer.vocab_size, server.settings.threads)
        scored = [tokens for tokens, _ in pairs]
        if req.gen.max_tokens == 1 and req.gen.sampling.greedy and not req.gen.stream:
            given = [nxt for _, nxt in pairs]  # lm-eval's request: its one token is known
    run = Run(server.engine, server.tokenizer, prompts, req.gen, _eos(server),
              server.settings.timeout, given, id=request.state.hex_id,
              request_id=request.state.request_id)
    server.tracker.begin(run, req.gen.stream)
    echoes = [server.tokenizer.decode(p) if req.echo else "" for p in prompts]
    if req.gen.stream:
        return _sse(_completion_chunks(server, run, req, echoes, scored), run, server.tracker)
    await _until_done(run, request)
    choices = []
    for c in run.choices:
        lp = None
        if req.gen.logprobs is not None:
            lead = scored[c.index // req.gen.n] if scored else []
            lp = completion_logprobs(server.tokenizer, lead + c.tokens, 0)
        choices.append({"index": c.index, "text": echoes[c.index // req.gen.n] + c.stream.text,
                        "logprobs": lp, "finish_reason": c.finish_reason})
    return JSONResponse({"id": f"cmpl-{run.id}", "object": "text_completion",
                         "created": run.created, "model": server.settings.model_name,
                         "choices": choices, "usage": run.usage()})


async def _completion_chunks(server: Server, run: Run, req: CompletionRequest,
                             echoes: list[str], scored: list | None) -> AsyncIterator[dict]:
    head = {"id": f"cmpl-{run.id}", "object": "text_completion", "created": run.created,
            "model": server.settings.model_name}
    for c in run.choices:  # the echo first (with its scores); a choice with max_tokens 0 ends
        if not (req.echo or c.done):
            continue
        lp = None
        if scored:
            lp = completion_logprobs(server.tokenizer, scored[c.index // req.gen.n], 0)
            c.offset = sum(len(t) for t in lp["tokens"])
        yield dict(head, choices=[{"index": c.index, "text": echoes[c.index // req.gen.n],
                                   "logprobs": lp, "finish_reason": c.finish_reason}])
    async for u in run.updates():
        if not u.text and not u.finish_reason and req.gen.logprobs is None:
            continue
        lp = None
        if req.gen.logprobs is not None:
            lp = completion_logprobs(server.tokenizer, u.tokens, u.choice.offset)
        u.choice.offset += sum(len(t) for t in lp["tokens"]) if lp else 0
        yield dict(head, choices=[{"index": u.choice.index, "text": u.text, "logprobs": lp,
                                   "finish_reason": u.finish_reason}])
    if req.gen.include_usage:
        yield dict(head, choices=[], usage=run.usage())


def _chat_ids(server: Server, req: ChatRequest, tools: ToolSpec | None
              ) -> tuple[list[int], list[int]]:
    """The rendered conversation (with the tools offered, calls and results) and the
    ids that end a reply, or a 400 when the model's tokenizer has no chat template."""
    tok = server.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise RequestError("this model has no chat template, so /v1/chat/completions cannot "
                           "render messages; use /v1/completions with a plain prompt instead "
                           "(it works with every model)", param="messages",
                           code="no_chat_template")
    ids = chat_prompt(tok, req.messages, tools)
    check_prompt(ids, server.limits.context_length, server.model.config.vocab_size)
    # the model's end-of-turn tokens (<|end|>, <|im_end|>, ...) and end-of-text
    return ids, sorted(set(stop_ids(tok)) | set(_eos(server)))


async def chat_completions(server: Server, request: Request) -> Response:
    body = await _body(server, request)
    req = parse_chat(body, server.limits)
    _check_model(server, req.model)
    tools = parse_tools(body)
    output = output_of(parse_output(body), tools)
    ids, ends = _chat_ids(server, req, tools)
    constraints = None if output is None else await asyncio.to_thread(
        constraints_for, server.tokenizer, output, ends, req.gen.n)  # compiled off the loop
    run = Run(server.engine, server.tokenizer, [ids], req.gen, ends,
              server.settings.timeout, id=request.state.hex_id,
              request_id=request.state.request_id, constraints=constraints)
    server.tracker.begin(run, req.gen.stream)
    if req.gen.stream:
        return _sse(_chat_chunks(server, run, req, tools), run, server.tracker)
    await _until_done(run, request)
    choices = []
    for c in run.choices:
        message, finish_reason = reply_message(c.stream.text, tools, c.finish_reason)
        choices.append({"index": c.index, "message": message, "finish_reason": finish_reason,
                        "logprobs": chat_logprobs(server.tokenizer, c.tokens)
                        if req.gen.logprobs is not None else None})
    return JSONResponse({"id": f"chatcmpl-{run.id}", "object": "chat.completion",
                         "created": run.created, "model": server.settings.model_name,
                         "choices": choices, "usage": run.usage()})


async def _chat_chunks(server: Server, run: Run, req: ChatRequest,
                       tools: ToolSpec | None) -> AsyncIterator[dict]:
    head = {"id": f"chatcmpl-{run.id}", "object": "chat.completion.chunk",
            "created": run.created, "model": server.settings.model_name}
    for c in run.choices:  # the role first
        yield dict(head, choices=[{"index": c.index, "delta": {"role": "assistant",
                                   "content": ""}, "logprobs": None, "finish_reason": None}])
    calls = {c.index: CallStream(tools) for c in run.choices} \
        if tools is not None and tools.offered else None  # text -> tool-call deltas
    async for u in run.updates():
        lp = chat_logprobs(server.tokenizer, u.tokens) if req.gen.logprobs is not None \
            else None
        deltas = calls[u.choice.index].push(u.text) if calls else \
            [{"content": u.text}] if u.text else []
        if lp and u.tokens and not deltas:
            deltas = [{}] if calls else [{"content": ""}]
        for k, delta in enumerate(deltas):
            yield dict(head, choices=[{"index": u.choice.index, "delta": delta,
                                       "logprobs": lp if k == 0 else None,
                                       "finish_reason": None}])
        if u.finish_reason:
            reason = u.finish_reason
            if calls:
                last, reason = calls[u.choice.index].finish(reason)
                for delta in last:
                    yield dict(head, choices=[{"index": u.choice.index, "delta": delta,
                                               "logprobs": None, "finish_reason": None}])
            yield dict(head, choices=[{"index": u.choice.index, "delta": {},
                                       "logprobs": None, "finish_reason": reason}])
    if req.gen.include_usage:
        yield dict(head, choices=[], usage=run.usage())


async def _until_done(run: Run, request: Request) -> None:
    """Collect the run; a client that disconnects meanwhile cancels it. A request the
    engine failed (non-finite logits, or a bug logged there) is a 500 naming the model;
    one the server's shutdown stopped, a 503."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        run.client_left = True
        run.cancel()
    server: Server = request.app.state.server
    watcher = asyncio.create_task(watch())
    try:
        await collect(run)
    except Stopped as exc:
        raise RequestError(str(exc), status=503, type="server_error",
                           code="server_shutting_down") from exc
    except RuntimeError as exc:  # the engine failed this request
        server.tracker.end(run, "failed", str(exc))
        name = server.settings.model_name
        raise RequestError(f"model '{name}': {exc}", status=500, type="server_error",
                           code="model_error") from exc
    finally:
        watcher.cancel()
        server.tracker.end(run, "finished" if run.done and not run.client_left
                           else "cancelled")


def _sse(chunks: AsyncIterator[dict], run: Run, tracker: Tracker) -> StreamingResponse:
    """Server-sent events: ``data: {json}`` per chunk, then ``data: [DONE]``. When the
    client goes away Starlette stops the generator, whose cleanup cancels the run (a
    cancelled request); a run the shutdown stopped ends with an error event."""
    async def events() -> AsyncIterator[str]:
        outcome, detail = "cancelled", ""
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            outcome = "finished"
        except Stopped as exc:
            err = _shutting_down()
            err.message = str(exc)
            yield f"data: {json.dumps(err.body())}\n\n"
        except RuntimeError as exc:
            outcome, detail = "failed", str(exc)
            err = RequestError(str(exc), status=500, type="server_error")
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            run.cancel()
            tracker.end(run, outcome, detail)
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# --- the other routes -----------------------------------------------------------------------


class NonFinite(Exception):
    """The model's outputs for a prompt are inf or nan (weights that overflow float32)."""


def _non_finite(server: Server) -> RequestError:
    name = server.settings.model_name
    log.error("model '%s' produced non-finite values (inf or nan) for a request", name)
    return RequestError(f"model '{name}' produced non-finite values (inf or nan) for this "
                        f"prompt: its weights overflow float32 in the forward pass",
                        status=500, type="server_error", code="non_finite_logits")


def _json_of(server: Server, data: Any) -> JSONResponse:
    """The JSON answer, rendered in the worker thread (the event loop stays free)."""
    try:
        return JSONResponse(data)
    except ValueError as exc:  # "Out of range float values are not JSON compliant"
        raise NonFinite from exc


def _finite_forward(server: Server, ids: list[int]) -> None:
    """One forward of the prompt; NonFinite if its logits are not all finite (before
    the explorer's costlier passes run on them)."""
    import torch

    with torch.inference_mode():
        logits = server.model(torch.tensor([ids], dtype=torch.long))
    if not bool(torch.isfinite(logits).all()):
        raise NonFinite


async def _explorer_run(server: Server, route: str, ids: list[int], cost: int,
                        fn: Callable[..., Response], *args: Any) -> Response:
    """``fn(*args)`` through the explorer's admission: a 413 when the request is more
    than the server ever runs, a 429 while the budget is taken for --timeout."""
    s = server.settings
    check_explore_size(route, len(ids), cost, max_tokens=s.max_explore_tokens,
                       budget=s.explore_memory)
    try:
        return await server.explorer.run(cost, time.monotonic() + s.timeout, fn, *args)
    except (NonFinite, NonFiniteError):  # the serve check, or explain/explore's own
        raise _non_finite(server) from None


def _explain_answer(server: Server, ids: list[int], top_k: int) -> Response:
    ex = explain(server.model, server.tokenizer, ids, top_k=top_k)
    if not (bool(torch.isfinite(ex.probs).all()) and bool(torch.isfinite(ex.attention).all())):
        raise NonFinite
    attention = [[[[round(p, 4) for p in row] for row in head] for head in layer]
                 for layer in ex.attention.tolist()]  # (L, H, C, C)
    return _json_of(server, {"object": "explanation", "model": server.settings.model_name,
                             "tokens": list(ex.tokens), "ids": list(ex.ids),
                             "rows": ex.to_json(), "attention": attention})


async def explain_route(server: Server, request: Request) -> Response:
    req = parse_explain(await _body(server, request))
    _check_model(server, req.model)
    ids = await asyncio.to_thread(server.tokenizer.encode, req.prompt)  # up to 1 MiB
    check_prompt(ids, server.limits.context_length, server.model.config.vocab_size)
    cost = explain_bytes(server.model.config, len(ids), top_k=req.top_k)
    return await _explorer_run(server, "/v1/explain", ids, cost, _explain_answer, server,
                               ids, req.top_k)


def _explore_answer(server: Server, ids: list[int], prompt: str, body: dict,
                    top_k: int) -> Response:
    _finite_forward(server, ids)
    if "layers" in body:
        data = explorer_layers(server.model, server.tokenizer, prompt, body["layers"],
                               top_k=top_k)
    else:
        data = explorer_data(server.model, server.tokenizer, prompt, top_k=top_k,
                             layer=body.get("layer", 0), head=body.get("head", 0))
    return _json_of(server, data)


async def explore_route(server: Server, request: Request) -> Response:
    """The explorer's data for a prompt: exactly what explorer_data returns (the page at
    /explorer posts {"prompt", "top_k"} here, with "layer"/"head" to open on, and draws
    the answer); with "layers", only those layers' step-by-step part (explorer_layers),
    which the page fetches when it opens a layer it does not carry."""
    body = await _body(server, request)
    req = parse_explain(body)
    _check_model(server, req.model)
    ids = await asyncio.to_thread(server.tokenizer.encode, req.prompt)  # off the loop
    check_prompt(ids, server.limits.context_length, server.model.config.vocab_size)
    layers = body.get("layers")
    cost = explore_bytes(server.model.config, len(ids), top_k=req.top_k,
                         layers=len(layers) if isinstance(layers, list) else None)
    return await _explorer_run(server, "/v1/explore", ids, cost, _explore_answer, server,
                               ids, req.prompt, body, req.top_k)


async def explorer_page(request: Request) -> Response:
    """The explorer page in live mode: a prompt box that POSTs to /v1/explore."""
    return HTMLResponse(render_explorer(None, endpoint="/v1/explore"))


async def models(server: Server, request: Request) -> Response:
    """The one model; ``chat`` (an extension) says whether /v1/chat/completions can render
    its messages (the web page opens in Chat mode then)."""
    chats = getattr(server.tokenizer, "chat_template", None) is not None
    return JSONResponse({"object": "list", "data": [
        {"id": server.settings.model_name, "object": "model", "created": 0,
         "owned_by": "tinylm", "context_length": server.limits.context_length,
         "chat": chats}]})


async def health(request: Request) -> Response:
    """200 ``{"status": "ok"}`` when ready, else 503 ``{"status": "not ok"}``; only a
    request with the server's API key also learns why (loading, or the load error)."""
    server: Server = request.app.state.server
    if server.ready and not server.tracker.draining:
        return JSONResponse({"status": "ok"})
    body: dict[str, Any] = {"status": "not ok"}
    key = server.settings.api_key
    if key is not None and _key_matches(key, request):
        state = "shutting_down" if server.tracker.draining else \
            "error" if server.load_error else "loading"
        body.update(state=state, message=server.load_error)
    return JSONResponse(body, status_code=503)


async def metrics(request: Request) -> Response:
    server: Server = request.app.state.server
    try:
        _authorize(server, request)
    except RequestError as exc:
        return error_response(exc)
    if server.explorer is not None:
        q = server.explorer
        server.metrics.explore = (q.running, len(q.waiting), q.used)
    return PlainTextResponse(server.metrics.render(),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


async def page(request: Request) -> Response:
    html = resources.files("tinylm.serve").joinpath("page.html").read_text(encoding="utf-8")
    return HTMLResponse(html)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    path = request.url.path
    if exc.status_code == 404 and path.endswith("/") and path.rstrip("/") in ROUTE_PATHS:
        query = request.url.query  # a relative redirect: no Host-derived absolute URL
        return RedirectResponse(path.rstrip("/") + (f"?{query}" if query else ""), 307)
    code = "not_found" if exc.status_code == 404 else None
    return error_response(RequestError(f"{request.method} {request.url.path}: {exc.detail}",
                                       status=exc.status_code, code=code))


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return error_response(RequestError("internal server error (logged on the server)",
                                       status=500, type="server_error"))


ROUTE_PATHS = frozenset({"/explorer", "/health", "/metrics", "/v1/models", "/v1/completions",
                         "/v1/chat/completions", "/v1/explain", "/v1/explore"})


def create_app(server: Server) -> HostGuard:
    """The ASGI app for ``server`` behind the Host check; a server with a loader loads in
    the background at startup (``/health`` answers 503 until it is ready) and every app
    stops its engine at shutdown. ``.app`` is the Starlette app."""
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if server.loader is not None and not server.ready:
            server.load_in_background()
        yield
        server.stop()

    routes = [
        Route("/", page),
        Route("/explorer", explorer_page),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", _endpoint("models", models)),
        Route("/v1/completions", _endpoint("completions", completions, "cmpl-"),
              methods=["POST"]),
        Route("/v1/chat/completions", _endpoint("chat", chat_completions, "chatcmpl-"),
              methods=["POST"]),
        Route("/v1/explain", _endpoint("explain", explain_route), methods=["POST"]),
        Route("/v1/explore", _endpoint("explore", explore_route), methods=["POST"]),
    ]
    assert {r.path for r in routes} - {"/"} == ROUTE_PATHS
    app = Starlette(routes=routes, lifespan=asynccontextmanager(lifespan),
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.router.redirect_slashes = False  # Starlette's redirect is absolute, from Host
    app.state.server = server
    app.state.started = time.time()
    s = server.settings
    return HostGuard(app, host_names(s.host, s.allowed_hosts), s.port,
                     on_refused=lambda status: server.metrics.request("host", status))
