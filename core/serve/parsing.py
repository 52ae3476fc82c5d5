"""Reading a request body into a validated request model; every failure is a 400 naming the problem.

`extra_body`: the official openai client merges its `extra_body=` argument into the top-level JSON, while the
DeepInfer example client sends an `extra_body` object inside the JSON. Both reach the same fields: the object's
keys are lifted to the top level. A key given in both places with different values is ambiguous: a 400.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from deepinfer.serve.errors import BadRequestError, validation_error

M = TypeVar("M", bound=BaseModel)


async def read_json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        raise BadRequestError("the request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise BadRequestError("the request body is not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise BadRequestError(f"the request body is not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})") from None
    if not isinstance(data, dict):
        raise BadRequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def lift_extra_body(data: dict[str, Any]) -> dict[str, Any]:
    extra = data.get("extra_body")
    if extra is None:
        return {k: v for k, v in data.items() if k != "extra_body"}
    if not isinstance(extra, dict):
        raise BadRequestError("extra_body must be a JSON object", param="extra_body")
    merged = {k: v for k, v in data.items() if k != "extra_body"}
    for key, value in extra.items():
        if key == "extra_body":
            raise BadRequestError("extra_body cannot be nested", param="extra_body")
        if key in merged and merged[key] != value:
            raise BadRequestError(f"{key} is given both at top level and in extra_body, with different values",
                                  param=f"extra_body.{key}")
        merged[key] = value
    return merged


async def parse_request(request: Request, model: type[M]) -> M:
    data = lift_extra_body(await read_json_object(request))
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise validation_error(err) from None
