"""The scrape port behind --web.config.file: TLS and basic auth on the running exporter, scraped
by a real Prometheus; SIGHUP reloads; bad certificates refused. Certificates come from the
openssl command line, made fresh for each module run."""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest
from aiohttp import web

from gpubalance.config import ConfigError
from gpubalance.lab.fakenvml import write_state
from gpubalance.lab.live.ports import start_prometheus
from gpubalance.webconfig import WebSecurity, build_ssl_context, load_web_config

pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="openssl makes the test certificates"
)

LISTENING = re.compile(r"listening on (https?://\S+)")
SERVER_SAN = "subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost\nextendedKeyUsage=serverAuth\n"


def openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Pair:
    crt: Path
    key: Path


def make_ca(folder: Path, name: str) -> Pair:
    pair = Pair(folder / f"{name}.crt", folder / f"{name}.key")
    openssl(
        *("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"),
        *("-keyout", pair.key, "-out", pair.crt, "-subj", f"/CN={name}", "-days", "2"),
    )
    return pair


def issue(folder: Path, name: str, ca: Pair, extensions: str) -> Pair:
    pair = Pair(folder / f"{name}.crt", folder / f"{name}.key")
    csr, ext = folder / f"{name}.csr", folder / f"{name}.ext"
    ext.write_text(extensions)
    openssl(
        *("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"),
        *("-keyout", pair.key, "-out", csr, "-subj", f"/CN={name}"),
    )
    openssl(
        *("x509", "-req", "-in", csr, "-CA", ca.crt, "-CAkey", ca.key, "-out", pair.crt),
        *("-days", "2", "-set_serial", str(secrets.randbits(63)), "-extfile", ext),
    )
    return pair


@dataclass(frozen=True)
class Pki:
    ca: Pair
    server: Pair
    renewed: Pair  # the same names, a new key: what a certificate rotation installs
    client_ca: Pair
    client: Pair


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca = make_ca(folder, "ca")
    client_ca = make_ca(folder, "client-ca")
    return Pki(
        ca=ca,
        server=issue(folder, "server", ca, SERVER_SAN),
        renewed=issue(folder, "renewed", ca, SERVER_SAN),
        client_ca=client_ca,
        client=issue(folder, "client", client_ca, "extendedKeyUsage=clientAuth\n"),
    )


def hashed(password: str) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()


def web_yml(folder: Path, pki: Pki, users: Mapping[str, str], extra: str = "") -> Path:
    """A web config in its own folder, with copies of the server pair, as an operator keeps it."""
    shutil.copy(pki.server.crt, folder / "server.crt")
    shutil.copy(pki.server.key, folder / "server.key")
    path = folder / "web.yml"
    lines = ["tls_server_config:", "  cert_file: server.crt", "  key_file: server.key"]
    lines += [extra] if extra else []
    lines += ["basic_auth_users:", *(f"  {u}: '{hashed(p)}'" for u, p in users.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@dataclass
class Exporter:
    process: subprocess.Popen[bytes]
    log_path: Path
    url: str = ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(
        self,
        path: str,
        headers: Mapping[str, str] | None = None,
        context: ssl.SSLContext | None = None,
        method: str = "GET",
    ) -> tuple[int, Mapping[str, str], bytes]:
        request = urllib.request.Request(self.url + path, headers=dict(headers or {}))
        request.method = method
        try:
            with urllib.request.urlopen(request, timeout=10, context=context) as response:
                return response.status, response.headers, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers, error.read()

    def reload(self, outcome: str) -> str:
        """SIGHUP, then wait for the log line that reports the reload; returns that line."""
        seen = self.log().count(outcome)
        self.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while self.log().count(outcome) == seen:
            assert self.process.poll() is None, f"exporter died:\n{self.log()}"
            assert time.monotonic() < deadline, f"no {outcome!r} after SIGHUP:\n{self.log()}"
            time.sleep(0.05)
        return [line for line in self.log().splitlines() if outcome in line][-1]


ExporterFactory = Callable[..., Exporter]


@pytest.fixture
def start(
    fakenvml_env: Callable[[str | Path], dict[str, str]], tmp_path: Path
) -> Iterator[ExporterFactory]:
    """start(*flags, ready=headers): the exporter; with ready, waits for a fresh /healthz."""
    running: list[Exporter] = []

    def launch(
        *flags: str,
        ready: Mapping[str, str] | None = None,
        context: ssl.SSLContext | None = None,
    ) -> Exporter:
        n = len(running)
        state = tmp_path / f"nvml-{n}.state"
        write_state(state, {"device_count": 1})
        log_path = tmp_path / f"exporter-{n}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "gpubalance", "exporter", "--interval", "0.2"),
                    *("--otlp-listen", "127.0.0.1:0"),  # never OTLP's fixed 4318
                    *("--window", "1", "--trend-window", "5", *flags),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=fakenvml_env(state),
            )
        exporter = Exporter(process, log_path)
        running.append(exporter)
        deadline = time.monotonic() + 30
        while not (match := LISTENING.search(exporter.log())):
            assert process.poll() is None, f"exporter exited early:\n{exporter.log()}"
            assert time.monotonic() < deadline, f"exporter did not listen:\n{exporter.log()}"
            time.sleep(0.05)
        exporter.url = match.group(1)
        if ready is not None:
            while exporter.get("/healthz", ready, context)[0] != 200:
                assert time.monotonic() < deadline, f"no sample:\n{exporter.log()}"
                time.sleep(0.05)
        return exporter

    yield launch
    for exporter in running:
        if exporter.process.poll() is None:
            exporter.process.terminate()
            exporter.process.wait(timeout=15)


def client_context(pki: Pki, certificate: Pair | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki.ca.crt)
    if certificate is not None:
        context.load_cert_chain(certificate.crt, certificate.key)
    return context


def served_certificate(url: str, context: ssl.SSLContext) -> bytes:
    host, port = url.removeprefix("https://").rsplit(":", 1)
    with (
        socket.create_connection((host, int(port)), timeout=10) as sock,
        context.wrap_socket(sock, server_hostname=host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def der(pair: Pair) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pair.crt.read_text())


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="apt-get install prometheus")
def test_prometheus_scrapes_over_tls_with_basic_auth(
    start: ExporterFactory, pki: Pki, tmp_path: Path
) -> None:
    path = web_yml(tmp_path, pki, {"prometheus": "scrape-secret"})
    exporter = start("--listen", "127.0.0.1:0", "--web.config.file", str(path))
    target = exporter.url.removeprefix("https://")
    assert exporter.url.startswith("https://")

    def job(name: str, auth: str) -> str:
        return (
            f"  - job_name: {name}\n    scheme: https\n    tls_config: {{ca_file: {pki.ca.crt}}}\n"
            f"{auth}    static_configs: [{{targets: ['{target}']}}]\n"
        )

    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 2s, scrape_timeout: 2s}\nscrape_configs:\n"
        + job("right", "    basic_auth: {username: prometheus, password: scrape-secret}\n")
        + job("wrong", "    basic_auth: {username: prometheus, password: guess}\n")
        + job("none", "")
    )
    prometheus = start_prometheus(config, tmp_path / "tsdb")
    api = f"{prometheus.url}/api/v1"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert prometheus.process.poll() is None, prometheus.log_path.read_text()
            try:
                with urllib.request.urlopen(f"{api}/targets", timeout=5) as response:
                    targets = json.load(response)["data"]["activeTargets"]
                health = {t["labels"]["job"]: t for t in targets}
            except (OSError, KeyError, ValueError):
                health = {}
            if len(health) == 3 and all(t["health"] != "unknown" for t in health.values()):
                break
            assert time.monotonic() < deadline, f"targets not scraped: {health}"
            time.sleep(0.2)
        assert health["right"]["health"] == "up", health["right"]["lastError"]
        for name in ("wrong", "none"):
            assert health[name]["health"] == "down"
            assert "401" in health[name]["lastError"], health[name]["lastError"]
        with urllib.request.urlopen(f"{api}/query?query=up", timeout=5) as response:
            up = {r["metric"]["job"]: r["value"][1] for r in json.load(response)["data"]["result"]}
        assert up == {"right": "1", "wrong": "0", "none": "0"}
    finally:
        prometheus.stop()


def test_every_endpoint_needs_the_password(
    start: ExporterFactory, pki: Pki, tmp_path: Path
) -> None:
    path = web_yml(tmp_path, pki, {"alice": "alice-secret"})
    context = client_context(pki)
    exporter = start(
        *("--listen", "127.0.0.1:0", "--web.config.file", str(path)),
        ready=basic("alice", "alice-secret"),
        context=context,
    )
    # as node_exporter: the toolkit wraps every handler; a probe sends the password too
    for method, endpoint in [
        ("GET", "/"),
        ("GET", "/metrics"),
        ("GET", "/api/v1/snapshot"),
        ("GET", "/healthz"),
        ("POST", "/v1/metrics"),
        ("GET", "/no-such-page"),
    ]:
        for headers in ({}, basic("alice", "wrong"), basic("mallory", "alice-secret")):
            status, answer, _ = exporter.get(endpoint, headers, context, method)
            assert (status, answer.get("WWW-Authenticate")) == (401, "Basic"), (endpoint, headers)
    for endpoint in ("/", "/metrics", "/api/v1/snapshot", "/healthz"):
        assert exporter.get(endpoint, basic("alice", "alice-secret"), context)[0] == 200
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP: no answer
        urllib.request.urlopen(exporter.url.replace("https", "http") + "/healthz", timeout=10)


def test_sighup_takes_a_changed_users_file_and_refuses_a_broken_one(
    start: ExporterFactory, pki: Pki, tmp_path: Path
) -> None:
    path = web_yml(tmp_path, pki, {"alice": "first"})
    context = client_context(pki)
    exporter = start(
        *("--listen", "127.0.0.1:0", "--web.config.file", str(path)),
        ready=basic("alice", "first"),
        context=context,
    )
    web_yml(tmp_path, pki, {"alice": "second", "bob": "bobs"})
    line = exporter.reload("reloaded")
    assert line.endswith(f"web config {path} reloaded: TLS, basic auth for 2 users")
    assert exporter.get("/healthz", basic("alice", "first"), context)[0] == 401
    assert exporter.get("/healthz", basic("alice", "second"), context)[0] == 200
    assert exporter.get("/healthz", basic("bob", "bobs"), context)[0] == 200

    lines = path.read_text().splitlines()
    assert lines[5].startswith("  bob: ")
    path.write_text("\n".join([*lines[:5], "  bob: bobs"]) + "\n")  # a password in clear
    line = exporter.reload("keeping the previous web configuration")
    assert f"{path}:6: basic_auth_users.bob: expected a bcrypt hash" in line
    assert "ERROR" in line
    assert exporter.get("/healthz", basic("bob", "bobs"), context)[0] == 200
    assert exporter.get("/healthz", basic("alice", "second"), context)[0] == 200

    path.write_text("tls_server_config: [\n")
    exporter.reload("keeping the previous web configuration")
    assert exporter.get("/healthz", basic("alice", "second"), context)[0] == 200


def test_sighup_serves_a_renewed_certificate_to_new_connections(
    start: ExporterFactory, pki: Pki, tmp_path: Path
) -> None:
    path = web_yml(tmp_path, pki, {"alice": "secret"})
    context = client_context(pki)
    auth = basic("alice", "secret")
    exporter = start(
        *("--listen", "127.0.0.1:0", "--web.config.file", str(path)), ready=auth, context=context
    )
    assert served_certificate(exporter.url, context) == der(pki.server)
    host, port = exporter.url.removeprefix("https://").rsplit(":", 1)
    kept = http.client.HTTPSConnection(host, int(port), context=context, timeout=10)
    kept.request("GET", "/healthz", headers=auth)
    assert kept.getresponse().read() and kept.sock is not None

    shutil.copy(pki.renewed.crt, tmp_path / "server.crt")
    shutil.copy(pki.renewed.key, tmp_path / "server.key")
    exporter.reload("reloaded")
    assert served_certificate(exporter.url, context) == der(pki.renewed)
    # a connection open across the reload keeps its session and goes on serving
    kept.request("GET", "/healthz", headers=auth)
    assert kept.getresponse().status == 200
    assert kept.sock.getpeercert(binary_form=True) == der(pki.server)
    kept.close()

    shutil.copy(pki.server.crt, tmp_path / "server.crt")  # a renewed key, an old certificate
    line = exporter.reload("keeping the previous web configuration")
    assert "does not match the key" in line
    assert served_certificate(exporter.url, context) == der(pki.renewed)


def test_reloads_leave_no_listener_behind(pki: Pki, tmp_path: Path) -> None:
    path = web_yml(tmp_path, pki, {"alice": "secret"})

    async def reload_then_close() -> None:
        security = WebSecurity(str(path))
        runner = web.AppRunner(web.Application())
        await runner.setup()
        assert runner.server is not None
        await security.listen(runner.server, "127.0.0.1", 0)
        port = int(security.urls()[0].rsplit(":", 1)[1])
        await asyncio.gather(security.reload(), security.reload(), security.reload())
        security.close()
        try:
            # a listener left behind by a reload would still accept
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection("127.0.0.1", port)
        finally:
            await runner.cleanup()

    asyncio.run(reload_then_close())


def test_client_certificates_are_verified_against_client_ca_file(
    start: ExporterFactory, pki: Pki, tmp_path: Path
) -> None:
    extra = f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.client_ca.crt}"
    path = web_yml(tmp_path, pki, {"alice": "secret"}, extra)
    with_cert = client_context(pki, pki.client)
    exporter = start(
        *("--listen", "127.0.0.1:0", "--web.config.file", str(path)),
        ready=basic("alice", "secret"),
        context=with_cert,
    )
    assert "client certificates RequireAndVerifyClientCert" in exporter.log()
    # a certificate from the server's CA is no client certificate here; no certificate neither
    for context in (client_context(pki), client_context(pki, pki.server)):
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
            exporter.get("/healthz", basic("alice", "secret"), context)
    assert exporter.get("/healthz", basic("alice", "secret"), with_cert)[0] == 200


def run_exporter(fakenvml_env: Callable[[str | Path], dict[str, str]], *flags: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "gpubalance", "exporter", "--listen", "127.0.0.1:0", *flags],
        env=fakenvml_env("/nonexistent"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    return result.stderr


def test_a_malformed_web_config_exits_2_naming_file_key_and_expectation(
    fakenvml_env: Callable[[str | Path], dict[str, str]], pki: Pki, tmp_path: Path
) -> None:
    path = web_yml(tmp_path, pki, {"alice": "secret"}, "  client_auth_type: Sometimes")
    stderr = run_exporter(fakenvml_env, "--web.config.file", str(path))
    assert stderr.startswith(
        f"gpubalance exporter: {path}:4: tls_server_config.client_auth_type: "
        "Input should be 'NoClientCert', "
    )
    stderr = run_exporter(fakenvml_env, "--web.config.file", str(tmp_path / "absent.yml"))
    assert f"{tmp_path / 'absent.yml'}: cannot read: No such file or directory" in stderr


def test_a_certificate_that_does_not_match_its_key_exits_2(
    fakenvml_env: Callable[[str | Path], dict[str, str]], pki: Pki, tmp_path: Path
) -> None:
    path = web_yml(tmp_path, pki, {"alice": "secret"})
    shutil.copy(pki.renewed.key, tmp_path / "server.key")
    stderr = run_exporter(fakenvml_env, "--web.config.file", str(path))
    assert stderr == (
        f"gpubalance exporter: {path}: tls_server_config: the certificate (cert_file "
        f"{tmp_path / 'server.crt'}) does not match the key (key_file {tmp_path / 'server.key'}); "
        "give the key the certificate was issued for\n"
    )


def test_the_ssl_context_refuses_what_openssl_cannot_use(pki: Pki, tmp_path: Path) -> None:
    encrypted = tmp_path / "encrypted.key"
    openssl(*("pkey", "-in", pki.server.key, "-out", encrypted, "-aes256", "-passout", "pass:pw"))
    path = tmp_path / "web.yml"
    path.write_text(f"tls_server_config:\n  cert_file: {pki.server.crt}\n  key_file: {encrypted}\n")
    tls = load_web_config(path).tls
    assert tls is not None
    with pytest.raises(
        ConfigError, match=r"is encrypted; the exporter .* needs an unencrypted key"
    ):
        build_ssl_context(tls)

    cert = "\n".join("    " + line for line in pki.server.crt.read_text().splitlines())
    key = "\n".join("    " + line for line in pki.server.key.read_text().splitlines())
    path.write_text(f"tls_server_config:\n  cert: |\n{cert}\n  key: |\n{key}\n")
    tls = load_web_config(path).tls
    assert tls is not None
    assert build_ssl_context(tls).verify_mode == ssl.CERT_NONE  # inline PEM loads

    path.write_text(
        f"tls_server_config:\n  cert_file: {pki.server.crt}\n  key_file: {pki.server.key}\n"
        "  client_auth_type: VerifyClientCertIfGiven\n  client_ca: |\n"
        "    -----BEGIN CERTIFICATE-----\n    bm90IGEgY2VydA==\n    -----END CERTIFICATE-----\n"
    )
    tls = load_web_config(path).tls
    assert tls is not None
    with pytest.raises(ConfigError, match="tls_server_config: client_ca: no usable CA"):
        build_ssl_context(tls)


def test_an_ipv6_listen_address_is_logged_in_brackets(start: ExporterFactory) -> None:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback on this host")
    exporter = start("--listen", "[::1]:0")
    assert re.search(r"listening on http://\[::1\]:\d+\n", exporter.log())
    assert exporter.url.startswith("http://[::1]:")
    assert exporter.get("/healthz")[0] in (200, 503)  # the logged URL is one a client can use
