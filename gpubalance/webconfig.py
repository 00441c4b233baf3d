"""Web security of the scrape port: TLS, basic auth, response headers and a rate limit.

Read from `--web.config.file`, in the exporter-toolkit format that node_exporter and the official
Prometheus exporters read, so an operator reuses the file they have:
https://github.com/prometheus/exporter-toolkit/blob/master/docs/web-configuration.md

Unknown keys are refused, as the toolkit refuses them. The toolkit keys that Python's ssl module
cannot honour are refused by name with the reason: a security setting silently dropped would be
worse than a refusal. Every endpoint of the port is covered, as the toolkit wraps every handler
of node_exporter. SIGHUP reloads the file; a file that does not load keeps the previous one.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import ipaddress
import logging
import os
import re
import secrets
import socket
import ssl
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import bcrypt
from aiohttp import hdrs, web
from pydantic import BaseModel, ConfigDict, Field

from gpubalance.config import ConfigError, Loc, load_yaml, validate


def parse_listen(value: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``:PORT`` means every interface, ``[::1]:PORT`` for IPv6)."""
    host, sep, port_text = value.rpartition(":")
    if not sep:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host = host.strip("[]") or "0.0.0.0"
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"port must be a number, got {port_text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0..65535, got {port}")
    return host, port


# the environment variable by which `gpubalance run` hands a part the socket it bound for it
INHERITED_LISTENER = "GPUBALANCE_LISTEN_FD"


def inherited_listener(port: int) -> socket.socket | None:
    """The listening socket this process was handed for ``port`` (its file descriptor in
    GPUBALANCE_LISTEN_FD), None when it was handed none. Read once: the variable is taken out
    of the environment, so that no process this one starts takes the socket for its own. A
    descriptor that is not a TCP socket bound to ``port`` is left alone, and logged."""
    value = os.environ.pop(INHERITED_LISTENER, None)
    if value is None:
        return None
    try:
        sock = socket.socket(fileno=int(value))
    except (ValueError, OSError) as exc:
        log.warning("%s=%s is no socket (%s); binding anew", INHERITED_LISTENER, value, exc)
        return None
    bound = sock.getsockname()
    if sock.type != socket.SOCK_STREAM or not isinstance(bound, tuple) or bound[1] != port:
        log.warning(
            "%s=%s is bound to %s, not port %d; binding anew",
            INHERITED_LISTENER,
            value,
            bound,
            port,
        )
        sock.detach()
        return None
    return sock


def is_loopback(host: str) -> bool:
    """Whether a listen host is reachable from this machine only (a host name other than
    localhost may resolve anywhere: it is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


log = logging.getLogger("gpubalance.exporter")

TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}

# Go's names (tls.CipherSuites(), the IANA names) of the TLS 1.2 suites -> OpenSSL's names.
CIPHER_SUITES = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
}
# Go accepts the TLS 1.3 suites in the list and ignores them (they are not configurable in Go
# either); so does this exporter, so that a file written for Go loads here.
TLS13_SUITES = frozenset(
    {"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"}
)

# client_auth_type -> what the server asks of a client. Python's ssl module verifies every
# certificate it asks for, so the toolkit's two "ask but do not verify" policies have no
# equivalent and are refused with the reason (the toolkit itself calls them insecure).
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")

BCRYPT_HASH = re.compile(rb"\$2[abxy]\$(0[4-9]|[12]\d|3[01])\$[./A-Za-z0-9]{53}")
DURATION_PART = r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)"
GO_DURATION = re.compile(f"(?:{DURATION_PART})+")
DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


# The file as written: types and key names; what the values mean is checked after.
class _Tls(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    cert: str | None = None
    key: str | None = Field(None, repr=False)
    client_ca: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    client_auth_type: Literal[
        "NoClientCert",
        "RequestClientCert",
        "RequireAnyClientCert",
        "RequireClientCert",
        "VerifyClientCertIfGiven",
        "RequireAndVerifyClientCert",
    ] = "NoClientCert"
    client_ca_file: str | None = None
    min_version: Literal["TLS10", "TLS11", "TLS12", "TLS13"] = "TLS12"
    max_version: Literal["TLS10", "TLS11", "TLS12", "TLS13"] = "TLS13"
    cipher_suites: list[str] | None = None
    prefer_server_cipher_suites: bool = True
    curve_preferences: Any = None
    client_allowed_sans: Any = None


class _Headers(BaseModel):
    # the toolkit's closed list of headers, with its closed lists of values; blank means unset
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    content_security_policy: str | None = Field(None, alias="Content-Security-Policy")
    x_frame_options: Literal["", "deny", "sameorigin"] | None = Field(None, alias="X-Frame-Options")
    x_content_type_options: Literal["", "nosniff"] | None = Field(
        None, alias="X-Content-Type-Options"
    )
    x_xss_protection: str | None = Field(None, alias="X-XSS-Protection")
    strict_transport_security: str | None = Field(None, alias="Strict-Transport-Security")


class _Http(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # accepted so that the toolkit's files load; aiohttp speaks HTTP/1.1 only
    http2: bool = True
    headers: _Headers | None = None


class _RateLimit(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    interval: str | int = "0"  # a Go duration; the toolkit's comment says "set to 0" to disable
    burst: int = Field(0, ge=0)


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    tls_server_config: _Tls | None = None
    http_server_config: _Http | None = None
    # values are checked by hand: an error must not echo a password written in by mistake
    basic_auth_users: dict[str, Any] | None = None
    rate_limit: _RateLimit | None = None


@dataclass(frozen=True)
class TlsConfig:
    """Checked TLS settings; files are resolved against the web config file's folder."""

    source: str
    cert_file: Path | None
    cert: str | None
    key_file: Path | None
    key: str | None = field(repr=False)
    client_ca_file: Path | None
    client_ca: str | None
    client_auth_type: str
    min_version: ssl.TLSVersion
    max_version: ssl.TLSVersion
    ciphers: str | None  # an OpenSSL cipher list; None: OpenSSL's defaults
    prefer_server_ciphers: bool


@dataclass(frozen=True)
class RateLimit:
    interval_seconds: float
    burst: int


@dataclass(frozen=True)
class WebConfig:
    """A checked web configuration: what the scrape port serves with."""

    source: str
    tls: TlsConfig | None  # None: plain HTTP
    users: Mapping[str, bytes]  # user -> bcrypt hash; empty: no basic auth
    headers: Mapping[str, str]
    rate_limit: RateLimit | None

    def describe(self) -> str:
        parts = ["TLS" if self.tls else "plain HTTP (no TLS)"]
        if self.tls and self.tls.client_auth_type != "NoClientCert":
            parts.append(f"client certificates {self.tls.client_auth_type}")
        users = len(self.users)
        parts.append(
            f"basic auth for {users} user{'s' if users != 1 else ''}" if users else "no auth"
        )
        if self.rate_limit:
            parts.append(
                f"rate limit 1 per {self.rate_limit.interval_seconds:g} s, "
                f"burst {self.rate_limit.burst}"
            )
        return ", ".join(parts)


PLAIN = WebConfig("(no --web.config.file)", None, MappingProxyType({}), MappingProxyType({}), None)


def _where(source: str, lines: Mapping[Loc, int], loc: Loc) -> str:
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return f"{source}:{lines[loc[:end]]}: {'.'.join(str(p) for p in loc)}"
    return f"{source}: {'.'.join(str(p) for p in loc)}"


def load_web_config(path: str | Path) -> WebConfig:
    """Parse and check a web config file; ConfigError names the file, line, key and the fix."""
    path = Path(path)
    source = str(path)
    data, lines = load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}:1: expected a mapping with tls_server_config, http_server_config, "
            f"basic_auth_users or rate_limit, got {type(data).__name__}"
        )
    raw = validate(_File, data, source=source, lines=lines)

    def fail(loc: Loc, message: str) -> ConfigError:
        return ConfigError(f"{_where(source, lines, loc)}: {message}")

    users: dict[str, bytes] = {}
    for user, hashed in (raw.basic_auth_users or {}).items():
        encoded = hashed.encode() if isinstance(hashed, str) else b""
        if not BCRYPT_HASH.fullmatch(encoded):
            raise fail(
                ("basic_auth_users", user),
                "expected a bcrypt hash such as $2y$10$... (make one with "
                "htpasswd -nBC 10 \"\" | tr -d ':\\n'); passwords are never written in clear",
            )
        users[user] = encoded

    headers: dict[str, str] = {}
    if raw.http_server_config and raw.http_server_config.headers:
        dumped = raw.http_server_config.headers.model_dump(by_alias=True)
        headers = {name: value for name, value in dumped.items() if value}

    rate_limit = None
    if raw.rate_limit is not None:
        interval = _parse_duration(raw.rate_limit.interval)
        if interval is None:
            raise fail(
                ("rate_limit", "interval"),
                "expected a duration such as 1s, 500ms or 0 (off), "
                f"got {raw.rate_limit.interval!r}",
            )
        if interval > 0:
            if raw.rate_limit.burst < 1:
                raise fail(
                    ("rate_limit", "burst"),
                    "must be at least 1 when interval is set: burst 0 refuses every request",
                )
            rate_limit = RateLimit(interval, raw.rate_limit.burst)

    tls = None
    # Any key turns TLS on and then needs a certificate and key; the toolkit would serve plain
    # HTTP for, say, min_version alone, which is not what its writer meant.
    if raw.tls_server_config is not None and raw.tls_server_config.model_fields_set:
        tls = _check_tls(raw.tls_server_config, path.parent, source, fail)

    return WebConfig(source, tls, MappingProxyType(users), MappingProxyType(headers), rate_limit)


def _parse_duration(text: str | int) -> float | None:
    """Seconds in a Go duration (time.ParseDuration, as the toolkit reads it), e.g. 1m30s."""
    if text in ("0", 0):
        return 0.0
    if not isinstance(text, str) or not GO_DURATION.fullmatch(text):
        return None
    return sum(
        float(number) * DURATION_UNITS[unit] for number, unit in re.findall(DURATION_PART, text)
    )


def _check_tls(
    tls: _Tls, folder: Path, source: str, fail: Callable[[Loc, str], ConfigError]
) -> TlsConfig:
    section = "tls_server_config"
    if tls.curve_preferences is not None:
        raise fail(
            (section, "curve_preferences"),
            "not supported: Python's ssl module sets no curve preference list; remove it to "
            "use OpenSSL's default groups",
        )
    if tls.client_allowed_sans is not None:
        raise fail(
            (section, "client_allowed_sans"),
            "not supported: client certificates are checked against client_ca_file only; "
            "remove it and let a CA of its own sign the clients' certificates",
        )
    for inline, name in (
        ("cert", "cert_file"),
        ("key", "key_file"),
        ("client_ca", "client_ca_file"),
    ):
        if getattr(tls, inline) and getattr(tls, name):
            raise fail((section, inline), f"set {inline} or {name}, not both")
    if not (tls.cert or tls.cert_file):
        raise fail((section,), "missing one of cert or cert_file (the server's certificate)")
    if not (tls.key or tls.key_file):
        raise fail((section,), "missing one of key or key_file (the server's private key)")

    def readable(name: str, marker: bytes, what: str) -> Path | None:
        value = getattr(tls, name)
        if not value:
            return None
        resolved = folder / value  # an absolute value replaces the folder
        try:
            text = resolved.read_bytes()
        except OSError as exc:
            raise fail((section, name), f"cannot read {resolved}: {exc.strerror or exc}") from None
        if marker not in text:
            raise fail((section, name), f"{resolved}: expected {what} in PEM form")
        return resolved

    cert_file = readable("cert_file", b"-----BEGIN CERTIFICATE-----", "a certificate")
    key_file = readable("key_file", b"PRIVATE KEY-----", "a private key")
    client_ca_file = readable("client_ca_file", b"-----BEGIN CERTIFICATE-----", "CA certificates")
    for inline, marker, what in (
        ("cert", "-----BEGIN CERTIFICATE-----", "a certificate"),
        ("key", "PRIVATE KEY-----", "a private key"),
        ("client_ca", "-----BEGIN CERTIFICATE-----", "CA certificates"),
    ):
        value = getattr(tls, inline)
        if value and marker not in value:
            raise fail((section, inline), f"expected {what} in PEM form")

    if tls.client_auth_type in UNVERIFIED_CLIENT_AUTH:
        raise fail(
            (section, "client_auth_type"),
            f"{tls.client_auth_type} accepts client certificates nobody verified, and Python's "
            "ssl module verifies every certificate it asks for: use RequireAndVerifyClientCert "
            "(or VerifyClientCertIfGiven) with client_ca_file",
        )
    has_ca = bool(tls.client_ca or tls.client_ca_file)
    if has_ca and tls.client_auth_type == "NoClientCert":
        raise fail(
            (section, "client_auth_type"),
            "client CAs are set but client_auth_type is NoClientCert: set "
            "RequireAndVerifyClientCert to check client certificates, or remove the CAs",
        )
    if not has_ca and tls.client_auth_type != "NoClientCert":
        raise fail(
            (section, "client_auth_type"),
            f"{tls.client_auth_type} needs client_ca_file (or client_ca): the CAs that sign "
            "client certificates",
        )
    if TLS_VERSIONS[tls.min_version] > TLS_VERSIONS[tls.max_version]:
        raise fail(
            (section, "min_version"),
            f"{tls.min_version} is above max_version {tls.max_version}",
        )
    ciphers = None
    if tls.cipher_suites:
        for i, name in enumerate(tls.cipher_suites):
            if name not in CIPHER_SUITES and name not in TLS13_SUITES:
                raise fail(
                    (section, "cipher_suites", i),
                    f"unknown cipher suite {name!r}; expected Go's names, one of "
                    f"{', '.join(sorted(CIPHER_SUITES))} (TLS 1.3 suites are always on)",
                )
        chosen = [CIPHER_SUITES[n] for n in tls.cipher_suites if n in CIPHER_SUITES]
        ciphers = ":".join(chosen) or None
    return TlsConfig(
        source=source,
        cert_file=cert_file,
        cert=tls.cert,
        key_file=key_file,
        key=tls.key,
        client_ca_file=client_ca_file,
        client_ca=tls.client_ca,
        client_auth_type=tls.client_auth_type,
        min_version=TLS_VERSIONS[tls.min_version],
        max_version=TLS_VERSIONS[tls.max_version],
        ciphers=ciphers,
        prefer_server_ciphers=tls.prefer_server_cipher_suites,
    )


def build_ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """The server's SSLContext; ConfigError when the certificate and key do not make a pair."""
    where = f"{tls.source}: tls_server_config"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = tls.min_version
    context.maximum_version = tls.max_version
    if tls.prefer_server_ciphers:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    if tls.ciphers:
        try:
            context.set_ciphers(tls.ciphers)
        except ssl.SSLError:
            raise ConfigError(
                f"{where}.cipher_suites: this OpenSSL ({ssl.OPENSSL_VERSION}) offers none of them"
            ) from None
    context.set_alpn_protocols(["http/1.1"])
    cert_name = f"cert_file {tls.cert_file}" if tls.cert_file else "cert"
    key_name = f"key_file {tls.key_file}" if tls.key_file else "key"

    def encrypted() -> bytes:
        # without a callback OpenSSL would prompt on the terminal for a passphrase
        raise ConfigError(
            f"{where}: {key_name} is encrypted; the exporter (like the exporter toolkit) needs "
            "an unencrypted key readable only by its user"
        )

    with tempfile.TemporaryDirectory(prefix="gpubalance-tls-") as folder:
        # inline PEM goes through a private folder: load_cert_chain reads files only
        cert_path, key_path = tls.cert_file, tls.key_file
        if cert_path is None:
            cert_path = Path(folder, "cert.pem")
            cert_path.write_text(tls.cert or "")
        if key_path is None:
            key_path = Path(folder, "key.pem")
            key_path.touch(mode=0o600)
            key_path.write_text(tls.key or "")
        try:
            context.load_cert_chain(cert_path, key_path, password=encrypted)
        except ssl.SSLError as exc:
            if exc.reason == "KEY_VALUES_MISMATCH":
                raise ConfigError(
                    f"{where}: the certificate ({cert_name}) does not match the key ({key_name}); "
                    "give the key the certificate was issued for"
                ) from None
            raise ConfigError(
                f"{where}: cannot load the certificate ({cert_name}) with the key ({key_name}): "
                f"{exc.reason or exc}"
            ) from None
    if tls.client_auth_type != "NoClientCert":
        ca_name = f"client_ca_file {tls.client_ca_file}" if tls.client_ca_file else "client_ca"
        try:
            if tls.client_ca_file:
                context.load_verify_locations(cafile=tls.client_ca_file)
            else:
                context.load_verify_locations(cadata=tls.client_ca)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"{where}: {ca_name}: no usable CA certificate: {exc.reason or exc}"
            ) from None
        context.verify_mode = CLIENT_AUTH[tls.client_auth_type]
    return context


def _length_prefixed(*parts: bytes) -> bytes:
    return b"".join(len(part).to_bytes(4, "big") + part for part in parts)


class BasicAuth:
    """Checks `Authorization: Basic` against bcrypt hashes, as the toolkit does.

    bcrypt is slow by design (about 70 ms at cost 10), so a scrape every second must not cost a
    bcrypt each: answers are cached. The toolkit keys its cache by the plaintext password; this
    one keys it by an HMAC of (user, hash, password) under a key drawn at start, so memory holds
    no password and a changed hash misses. Wrong answers are cached too, so a client stuck on an
    old password costs one bcrypt, not one per scrape. An unknown user is checked against a
    decoy hash of the same cost, so timing does not tell which users exist; bcrypt runs in a
    thread, one at a time (it is CPU-bound), and the event loop keeps serving.
    """

    def __init__(
        self,
        users: Mapping[str, bytes],
        check: Callable[[bytes, bytes], bool] = bcrypt.checkpw,
        cache_size: int = 100,
    ) -> None:
        self._users = users
        self._check = check
        self._cache_size = cache_size
        self._cache: OrderedDict[bytes, bool] = OrderedDict()
        self._key = secrets.token_bytes(32)
        self._lock = asyncio.Lock()
        cost = max(int(h[4:6]) for h in users.values()) if users else 4
        self._decoy = bcrypt.hashpw(secrets.token_bytes(16), bcrypt.gensalt(rounds=cost))

    @staticmethod
    def credentials(header: str | None) -> tuple[str, bytes] | None:
        """(user, password) from an Authorization header, None unless it is well-formed Basic."""
        if not header:
            return None
        scheme, _, encoded = header.strip().partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True)
            user, sep, password = decoded.partition(b":")
            return (user.decode(), password) if sep else None
        except (binascii.Error, UnicodeDecodeError):
            return None

    async def verify(self, header: str | None) -> bool:
        given = self.credentials(header)
        if given is None:
            return False
        user, password = given
        hashed = self._users.get(user)
        known = hashed is not None
        hashed = hashed if hashed is not None else self._decoy
        key = hmac.digest(self._key, _length_prefixed(user.encode(), hashed, password), "sha256")
        matched = self._cache.get(key)
        if matched is None:
            async with self._lock:
                matched = self._cache.get(key)  # another request may have checked it meanwhile
                if matched is None:
                    matched = await asyncio.to_thread(self._matches, password, hashed)
                    self._cache[key] = matched
                    while len(self._cache) > self._cache_size:
                        self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return known and matched

    def _matches(self, password: bytes, hashed: bytes) -> bool:
        try:
            return self._check(password, hashed)
        except ValueError:  # bcrypt refuses passwords over 72 bytes: not a match
            return False


class TokenBucket:
    """The toolkit's rate_limit (Go's rate.Limiter): one token per interval, up to burst."""

    def __init__(self, limit: RateLimit, clock: Callable[[], float] = time.monotonic) -> None:
        self._limit = limit
        self._clock = clock
        self._tokens = float(limit.burst)
        self._last = clock()

    def take(self) -> bool:
        now = self._clock()
        refill = (now - self._last) / self._limit.interval_seconds
        self._tokens = min(float(self._limit.burst), self._tokens + refill)
        self._last = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


def bearer_refusal(authorization: str | None, token: str, setting: str) -> str | None:
    """Why an ``Authorization`` header does not carry ``token`` as a bearer, if it does not
    (``setting`` names where the token is configured)."""
    scheme, _, given = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not given:
        return f"this needs Authorization: Bearer <token> ({setting})"
    # constant time: how much of a guess matches must not show in the answer's timing
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        return "wrong bearer token"
    return None


class WebGuard:
    """The aiohttp side: rate limit, then basic auth, then the route; headers on every answer."""

    def __init__(self, config: WebConfig) -> None:
        self.use(config)

    def use(self, config: WebConfig) -> None:
        # one assignment per field: a request in flight keeps the objects it started with
        self._headers = config.headers
        self._bucket = TokenBucket(config.rate_limit) if config.rate_limit else None
        self._auth = BasicAuth(config.users) if config.users else None

    def install(self, app: web.Application) -> None:
        app.middlewares.append(self.middleware)
        app.on_response_prepare.append(self._add_headers)

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        bucket, auth = self._bucket, self._auth
        if bucket is not None and not bucket.take():
            return web.Response(status=429, text="Too Many Requests\n")
        if auth is not None and not await auth.verify(request.headers.get(hdrs.AUTHORIZATION)):
            return web.Response(
                status=401, text="Unauthorized\n", headers={hdrs.WWW_AUTHENTICATE: "Basic"}
            )
        return await handler(request)

    async def _add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(self._headers)


class WebSecurity:
    """The scrape port: its listening sockets, TLS context and guard, rebuilt on SIGHUP.

    A new TLS context takes over by serving duplicates of the same listening sockets: new
    connections get the new certificate, open ones keep theirs, and since a socket stays open
    throughout, the kernel refuses no connection in between.
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.config = load_web_config(path) if path else PLAIN
        self._context = build_ssl_context(self.config.tls) if self.config.tls else None
        self.guard = WebGuard(self.config)
        self._factory: Callable[[], asyncio.BaseProtocol] | None = None
        self._servers: list[asyncio.Server] = []
        self._reloads: set[asyncio.Task[None]] = set()
        self._reloading = asyncio.Lock()

    def install(self, app: web.Application) -> None:
        self.guard.install(app)

    async def listen(
        self, factory: Callable[[], asyncio.BaseProtocol], host: str, port: int
    ) -> None:
        loop = asyncio.get_running_loop()
        self._factory = factory
        if (sock := inherited_listener(port)) is not None:
            server = await loop.create_server(factory, sock=sock, ssl=self._context)
        else:
            server = await loop.create_server(factory, host, port, ssl=self._context)
        self._servers = [server]

    def urls(self) -> list[str]:
        scheme = "https" if self._context else "http"
        urls = []
        for server in self._servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                urls.append(
                    f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
                )
        return urls

    def reload_soon(self) -> None:
        """The SIGHUP handler: reload in a task (the listener swap awaits)."""
        task = asyncio.get_running_loop().create_task(self.reload())
        self._reloads.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._reloads.discard)

    async def reload(self) -> None:
        assert self.path is not None, "SIGHUP reloads only a --web.config.file"
        async with self._reloading:  # two quick SIGHUPs must not both swap the same sockets
            try:
                config = load_web_config(self.path)
                context = build_ssl_context(config.tls) if config.tls else None
            except ConfigError as exc:
                log.error("%s; keeping the previous web configuration", exc)
                return
            if context is not None or self._context is not None:
                try:
                    await self._serve_anew(context)
                except OSError as exc:
                    log.error(
                        "web config %s: cannot serve anew (%s); keeping the previous",
                        self.path,
                        exc,
                    )
                    return
            self.config = config
            self.guard.use(config)
            log.info("web config %s reloaded: %s", self.path, config.describe())

    async def _serve_anew(self, context: ssl.SSLContext | None) -> None:
        assert self._factory is not None
        loop = asyncio.get_running_loop()
        fresh: list[asyncio.Server] = []
        try:
            for server in self._servers:
                for sock in server.sockets:
                    fresh.append(
                        await loop.create_server(self._factory, sock=sock.dup(), ssl=context)
                    )
        except OSError:
            for server in fresh:
                server.close()
            raise
        for server in self._servers:
            server.close()
        self._servers = fresh
        self._context = context

    def close(self) -> None:
        for server in self._servers:
            server.close()
        self._servers = []
