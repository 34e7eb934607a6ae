"""The OpenAI-compatible routes: chat completions (SSE streaming or not, tools and structured
output), legacy completions and the served model.

Handles in messages are injected as KV for the request's user (``user``, ``safety_identifier``
or ``X-User-Id``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inferscale_apps.server.errors import APIError, ClientGone, api_error
from inferscale_apps.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    misspelled,
    unsupported,
)
from inferscale_apps.server.state import ServerState, State, header_user
from inferscale_apps.server.tools import ToolRequestError, chat_messages, openai_tool_calls, tool_use
from inferscale_engine.errors import ContextOverflowError, InvalidOptionError, InvalidSchemaError
from inferscale_engine.handles import HANDLE_PATTERN
from inferscale_engine.memory.validation import RESERVED_USER_PREFIXES
from inferscale_engine.prompting import openai_usage, structured_options, total_usage, with_memories
from inferscale_engine.request import GenerationOptions
from inferscale_engine.tool_calls import ToolUse, template_renders_tools
from inferscale_engine.types import DEFAULT_USER

logger = logging.getLogger(__name__)

#: How often a non-streaming generation checks that its client is still connected.
DISCONNECT_POLL_S = 0.25

router = APIRouter()


def _options_of(req: ChatCompletionRequest | CompletionRequest) -> GenerationOptions:
    """The request's generation options in the engine's names, checked before any work (a 400
    naming the option); ``max_tokens`` is settled once the prompt's length is known."""
    typo = misspelled(req)
    if typo:
        raise APIError(400, f"unknown parameter {typo[0]!r}: did you mean {typo[1]!r}? (other unknown parameters are "
                            "ignored; this one is refused as it is most likely a misspelling)",
                       param=typo[0], code="unknown_parameter")
    bad = unsupported(req)
    if bad:
        raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
    s: dict[str, Any] = {"temperature": 1.0 if req.temperature is None else req.temperature}
    if req.top_p is not None:
        s["top_p"] = req.top_p
    if req.seed is not None:
        s["seed"] = req.seed
    if req.stop_list():
        s["stop"] = req.stop_list()
    if req.presence_penalty:
        s["presence_penalty"] = req.presence_penalty
    if req.frequency_penalty:
        s["frequency_penalty"] = req.frequency_penalty
    if req.recompute is not None:
        s["recompute"] = req.recompute
    if isinstance(req, ChatCompletionRequest) and req.response_format is not None:
        try:
            structured = structured_options(req.response_format)
        except InvalidSchemaError as exc:  # before any work: vLLM would refuse it only once staged
            raise api_error(exc) from None
        except ValueError as exc:
            raise APIError(400, str(exc), param="response_format", code="unsupported_parameter") from None
        if structured:
            s["structured"] = structured
    try:
        return GenerationOptions.from_kwargs(**s)
    except InvalidOptionError as exc:  # the engine's one check, in its words, naming the option
        raise api_error(exc) from None


def _too_long(state: ServerState, message: str, param: str) -> APIError:
    # OpenAI's and vLLM's wording: litellm and others map it to their context-window error types.
    return APIError(400, f"This model's maximum context length is {state.max_model_len} tokens. {message}",
                    param=param, code="context_length_exceeded")


async def _prepare(state: ServerState, prompt: Any, user: str, requested: int | None, param: str,
                   tools: list[dict[str, Any]] | None = None) -> tuple[list[Any], int]:
    """Render (``tools``: for the chat template), resolve handles once (4xx for bad ones) and
    settle ``max_tokens`` against the context."""
    if requested is not None and requested >= state.max_model_len:
        raise _too_long(state, f"However, you requested {requested} tokens in the completion ({param}), which leaves no "
                               "room for the messages. Please reduce the length of the completion.", param)
    try:
        # With max_tokens (at least 1 to come), a prompt over the context is refused from the
        # memories' token counts, before any of them is read or encoded (that took minutes).
        segments = await asyncio.to_thread(state.engine.resolve, prompt, user_id=user, tools=tools,
                                           max_tokens=requested or 1)
    except ContextOverflowError as exc:
        raise _too_long(state, f"However, the {exc}. Please reduce the length of the messages or completion.",
                               "messages" if requested is None else param) from None
    except Exception as exc:
        raise api_error(exc) from exc
    n = sum(len(s.token_ids) if hasattr(s, "token_ids") else len(s) for s in segments)
    left = state.max_model_len - n
    if left < 1:
        raise _too_long(state, f"However, your messages resulted in {n} tokens (memories included). "
                               "Please reduce the length of the messages.", "messages")
    if requested is None:  # as much as the context leaves, capped by the server default
        requested = min(state.default_max_tokens, left)
    if requested > left:
        raise _too_long(state, f"However, you requested {n + requested} tokens ({n} in the messages, memories included, "
                               f"{requested} in the completion). Please reduce the length of the messages or completion.", param)
    return segments, requested


def _user_of(req: Any, request: Request, uses_memory: bool) -> str:
    """The user whose memories a request may use: ``user``, ``safety_identifier`` or ``X-User-Id``.

    A request that uses memories (handles, ``memory_k``) without naming its user is refused:
    serving it as some default user would silently read or miss the wrong user's facts. So is
    one naming a store key of agent, run or app memories (``@agent:<id>``...): chats are a
    user's, and such a "user" would recall memories that belong to no user.
    """
    header = header_user(request)  # UTF-8, as the memory routes read it: the same user
    given = {k: v for k, v in (("user", req.user), ("safety_identifier", req.safety_identifier),
                               ("X-User-Id", header)) if v}
    if len(set(given.values())) > 1:
        raise APIError(400, "the request names different users: " + ", ".join(f"{k}={v!r}" for k, v in given.items()),
                       param="user", code="conflicting_user")
    if given:
        name, user = next(iter(given.items()))
        if user.startswith(RESERVED_USER_PREFIXES):
            raise APIError(400, f"{name} {user!r} is reserved: ids starting with "
                                f"{', '.join(map(repr, RESERVED_USER_PREFIXES))} hold agent, run and app memories, "
                                "not a user's", param=name, code="reserved_user")
        return user
    if uses_memory:
        raise APIError(400, "this request uses memories (a memory handle or memory_k) but names no user: send "
                            "'user' (or 'safety_identifier') in the body, or an X-User-Id header",
                       param="user", code="user_required")
    return DEFAULT_USER  # nothing in it is scoped by user


async def _run_one(state: ServerState, endpoint: str, segments: list[Any], user: str, options: GenerationOptions,
                   request: Request) -> Any:
    metrics = state.metrics
    metrics.in_flight.inc()
    task = asyncio.ensure_future(state.engine.agenerate_segments(segments, user_id=user, options=options))
    try:
        # A client that hung up gets no answer: stop generating it (cancelling the task
        # aborts the vLLM request), or abandoned requests hold the batch for their full length.
        while not task.done():
            await asyncio.wait((task,), timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                logger.info("client went away: generation aborted")
                raise ClientGone  # the task is cancelled below
        result = await task
    except ClientGone:
        raise
    except Exception as exc:
        raise api_error(exc) from exc
    finally:
        if not task.done():  # this handler was cancelled itself
            task.cancel()
        metrics.in_flight.dec()
    metrics.observe_generation(endpoint, result)
    return result


async def _generate(state: ServerState, endpoint: str, segments: list[Any], user: str, req: Any,
                    options: GenerationOptions, request: Request, use: ToolUse | None = None) -> Response:
    """``use``: a chat's tools, whose calls the answer is read for."""
    rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
    now = int(time.time())
    if not req.stream:
        result = await _run_one(state, endpoint, segments, user, options, request)
        if endpoint == "chat":
            text, calls = use.read(result.text) if use is not None else (result.text, [])
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message.update(content=text or None, tool_calls=openai_tool_calls(calls))
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": "tool_calls" if calls else result.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
            obj = "text_completion"
        return JSONResponse(
            {"id": rid, "object": obj, "created": now, "model": state.model_name, "choices": [choice], "usage": openai_usage(result.usage), "system_fingerprint": None}
        )

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    agen = state.engine.astream_segments(segments, user_id=user, options=options).__aiter__()
    state.metrics.in_flight.inc()
    try:
        first = await agen.__anext__()  # resolution and layout errors become a proper status
    except StopAsyncIteration:
        state.metrics.in_flight.dec()
        raise APIError(500, "generation produced no output", "server_error", None, "internal_error") from None
    except BaseException as exc:  # noqa: BLE001  (re-raised, mapped when an Exception)
        state.metrics.in_flight.dec()
        await agen.aclose()
        if isinstance(exc, Exception):
            raise api_error(exc) from exc
        raise
    return StreamingResponse(
        _sse(state, endpoint, rid, now, first, agen, include_usage, use),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _sse(state: ServerState, endpoint: str, rid: str, now: int, first: Any, agen: AsyncGenerator[Any, None], include_usage: bool,
               use: ToolUse | None = None) -> AsyncIterator[str]:
    """The stream's SSE events. With tools, text is held back where a call may start, and the
    calls come at the end, one ``delta.tool_calls`` chunk each (whole, at its ``index``)."""
    obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
    reader = use.reader() if use is not None else None
    model_name, metrics = state.model_name, state.metrics

    def chunk(delta_text: str | None, finish: str | None = None, role: bool = False,
              tool_call: dict[str, Any] | None = None) -> str:
        if endpoint == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if delta_text is not None:
                delta["content"] = delta_text
            if tool_call is not None:
                delta["tool_calls"] = [tool_call]
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
        body: dict[str, Any] = {"id": rid, "object": obj, "created": now, "model": model_name, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    try:
        if endpoint == "chat":
            yield chunk("", role=True)
        delta, result = first, None
        while True:
            text = reader.feed(delta.text) if reader is not None else delta.text
            if text:
                yield chunk(text)
            if delta.result is not None:
                result = delta.result
                break
            try:
                delta = await agen.__anext__()
            except StopAsyncIteration:
                break
        if result is not None:
            finish = result.finish_reason
            if reader is not None:
                rest, calls = reader.finish()
                if rest:
                    yield chunk(rest)
                for i, call in enumerate(openai_tool_calls(calls)):
                    yield chunk(None, tool_call={"index": i, **call})
                finish = "tool_calls" if calls else finish
            metrics.observe_generation(endpoint, result)
            yield chunk(None if endpoint == "chat" else "", finish=finish)
            if include_usage:
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": now, "model": model_name, "choices": [], "usage": openai_usage(result.usage)}) + "\n\n"
        yield "data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001  (after the 200 went out: report in-band, as OpenAI does)
        err = api_error(exc)
        metrics.errors.labels(err.code or err.type).inc()
        yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        metrics.in_flight.dec()
        await agen.aclose()  # aborts the vLLM request when the client went away


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, state: State) -> Response:
    state.check_model(req.model)
    options = _options_of(req)
    try:
        messages = chat_messages(req)
    except ToolRequestError as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from None
    user = _user_of(req, request, bool(req.memory_k) or any(HANDLE_PATTERN.search(m["content"]) for m in messages))
    if req.memory_k:
        query = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        if query:
            try:
                found = await asyncio.to_thread(state.store().search, query, user_id=user, k=req.memory_k)
            except Exception as exc:
                raise api_error(exc) from exc
            messages = with_memories(messages, [m.handle for m in reversed(found)])  # best last
    # After the memories: a template without tools lists them after the memories' head, so
    # memories are encoded and served after the same text with tools or without.
    try:
        use = tool_use(req, messages, structured=dict(options.structured) if options.structured else None,
                       native=template_renders_tools(state.engine.tokenizer))
    except ToolRequestError as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from None
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    segments, max_tokens = await _prepare(state, use.messages, user, requested, param, use.tools)
    options = dataclasses.replace(options, max_tokens=max_tokens, structured=use.structured)
    return await _generate(state, "chat", segments, user, req, options, request, use)


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, state: State) -> Response:
    state.check_model(req.model)
    options = _options_of(req)
    prompts = req.prompt if isinstance(req.prompt, list) else [req.prompt]
    if not prompts:
        raise APIError(400, "prompt is empty", param="prompt", code="invalid_request")
    for i, p in enumerate(prompts):
        if not p:
            raise APIError(400, "prompt is empty" if len(prompts) == 1 else f"prompt[{i}] is empty", param="prompt",
                           code="invalid_request")
    user = _user_of(req, request, any(HANDLE_PATTERN.search(p) for p in prompts))
    if len(prompts) == 1:
        segments, max_tokens = await _prepare(state, prompts[0], user, req.max_tokens, "max_tokens")
        return await _generate(state, "completion", segments, user, req, dataclasses.replace(options, max_tokens=max_tokens),
                               request)
    if req.stream:
        raise APIError(400, "streaming is supported for one prompt per request; send a list of prompts without "
                            "stream, or one request per prompt", param="stream", code="unsupported_parameter")
    # Every prompt is checked before any is generated, so a bad one costs no generation.
    prepared = [await _prepare(state, p, user, req.max_tokens, "max_tokens") for p in prompts]
    results = await asyncio.gather(*(_run_one(state, "completion", seg, user, dataclasses.replace(options, max_tokens=mt),
                                              request) for seg, mt in prepared))
    usage = openai_usage(total_usage(r.usage for r in results))
    return JSONResponse({
        "id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
        "choices": [{"index": i, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason} for i, r in enumerate(results)],
        "usage": usage, "system_fingerprint": None,
    })


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "inferscale",
            "root": str(getattr(state.engine, "model_path", state.model_name)), "max_model_len": state.max_model_len}


@router.get("/v1/models")
async def models(state: State) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, state: State) -> dict[str, Any]:
    state.check_model(model_id)
    return _model_card(state)

