"""The web config file (exporter-toolkit format): parsing, bad input named, basic auth, rate limit.

Certificates, TLS and the running exporter are in test_web_tls.py.
"""

from __future__ import annotations

import asyncio
import base64
import re
import shutil
import ssl
import subprocess
from pathlib import Path

import bcrypt
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gpubalance.config import ConfigError
from gpubalance.webconfig import (
    CIPHER_SUITES,
    BasicAuth,
    RateLimit,
    TokenBucket,
    WebGuard,
    load_web_config,
)

ROOT = Path(__file__).resolve().parents[2]
PEM_CERT = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
PEM_KEY = "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"
# cost 4, the lowest bcrypt allows: these tests check logic, not bcrypt's speed
ALICE = bcrypt.hashpw(b"alice-password", bcrypt.gensalt(rounds=4)).decode()


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "server.crt").write_text(PEM_CERT)
    (tmp_path / "server.key").write_text(PEM_KEY)
    (tmp_path / "ca.crt").write_text(PEM_CERT)
    return tmp_path


def write(folder: Path, text: str) -> Path:
    path = folder / "web.yml"
    path.write_text(text)
    return path


def test_a_toolkit_file_loads_with_every_supported_key(folder: Path) -> None:
    path = write(
        folder,
        f"""\
tls_server_config:
  cert_file: server.crt
  key_file: {folder}/server.key
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: ca.crt
  min_version: TLS13
  max_version: TLS13
  cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, TLS_AES_128_GCM_SHA256]
  prefer_server_cipher_suites: false
http_server_config:
  http2: true
  headers:
    X-Frame-Options: deny
    X-Content-Type-Options: nosniff
    Strict-Transport-Security: max-age=31536000
    Content-Security-Policy: ""
basic_auth_users:
  alice: {ALICE}
rate_limit:
  interval: 1m30s
  burst: 20
""",
    )
    config = load_web_config(path)
    tls = config.tls
    assert tls is not None
    # relative paths are read from the web config file's folder, as the toolkit reads them
    assert tls.cert_file == folder / "server.crt"
    assert tls.key_file == folder / "server.key"
    assert tls.client_ca_file == folder / "ca.crt"
    assert tls.client_auth_type == "RequireAndVerifyClientCert"
    assert (tls.min_version, tls.max_version) == (ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_3)
    assert tls.ciphers == "ECDHE-RSA-AES128-GCM-SHA256"
    assert tls.prefer_server_ciphers is False
    assert dict(config.headers) == {
        "X-Frame-Options": "deny",
        "X-Content-Type-Options": "nosniff",
        "Strict-Transport-Security": "max-age=31536000",
    }
    assert dict(config.users) == {"alice": ALICE.encode()}
    assert config.rate_limit == RateLimit(interval_seconds=90.0, burst=20)
    assert config.describe() == (
        "TLS, client certificates RequireAndVerifyClientCert, basic auth for 1 user, "
        "rate limit 1 per 90 s, burst 20"
    )


def test_an_empty_file_or_users_alone_serve_plain_http(folder: Path) -> None:
    assert load_web_config(write(folder, "")).tls is None
    config = load_web_config(write(folder, f"basic_auth_users:\n  alice: '{ALICE}'\n"))
    assert config.tls is None
    assert list(config.users) == ["alice"]
    assert load_web_config(write(folder, "rate_limit:\n  interval: 0\n")).rate_limit is None


def test_inline_certificate_and_key(folder: Path) -> None:
    indented_cert = PEM_CERT.replace("\n", "\n    ")
    indented_key = PEM_KEY.replace("\n", "\n    ")
    text = f"tls_server_config:\n  cert: |\n    {indented_cert}\n  key: |\n    {indented_key}\n"
    tls = load_web_config(write(folder, text)).tls
    assert tls is not None
    assert tls.cert_file is None and tls.cert == PEM_CERT
    assert tls.key == PEM_KEY
    assert PEM_KEY not in repr(tls)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # node_exporter's pre-toolkit name of the section
        ("tls_config:\n  cert_file: server.crt\n", "web.yml:1: tls_config: unknown key"),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  client_auth: RequireAndVerifyClientCert\n",
            "web.yml:4: tls_server_config.client_auth: unknown key",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  client_auth_type: Required\n",
            "web.yml:4: tls_server_config.client_auth_type: Input should be 'NoClientCert',",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  client_auth_type: RequireAnyClientCert\n  client_ca_file: ca.crt\n",
            "web.yml:4: tls_server_config.client_auth_type: RequireAnyClientCert accepts client "
            "certificates nobody verified",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  client_ca_file: ca.crt\n",
            "tls_server_config.client_auth_type: client CAs are set but client_auth_type is "
            "NoClientCert",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  client_auth_type: RequireAndVerifyClientCert\n",
            "web.yml:4: tls_server_config.client_auth_type: RequireAndVerifyClientCert needs "
            "client_ca_file",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n",
            "web.yml:1: tls_server_config: missing one of key or key_file",
        ),
        (
            "tls_server_config:\n  client_auth_type: NoClientCert\n",
            "web.yml:1: tls_server_config: missing one of cert or cert_file",
        ),
        # the toolkit would serve plain HTTP here; its writer meant TLS
        (
            "tls_server_config:\n  min_version: TLS13\n",
            "web.yml:1: tls_server_config: missing one of cert or cert_file",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: missing.key\n",
            "web.yml:3: tls_server_config.key_file: cannot read ",
        ),
        (
            "tls_server_config:\n  cert_file: server.key\n  key_file: server.key\n",
            "web.yml:2: tls_server_config.cert_file: ",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  cert: x\n  key_file: server.key\n",
            "web.yml:3: tls_server_config.cert: set cert or cert_file, not both",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  min_version: TLS13\n  max_version: TLS12\n",
            "web.yml:4: tls_server_config.min_version: TLS13 is above max_version TLS12",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  min_version: TLS1.2\n",
            "web.yml:4: tls_server_config.min_version: Input should be 'TLS10', 'TLS11', "
            "'TLS12' or 'TLS13'",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  cipher_suites:\n    - TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256\n"
            "    - ECDHE-RSA-AES256-GCM-SHA384\n",
            "web.yml:6: tls_server_config.cipher_suites.1: unknown cipher suite "
            "'ECDHE-RSA-AES256-GCM-SHA384'; expected Go's names",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  curve_preferences: [X25519]\n",
            "web.yml:4: tls_server_config.curve_preferences: not supported",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  client_allowed_sans: [scraper.example]\n",
            "web.yml:4: tls_server_config.client_allowed_sans: not supported",
        ),
        (
            "http_server_config:\n  headers:\n    Server: gpubalance\n",
            "web.yml:3: http_server_config.headers.Server: unknown key",
        ),
        (
            "http_server_config:\n  headers:\n    X-Frame-Options: allow\n",
            "web.yml:3: http_server_config.headers.X-Frame-Options: Input should be '', 'deny' "
            "or 'sameorigin'",
        ),
        (
            "http_server_config:\n  http2: yes please\n",
            "web.yml:2: http_server_config.http2: expected true or false, got 'yes please'",
        ),
        (
            "rate_limit:\n  interval: 1 second\n  burst: 5\n",
            "web.yml:2: rate_limit.interval: expected a duration such as 1s, 500ms or 0",
        ),
        (
            "rate_limit:\n  interval: 5\n  burst: 5\n",
            "web.yml:2: rate_limit.interval: expected a duration such as 1s, 500ms or 0",
        ),
        (
            "rate_limit:\n  interval: 1s\n",
            "web.yml:1: rate_limit.burst: must be at least 1 when interval is set",
        ),
        ("- alice\n", "web.yml:1: expected a mapping with tls_server_config"),
        ("basic_auth_users: [alice\n", "web.yml:2: not valid YAML"),
    ],
)
def test_bad_config_names_file_line_key_and_expectation(
    folder: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as error:
        load_web_config(write(folder, text))
    assert message in str(error.value)


@pytest.mark.parametrize(
    "value",
    ["hunter2-plain", "$2y$10$tooshort", "12345", "$2$04$" + ALICE[7:]],
    # ALICE is hashed afresh at each import: a fixed id keeps the test's name the same in every
    # process that collects it (pytest-xdist's workers must agree on the names)
    ids=["plain", "short", "digits", "unknown-prefix"],
)
def test_a_bad_hash_is_named_without_echoing_it(folder: Path, value: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_web_config(write(folder, f"basic_auth_users:\n  alice: {ALICE}\n  bob: {value}\n"))
    assert "web.yml:3: basic_auth_users.bob: expected a bcrypt hash" in str(error.value)
    assert value not in str(error.value)


def test_toolkit_hashes_load_in_every_bcrypt_prefix(folder: Path) -> None:
    # the toolkit's own sample file uses $2y$ (htpasswd); Python's bcrypt writes $2b$
    sample = "$2y$10$mDwo.lAisC94iLAyP81MCesa29IzH37oigHC/42V2pdJlUprsJPze"
    config = load_web_config(write(folder, f"basic_auth_users:\n  alice: {sample}\n  b: {ALICE}"))
    assert set(config.users) == {"alice", "b"}


def test_every_cipher_suite_name_maps_to_this_openssl() -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for go_name, openssl_name in CIPHER_SUITES.items():
        context.set_ciphers(openssl_name)
        tls12 = [c["name"] for c in context.get_ciphers() if c["protocol"] != "TLSv1.3"]
        assert tls12 == [openssl_name], go_name


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl: apt-get install openssl")
def test_cipher_suite_names_are_the_iana_names_of_the_openssl_suites() -> None:
    listing = subprocess.run(
        ["openssl", "ciphers", "-stdname", "ALL:@SECLEVEL=0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    standard = dict(re.findall(r"^(\S+) +- (\S+)", listing, re.MULTILINE))
    for go_name, openssl_name in CIPHER_SUITES.items():
        assert standard.get(go_name) == openssl_name


def test_the_readme_example_loads(folder: Path) -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    examples = [b for b in blocks if b.startswith("tls_server_config:")]
    assert examples, "the README shows a web config file"
    for text in examples:
        config = load_web_config(write(folder, text))
        assert config.tls is not None and config.users


class CountingCheck:
    """bcrypt.checkpw, counted: how many bcrypt runs the requests cost."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, password: bytes, hashed: bytes) -> bool:
        self.calls += 1
        return bcrypt.checkpw(password, hashed)


def test_basic_auth_answers() -> None:
    auth = BasicAuth({"alice": ALICE.encode()})

    async def answers() -> list[bool]:
        headers = [
            basic("alice", "alice-password"),
            "basic " + basic("alice", "alice-password").split()[1],  # the scheme is caseless
            basic("alice", "wrong"),
            basic("bob", "alice-password"),
            basic("alice", "alice-password" + "x" * 80),  # over bcrypt's 72 bytes
            "Bearer abc",
            "Basic not-base64!",
            "Basic " + base64.b64encode(b"no-colon").decode(),
            "",
        ]
        return [await auth.verify(h) for h in [*headers, None]]

    assert asyncio.run(answers()) == [True, True] + [False] * 8


def test_verified_answers_are_cached_without_the_password() -> None:
    check = CountingCheck()
    auth = BasicAuth({"alice": ALICE.encode()}, check=check)

    async def scrapes() -> None:
        for _ in range(20):
            assert await auth.verify(basic("alice", "alice-password"))
            assert not await auth.verify(basic("alice", "stale-password"))

    asyncio.run(scrapes())
    assert check.calls == 2  # one bcrypt per distinct answer, not one per request
    cached = b"".join(auth._cache)
    assert b"alice-password" not in cached and b"stale-password" not in cached


def test_the_cache_is_bounded_and_concurrent_requests_share_one_bcrypt() -> None:
    check = CountingCheck()
    auth = BasicAuth({"alice": ALICE.encode()}, check=check, cache_size=3)

    async def requests() -> list[bool]:
        same = [auth.verify(basic("alice", "alice-password")) for _ in range(10)]
        return list(await asyncio.gather(*same))

    assert asyncio.run(requests()) == [True] * 10
    assert check.calls == 1

    async def guesses() -> None:
        for i in range(10):
            assert not await auth.verify(basic("alice", f"guess-{i}"))

    asyncio.run(guesses())
    assert len(auth._cache) == 3


def test_the_rate_limit_is_a_token_bucket() -> None:
    now = [0.0]
    bucket = TokenBucket(RateLimit(interval_seconds=2.0, burst=2), clock=lambda: now[0])
    assert [bucket.take(), bucket.take(), bucket.take()] == [True, True, False]
    now[0] = 2.0
    assert [bucket.take(), bucket.take()] == [True, False]
    now[0] = 100.0  # refills to burst, no further
    assert [bucket.take(), bucket.take(), bucket.take()] == [True, True, False]


def test_the_guard_limits_then_authenticates_and_heads_every_answer(folder: Path) -> None:
    path = write(
        folder,
        f"basic_auth_users:\n  alice: {ALICE}\nrate_limit: {{interval: 1h, burst: 3}}\n"
        "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
        "    X-Content-Type-Options: nosniff\n",
    )

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def answers() -> list[tuple[int, str | None, str | None]]:
        app = web.Application()
        app.router.add_get("/metrics", ok)
        WebGuard(load_web_config(path)).install(app)
        async with TestClient(TestServer(app)) as client:
            seen = []
            right, wrong = basic("alice", "alice-password"), basic("alice", "x")
            for headers in ({}, {"Authorization": right}, {"Authorization": wrong}, {}):
                response = await client.get("/metrics", headers=headers)
                seen.append(
                    (
                        response.status,
                        response.headers.get("WWW-Authenticate"),
                        response.headers.get("X-Frame-Options"),
                    )
                )
                assert response.headers.get("X-Content-Type-Options") == "nosniff"
            return seen

    assert asyncio.run(answers()) == [
        (401, "Basic", "deny"),
        (200, None, "deny"),
        (401, "Basic", "deny"),
        (429, None, "deny"),  # the limit comes first, as in the toolkit: no bcrypt for it
    ]
