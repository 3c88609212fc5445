"""Reading request fields with errors that name the field (400, never a 500)."""

from __future__ import annotations

import math
from typing import Any

from common.errors import InvalidRequest
from frontend.limits import check_stops

INT64_MAX = (1 << 63) - 1

_MISSING = object()


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def get_number(body: dict, name: str, default: float | None, low: float, high: float) -> float | None:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"'{name}' must be a number, got {_describe(value)}", param=name)
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be between {low} and {high}, got {value}", param=name)
    return float(value)


def get_int(body: dict, name: str, default: int | None, low: int = -INT64_MAX - 1, high: int = INT64_MAX) -> int | None:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"'{name}' must be an integer, got {_describe(value)}", param=name)
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be between {low} and {high}, got {value}", param=name)
    return value


def get_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be a boolean, got {_describe(value)}", param=name)
    return value


def get_str(body: dict, name: str, default: str | None = None, required: bool = False) -> str | None:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise InvalidRequest(f"'{name}' is required", param=name)
        return default
    if not isinstance(value, str):
        raise InvalidRequest(f"'{name}' must be a string, got {_describe(value)}", param=name)
    return value


def get_cache_salt(body: dict) -> str:
    """vLLM's `cache_salt`: requests of different salts share no cached prefix; "" (absent): unsalted."""
    salt = get_str(body, "cache_salt", "")
    if body.get("cache_salt") is not None and not salt:
        raise InvalidRequest("'cache_salt' must be a non-empty string", param="cache_salt")
    return salt


def get_stop(body: dict, name: str) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return check_stops([value], name)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return check_stops(list(value), name)
    raise InvalidRequest(f"'{name}' must be a string or a list of strings", param=name)


def get_int_list(body: dict, name: str, below: int = INT64_MAX) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < below
                                       for i in value):
        return list(value)
    raise InvalidRequest(f"'{name}' must be a list of integers in [0, {below})", param=name)
