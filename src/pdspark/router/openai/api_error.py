"""`ApiError`: a request the router refuses, as OpenAI's error object `{"error": {"message", "type", "param",
"code"}}` (the `ErrorResponse` model), and the mapping from a pydantic `ValidationError` to one.

Statuses: 400 a value out of range, not allowed or not supported (and malformed JSON); 422 a field of the wrong
JSON type or a required field missing; 404 an unknown model. `param` names the field as the client wrote it
(`messages[0].content[1].type`); `code` is the kind of problem (`less_than_equal`, `int_type`, ...).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError


class ErrorDetail(BaseModel):
    """Every key is always present; `param` and `code` may be null."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def param_of(loc: tuple[int | str, ...]) -> str | None:
    """`("messages", 0, "content", "<parts>", 1, "type")` -> `messages[0].content[1].type`. Union member tags
    (written `<like this>`, see `sampling_fields.by_json_type`) are not part of what the client wrote."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith("<"):
            out += f".{part}" if out else part
    return out or None


def _wrong_type(kind: str) -> bool:
    return kind == "missing" or kind.endswith(("_type", "_parsing")) or kind == "int_from_float"


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def from_validation_error(e: ValidationError) -> ApiError:
    """The first of pydantic's errors as an `ApiError` (fields are checked in the order they are declared)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    kind, loc, msg = first["type"], first["loc"], first["msg"]
    if kind == "json_invalid":
        return ApiError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', msg)}", code="invalid_json")
    if not loc:
        return ApiError(400, "the request body must be a JSON object", code=kind)
    param = param_of(loc)
    if kind == "missing":
        message = f"`{param}` is required"
    else:
        value = first.get("input")
        got = f" (got {_shown(value)})" if isinstance(value, (str, int, float, bool)) or value is None else ""
        message = f"`{param}`: {msg}{got}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return ApiError(422 if _wrong_type(kind) else 400, message, param, kind)
