"""Which model a request is for: the name from its path (REST) or message (gRPC); the
namespace from a `kiln-namespace` header or metadata when the client sends one, else from
the Host (`<model>.<namespace>.svc[...]`, what an HTTP client of the model's Service
sends; grpc.aio does not show a server the call's :authority), else the one namespace the
table knows that name in (a short `<model>:8080`, and gRPC), else the activator's default."""

from __future__ import annotations

from kiln.activator.table import Key, Table

NAMESPACE_HEADER = "kiln-namespace"


def namespace_from_host(host: str | None) -> str | None:
    if not host:
        return None
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host  # an IPv6 literal has no namespace
    parts = name.lower().split(".")
    if len(parts) < 2 or all(p.isdigit() for p in parts) or "[" in name:
        return None
    if len(parts) == 2 or parts[2] == "svc":
        return parts[1] or None
    return None


def model_key(model: str, host: str | None, table: Table, default_namespace: str | None,
              named: str | None = None) -> Key | None:
    """`named`: the namespace the request's kiln-namespace header or metadata gives."""
    namespace = named or namespace_from_host(host) or table.namespace_of(model) or default_namespace
    return (namespace, model) if namespace else None
