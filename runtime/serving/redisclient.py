"""The one way Kiln talks to a Redis (the sequence store, the shared result level):
`redis_client` (redis.asyncio, every socket operation bounded, no retries of its own) and
`bounded_call` (a command within the store's timeout; what fails becomes StoreUnavailable
with a message that says which store and why)."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable


class StoreUnavailable(Exception):
    """The store did not answer in time, refused the connection or the credentials, or
    failed the command."""


def redis_client(address: str, password: str | None, timeout: float) -> Any:
    """A redis.asyncio client: host:port or a redis:// / rediss:// URL, every socket
    operation bounded by `timeout`, and no retries (a failure is the caller's at once)."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    url = address if "://" in address else f"redis://{address}"
    return aioredis.Redis.from_url(url, password=password or None, socket_timeout=timeout,
                                   socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0),
                                   health_check_interval=0)


async def bounded_call(coro: Awaitable[Any], *, timeout: float, where: str, what: str,
                       password_env: str) -> Any:
    """Await one store command within `timeout`. A timeout, refused credentials or a lost
    connection raise StoreUnavailable naming `where` (the store) and `what` (the command);
    a command Redis refused (redis.exceptions.ResponseError) is the caller's to map."""
    import redis.exceptions as rx

    try:
        async with asyncio.timeout(timeout):
            return await coro
    except TimeoutError:
        raise StoreUnavailable(f"{where} did not answer {what} within {timeout * 1000:g} ms") from None
    except rx.AuthenticationError as e:
        raise StoreUnavailable(f"{where} refused the credentials ({e}); check the Secret behind "
                               f"{password_env}") from None
    except (rx.ConnectionError, rx.TimeoutError, OSError) as e:
        raise StoreUnavailable(f"{where} cannot be reached: {e}") from None
