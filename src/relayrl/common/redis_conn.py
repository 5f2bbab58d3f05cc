"""The one place that builds Redis clients (sync and asyncio) from the ``redis`` config section.

URL: ``redis.url``, else the environment variable ``redis.url_env``. Password: the environment variable
``redis.password_env`` when set, over a password in the URL (redis-py's ``from_url`` would let the URL win, so the
URL is parsed here and the connection options are merged explicitly). User: ``redis.username``, else the URL's.
TLS: on for ``rediss://`` URLs, the server's certificate verified (against ``redis.tls_ca_file`` or the system
trust store) and its host name checked; a client certificate is presented when ``redis.tls_cert_file`` is set.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import parse_url as parse_async_url
from redis.connection import parse_url

from relayrl.config.redis import RedisConfig


def connection_options(cfg: RedisConfig, url: str, options: dict[str, Any]) -> dict[str, Any]:
    """The connection-pool options for ``url`` (already parsed into ``options``) under ``cfg``'s credentials
    and TLS files. Never logged: the result holds the password."""
    password = cfg.effective_password()
    if password:
        options["password"] = password
    if cfg.username:
        options["username"] = cfg.username
    if url.startswith("rediss://"):
        options["ssl_cert_reqs"] = "required"
        options["ssl_check_hostname"] = True
        if cfg.tls_ca_file:
            options["ssl_ca_certs"] = cfg.tls_ca_file
        if cfg.tls_cert_file:
            options["ssl_certfile"] = cfg.tls_cert_file
            options["ssl_keyfile"] = cfg.tls_key_file
    return options


def sync_client(cfg: RedisConfig, **kwargs: Any) -> redis.Redis:
    """A blocking client of the run's Redis (``kwargs``: further pool options, e.g. ``socket_timeout``)."""
    url = cfg.require_url()
    options = connection_options(cfg, url, {**kwargs, **parse_url(url)})
    return redis.Redis.from_pool(redis.ConnectionPool(**options))


def async_client(cfg: RedisConfig, **kwargs: Any) -> aioredis.Redis:
    """An asyncio client of the run's Redis (``kwargs``: further pool options, e.g. ``decode_responses``)."""
    url = cfg.require_url()
    options = connection_options(cfg, url, {**kwargs, **parse_async_url(url)})
    return aioredis.Redis.from_pool(aioredis.ConnectionPool(**options))
