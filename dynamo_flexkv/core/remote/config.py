"""RemoteConfig: where the remote (Redis / Redis Cluster) tier lives and how to talk to it.

URL forms (``remote_cache_url``)::

    redis://[[user]:password@]host[:port][/db]          one server
    rediss://...                                        the same over TLS
    redis+cluster://[[user]:password@]host:port[,host:port...]   Redis Cluster (seed nodes)
    rediss+cluster://...                                Redis Cluster over TLS

The password comes from the URL or, when the URL has none, from the environment variable named by
``password_env`` (default ``FLEXKV_REMOTE_PASSWORD``). It is never logged, never in a repr and
never in an exception message: use ``redacted_url`` when naming the server.
"""

from __future__ import annotations

import os
import re
import ssl
from dataclasses import dataclass, field
from urllib.parse import unquote

from dynamo_flexkv.core.durations import is_duration
from dynamo_flexkv.core.errors import FlexKVError

DEFAULT_PORT = 6379
DEFAULT_PASSWORD_ENV = "FLEXKV_REMOTE_PASSWORD"
SCHEMES = {  # scheme -> (tls, cluster)
    "redis": (False, False),
    "rediss": (True, False),
    "redis+cluster": (False, True),
    "rediss+cluster": (True, True),
}
URL_HELP = (
    "use redis://[:password@]host[:port][/db], rediss://... for TLS, or "
    "redis+cluster://[:password@]host:port[,host:port...] for Redis Cluster"
)


class RemoteConfigError(ValueError, FlexKVError):
    """A remote-tier setting is wrong; the message names the key and the fix (never the password)."""


@dataclass(frozen=True)
class ParsedUrl:
    tls: bool
    cluster: bool
    nodes: tuple[tuple[str, int], ...]
    db: int
    username: str | None
    password: str | None = field(repr=False, compare=False)


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*\Z")
# What may stand unencoded in the user name and password (RFC 3986 userinfo: unreserved, sub-delims, ':'),
# and a %XX escape.
_USERINFO = re.compile(r"(?:[A-Za-z0-9._~!$&'()*+,;=:-]|%[0-9A-Fa-f]{2})*\Z")
ENCODE_HELP = (
    "a password (or user name) with / @ : % ? # or spaces must be percent-encoded "
    "(urllib.parse.quote(password, safe=''): / is %2F, @ is %40, : is %3A, % is %25), or left out "
    f"of the URL and set in ${DEFAULT_PASSWORD_ENV} (the variable remote_password_env names)"
)


def _redact(url: str) -> str:
    """``url`` with everything between ``//`` and the last ``@`` (user name and password, however
    malformed) replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    userinfo, at, after = rest.rpartition("@")
    if not at:
        return url
    return f"{scheme}{sep}***@{after}"


def split_password(url: str) -> tuple[str, str | None]:
    """``(url without its password, the password or None)``, for handing the password over by
    environment (``password_env``) while the URL goes into a file: ``redis://user:pw@h:p/1`` gives
    ``redis://user@h:p/1`` and ``pw`` (percent-decoded), ``redis://:pw@h`` gives ``redis://h``.
    The password is what stands between the first ':' and the last '@' after ``//`` (as for
    ``_redact``), so even a URL parse_url refuses keeps none in the text returned."""
    scheme, sep, rest = url.strip().partition("://")
    if not sep:
        scheme, rest = "", url.strip()
    userinfo, at, after = rest.rpartition("@")
    user, colon, raw = userinfo.partition(":")
    if not at or not colon or not raw:
        return url, None
    try:
        password = parse_url(url).password or raw
    except RemoteConfigError:
        password = raw  # unusable as it is; still kept out of the text
    return f"{scheme}{sep}{user + '@' if user else ''}{after}", password


def _host_port(text: str, url_shown: str) -> tuple[str, int]:
    if text.startswith("["):  # [ipv6]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise RemoteConfigError(f"remote_cache_url {url_shown!r} has an empty host: {URL_HELP}")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise RemoteConfigError(f"remote_cache_url {url_shown!r}: port {port_text!r} is not a number in 1..65535")
    return host, int(port_text)


def parse_url(url: str) -> ParsedUrl:
    """Parses a remote URL; errors name ``remote_cache_url``, show the URL without its password
    and say how to write it."""
    if not isinstance(url, str) or not url.strip():
        raise RemoteConfigError(f"remote_cache_url is empty: {URL_HELP}")
    shown = _redact(url.strip())
    scheme, sep, rest = url.strip().partition("://")
    if not sep:
        raise RemoteConfigError(f"remote_cache_url {shown!r} has no scheme: {URL_HELP}")
    if scheme.lower() not in SCHEMES:
        named = f" {scheme!r}" if _SCHEME.match(scheme) else ""
        raise RemoteConfigError(f"remote_cache_url {shown!r} has an unknown scheme{named}: {URL_HELP}")
    tls, cluster = SCHEMES[scheme.lower()]
    # The user name and password end at the last '@' (a host never has one), so a '/', '?' or '#'
    # in an unencoded password cannot make it read as a path, a query or a host.
    userinfo, at, rest = rest.rpartition("@")
    username = password = None
    if at:
        if not _USERINFO.match(userinfo):  # never echo any of it: it holds the password
            raise RemoteConfigError(
                f"remote_cache_url {shown!r}: the user name / password part (before the "
                f"last '@') is not a valid percent-encoded user:password; {ENCODE_HELP}"
            )
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon and pw else None
    netloc_end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    hosts, path = rest[:netloc_end], rest[netloc_end:]
    if path.startswith("?") or "?" in path:
        raise RemoteConfigError(
            f"remote_cache_url {shown!r}: query options are not supported; set TLS and timeouts with the remote_* keys"
        )
    host_list = [h for h in hosts.split(",")]
    if not hosts or any(not h for h in host_list):
        raise RemoteConfigError(f"remote_cache_url {shown!r} names no host (or an empty one): {URL_HELP}")
    if len(host_list) > 1 and not cluster:
        raise RemoteConfigError(
            f"remote_cache_url {shown!r} lists several hosts: use redis+cluster:// "
            f"(or rediss+cluster://) for a Redis Cluster, or name one host"
        )
    nodes = tuple(_host_port(h, shown) for h in host_list)
    db_text = path.strip("/")
    if db_text and not db_text.isdigit():
        raise RemoteConfigError(f"remote_cache_url {shown!r}: database {db_text!r} must be a number (e.g. /0)")
    db = int(db_text or 0)
    if cluster and db:
        raise RemoteConfigError(f"remote_cache_url {shown!r}: Redis Cluster has only database 0; drop /{db}")
    return ParsedUrl(tls, cluster, nodes, db, username, password)


def _check_seconds(name: str, value: object, low: float, what: str, inclusive: bool = False) -> None:
    """The one check of every duration key: a finite real number above ``low`` (at least, when
    ``inclusive``). inf would overflow socket timeouts and PX at open; NaN compares false to all."""
    if not is_duration(value, low, low_ok=inclusive):
        raise RemoteConfigError(f"remote_{name} must be {what}, got {value!r}")


@dataclass(frozen=True)
class RemoteConfig:
    """Settings of the remote tier. The wiring embeds it in CacheConfig as the ``remote_*`` keys
    (``remote_cache_url`` = ``url``, ``remote_timeout_s`` = ``timeout_s``, ...)."""

    url: str = field(repr=False)
    password_env: str = DEFAULT_PASSWORD_ENV
    timeout_s: float = 2.0  # bound on each socket wait; a dead server fails an op within this
    connect_timeout_s: float = 1.0
    ttl_s: float | None = None  # expire values after this long (None: leave it to maxmemory eviction)
    key_prefix: str = "flexkv:"
    pipeline_depth: int = 16  # commands in flight per connection
    pipeline_bytes: int = 4 << 20  # and at most this many value bytes in flight (2 MiB blocks: 2)
    exists_chunk: int = 128  # keys per existence round trip in exists_prefix
    breaker_failures: int = 3  # consecutive failed ops that open the circuit breaker
    breaker_cooldown_s: float = 5.0  # how long an open breaker refuses ops before one trial
    tls_ca_file: str | None = None  # CA bundle for rediss:// (default: the system's)
    tls_verify: bool = True
    # Bytes the blocks of ``tenant`` may hold, accounted in Redis for every store naming the tenant;
    # over it, that tenant's oldest blocks go (remote/quota.py). 0: no quota (maxmemory decides).
    quota_bytes: int = 0
    tenant: str = ""
    parsed: ParsedUrl = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parsed", parse_url(self.url))
        for name in ("timeout_s", "connect_timeout_s", "breaker_cooldown_s"):
            _check_seconds(name, getattr(self, name), 0.0, "a finite positive number of seconds")
        for name in ("pipeline_depth", "pipeline_bytes", "exists_chunk", "breaker_failures"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise RemoteConfigError(f"remote_{name} must be a positive int, got {value!r}")
        if self.ttl_s is not None:
            _check_seconds(
                "ttl_s",
                self.ttl_s,
                0.001,
                "a finite number of at least 0.001 seconds, or null (no expiry)",
                inclusive=True,
            )
        if isinstance(self.quota_bytes, bool) or not isinstance(self.quota_bytes, int) or self.quota_bytes < 0:
            raise RemoteConfigError(f"remote_quota_gb must be >= 0 (0 = no quota), got {self.quota_bytes!r} bytes")
        if not isinstance(self.tenant, str):
            raise RemoteConfigError(f"remote_tenant must be a string, got {type(self.tenant).__name__}")
        if (
            not isinstance(self.key_prefix, str)
            or any(c.isspace() for c in self.key_prefix)
            or "{" in self.key_prefix
            or "}" in self.key_prefix
        ):
            raise RemoteConfigError(
                f"remote_key_prefix {self.key_prefix!r} must be a string without "
                f"spaces or braces (braces would pin every key to one cluster slot)"
            )
        if self.tls_ca_file is not None and not os.path.isfile(self.tls_ca_file):
            raise RemoteConfigError(
                f"remote_tls_ca_file {self.tls_ca_file!r} is not a file: "
                f"point it at the CA bundle that signed the server certificate"
            )
        if not self.parsed.tls and (self.tls_ca_file is not None):
            raise RemoteConfigError(
                "remote_tls_ca_file is set but remote_cache_url is not rediss://: "
                "use rediss:// (or rediss+cluster://) for TLS"
            )

    @property
    def redacted_url(self) -> str:
        """The URL with its password replaced by ***, for logs and errors."""
        return _redact(self.url)

    @property
    def password(self) -> str | None:
        return self.parsed.password if self.parsed.password is not None else (os.environ.get(self.password_env) or None)

    @property
    def nodes(self) -> list[tuple[str, int]]:
        return list(self.parsed.nodes)

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.parsed.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca_file)
        if not self.tls_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx
