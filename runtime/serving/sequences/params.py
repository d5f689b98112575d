"""What a request says about sequences: Triton's sequence parameters (`parse_parameters`,
`names_sequence`) and the tenant that owns them (`tenant_of`, `request_tenant`,
`tenant_hash`); and `SequenceError`, the refusal of a sequence request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any, Callable, Iterable, Mapping

from kiln.runtime.serving.tensors import shown
from kiln.runtime.serving.refusals import Kind, Refusal

# The tenant: the header a gateway sets (and strips from clients), else the bearer token.
TENANT_HEADER = "Kiln-Tenant"
# A longer tenant is refused, never cut: a cut makes two identities one tenant.
MAX_TENANT_BYTES = 4096
# What both doors deliver alike: gRPC's legal metadata values. Beyond them aiohttp and gRPC
# decode the same bytes differently (surrogates, latin-1), so one identity could be two.
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")
# HTTP's optional whitespace: never part of an HTTP value, so not of a gRPC one either.
_OWS = " \t"
# A string sequence_id: what is safe in a Redis key and a log line.
_SEQUENCE_ID = re.compile(r"[A-Za-z0-9._~:@+=-]{1,128}")
_MAX_SEQUENCE_INT = 2 ** 64 - 1


class SequenceError(Refusal):
    """A sequence request the server refuses: its kind, a message, and the seconds to wait
    before a retry where waiting can help (each transport answers the kind its own way)."""


@dataclasses.dataclass(frozen=True)
class SequenceParams:
    id: str  # the sequence_id as a string (int 7 and "7" are one sequence)
    start: bool
    end: bool


def names_sequence(params: Mapping[str, Any] | None) -> bool:
    """Whether a request's parameters name a sequence: a sequence_id other than Triton's
    0 or "" for none. The one reading every caller uses (tenancy, joining, routing)."""
    return bool(params) and params.get("sequence_id") not in (None, 0, "")


def parse_parameters(params: Mapping[str, Any] | None) -> SequenceParams | None:
    """Triton's sequence parameters of a request -> SequenceParams, or None when the request
    names no sequence (no sequence_id, or Triton's 0 / "" for none). Bad values are refused
    (Kind.INVALID)."""
    params = params or {}
    raw = params.get("sequence_id")
    start, end = (_bool_param(params, n) for n in ("sequence_start", "sequence_end"))
    if not names_sequence(params):
        if start or end:
            raise _invalid("sequence_start and sequence_end need a sequence_id parameter")
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise _invalid(f"parameter 'sequence_id' must be a positive integer or a string, "
                       f"got {shown(raw)}")
    if isinstance(raw, int):
        if not 0 < raw <= _MAX_SEQUENCE_INT:
            raise _invalid(f"parameter 'sequence_id' must be 1..{_MAX_SEQUENCE_INT}, "
                           f"got {shown(raw)}")
        ident = str(raw)
    else:
        if not _SEQUENCE_ID.fullmatch(raw):
            raise _invalid(f"parameter 'sequence_id' {shown(raw)}: a string id is 1 to 128 "
                           f"characters of letters, digits and ._~:@+=-")
        ident = raw
    return SequenceParams(ident, start, end)


def _bool_param(params: Mapping[str, Any], name: str) -> bool:
    value = params.get(name, False)
    if not isinstance(value, bool):
        raise _invalid(f"parameter '{name}' must be true or false, got {shown(value)}")
    return value


def tenant_of(headers: Iterable[tuple[str, str]]) -> str:
    """The tenant a request's sequences belong to: the `Kiln-Tenant` header (which the
    gateway in front of Kiln sets from the caller's identity, and strips when a client sends
    it), else the sha256 of the `Authorization` header (the bearer token), else "" (every
    anonymous caller is one tenant).

    `headers`: every (name, value) pair as received, repeats included: aiohttp's
    `headers.items()` and gRPC's invocation metadata alike, so both doors decide the same.
    Refused (Kind.INVALID): a repeated header (the first would win over HTTP, the last over
    gRPC), an empty one, one over MAX_TENANT_BYTES, or one that is not printable ASCII."""
    tenants, tokens = [], []
    for name, value in headers:
        key = name.lower()
        if key == TENANT_HEADER.lower():
            tenants.append(value)
        elif key == "authorization":
            tokens.append(value)
    if tenants:
        return "h:" + _identity(TENANT_HEADER, tenants, MAX_TENANT_BYTES)
    if tokens:
        return "t:" + hashlib.sha256(_identity("Authorization", tokens).encode()).hexdigest()
    return ""


def _identity(header: str, values: list[str], most: int | None = None) -> str:
    if len(values) > 1:
        raise _invalid(f"the request has {len(values)} {header} headers; it belongs to one "
                       f"tenant (a gateway must replace the header, not add another)")
    value = values[0].strip(_OWS)
    if not value:
        raise _invalid(f"the {header} header is empty; it names the tenant that owns the "
                       f"request's sequence")
    if most is not None and len(value) > most:
        raise _invalid(f"the {header} header has {len(value)} characters; a tenant has at most "
                       f"{most} (it is never cut short: two tenants would become one)")
    printable = _PRINTABLE_ASCII.match(value).end()
    if printable < len(value):
        raise _invalid(f"the {header} header must be printable ASCII (0x20-0x7E): character "
                       f"{printable + 1} is not")
    return value


def _invalid(message: str) -> SequenceError:
    return SequenceError(Kind.INVALID, message)


def request_tenant(parameters: Mapping[str, Any] | None,
                   headers: Callable[[], Iterable[tuple[str, str]]]) -> str:
    """The tenant of a request that names a sequence (`tenant_of` its `headers()`), else ""
    without reading them: stateless requests pay nothing for tenancy."""
    return tenant_of(headers()) if names_sequence(parameters) else ""


def tenant_hash(tenant: str) -> str:
    """The tenant as the store's keys hold it: fixed length, never the identity itself."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]

