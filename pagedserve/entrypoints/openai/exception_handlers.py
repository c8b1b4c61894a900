"""Every error the app answers with, in the API's own error shape (OpenAI's, or
Anthropic's on its paths): the routes' own OpenAIErrors and the engine's refusals,
FastAPI's body validation (a 400 naming the field, where FastAPI would send a 422 in
its own shape), and Starlette's 404s and 405s."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine.async_llm import EngineDeadError, EngineShutdownError, RequestTimeoutError
from pagedserve.entrypoints.openai.http_utils import error_response, route_path
from pagedserve.entrypoints.openai.serving_engine import OpenAIError, to_openai_error
from pagedserve.errors import InvalidRequestError, OverloadedError

# pydantic's union-member tags in an error's location ("str", "list[int]"): not fields.
UNION_TAG = re.compile(r"(str|int|float|bool|list\[.*\]|dict\[.*\])")


async def on_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(to_openai_error(exc), route_path(request.scope))


def first_error(errors: Sequence[Any], skip: int = 0) -> OpenAIError:
    """pydantic's first error as a 400 whose param is the field's top-level name: a model
    validator's own refusal with its param, else "where: what" (`skip`: leading location
    parts that are not fields, FastAPI's "body" or "query"; union-member tags dropped)."""
    first = errors[0] if errors else {}
    raised = first.get("ctx", {}).get("error")
    if isinstance(raised, InvalidRequestError):
        return to_openai_error(raised)
    loc = [str(x) for x in first.get("loc", ())[skip:] if not UNION_TAG.fullmatch(str(x))]
    return OpenAIError(f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}",
                       param=loc[0] if loc else None)


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """The first error, as a 400 whose param is the field's top-level name."""
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":  # loc is ("body", character offset): not a field
        return error_response(OpenAIError(f"The request body is not valid JSON ({errors[0].get('msg', 'invalid')} "
                                          f"at character {errors[0].get('loc', ('', '?'))[-1]})."), route_path(request.scope))
    return error_response(first_error(errors, skip=1), route_path(request.scope))


async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(OpenAIError(str(exc.detail), status=exc.status_code,
                                      type="invalid_request_error" if exc.status_code < 500 else "server_error",
                                      headers=exc.headers),  # (a 405's Allow)
                          route_path(request.scope))


def add_exception_handlers(app: FastAPI) -> None:
    for exc_class in (OpenAIError, ValueError, EngineDeadError, OverloadedError, RequestTimeoutError,
                      EngineShutdownError, Exception):
        app.add_exception_handler(exc_class, on_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
