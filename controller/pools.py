"""Pools as policies: the `haproxy:` section of the config file, and the HAProxy config text
that implements it (`gpubalance deploy haproxy`).

A pool is one set of workers (servers, each taking `maxconn` requests at once, its
concurrency) behind one frontend (`fe_POOL`, listening on `bind`), under one policy:

- `utilization_first`: one backend of the pool's name, `balance leastconn`, each server at
  its `maxconn`: every request waits in one queue for the first free slot of any worker;
- `equal_share` and `fixed_share`: one backend per tenant (`POOL.TENANT`) over the same
  workers, each server's `maxconn` there the tenant's share of the worker's concurrency
  (largest remainder, so a worker's tenant slots add up to its `maxconn`), and each tenant
  its own queue. A tenant never holds more than its share of a worker; a share another
  tenant leaves idle is not lent. The frontend routes on the tenant header (`X-Tenant`);
  a request without it, or naming no tenant, goes to `default_tenant`.

Admission, in each backend (so per tenant under the share policies): a request that finds
no serving server answers 503 at once, one that finds `max_queue` requests waiting answers
429 (`http-request deny`, which HAProxy counts in the backend's `dreq`), both with
`Retry-After`; a request that waited `queue_timeout_seconds` gets HAProxy's own 503, with
the same header. The checks read HAProxy's `nbsrv` and `queue` sample fetches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from gpubalance.config import load_section
from gpubalance.controller.haproxy import HEADER_NAME, HTTP_PATH, MAX_WEIGHT, check_name
from gpubalance.webconfig import parse_listen

SECTION = "haproxy"

Policy = Literal["utilization_first", "equal_share", "fixed_share"]

# shares are written in decimals: a sum within this of 1 is 1
_SHARE_TOLERANCE = 1e-6


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _name(value: str) -> str:
    check_name("name", value)
    return value


def _address(value: str) -> str:
    host, port = parse_listen(value)
    if port == 0 or any(c.isspace() for c in host):
        raise ValueError(f"expected HOST:PORT with a port 1..65535, got {value!r}")
    return value


# an HAProxy name (server, tenant, pool), and a HOST:PORT
Name = Annotated[str, AfterValidator(_name)]
Address = Annotated[str, AfterValidator(_address)]


def _duration(seconds: float) -> str:
    """Seconds as an HAProxy time in milliseconds (its resolution)."""
    return f"{max(1, round(seconds * 1000))}ms"


class PoolServer(_Model):
    """One worker: its HAProxy server name, where it listens, and its concurrency."""

    name: Name
    address: Address
    maxconn: int = Field(ge=1)  # requests the worker serves at once; more wait in a queue
    weight: int = Field(default=100, ge=0, le=MAX_WEIGHT)


class Tenant(_Model):
    """A tenant of a share pool: `share` (the shares of a pool add up to 1) or `weight`
    (shares in proportion); neither under `equal_share`."""

    name: Name
    share: float | None = Field(default=None, gt=0, le=1)
    weight: float | None = Field(default=None, gt=0)
    max_queue: int | None = Field(default=None, ge=1)  # its own bound; else the pool's


class Admission(_Model):
    """What a pool does when it is full."""

    max_queue: int = Field(ge=1)  # requests waiting per backend (per tenant under shares)
    queue_timeout_seconds: float = Field(default=30.0, gt=0)
    retry_after_seconds: int = Field(default=5, ge=1)  # Retry-After takes whole seconds


class Pool(_Model):
    name: Name  # the backend under utilization_first; frontend fe_NAME
    bind: Address  # the pool's frontend listens here
    policy: Policy = "utilization_first"
    servers: tuple[PoolServer, ...] = Field(min_length=1)
    tenants: tuple[Tenant, ...] = ()
    tenant_header: str = "X-Tenant"
    default_tenant: str | None = None  # the first tenant when not given
    admission: Admission
    health_path: str | None = None  # GET it to check a worker; a TCP connect without it
    health_check_interval_seconds: float = Field(default=2.0, gt=0)

    @field_validator("tenant_header")
    @classmethod
    def _header(cls, value: str) -> str:
        if not HEADER_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not a header name (letters, digits, '-')")
        return value

    @field_validator("health_path")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        if value is not None and not HTTP_PATH.fullmatch(value):
            raise ValueError(f"{value!r} must start with '/' and hold no spaces")
        return value

    @model_validator(mode="after")
    def _policy(self) -> Self:
        _unique(f"pool {self.name}: server names", [s.name for s in self.servers])
        _unique(f"pool {self.name}: server addresses", [s.address for s in self.servers])
        _unique(f"pool {self.name}: tenant names", [t.name for t in self.tenants])
        if self.policy == "utilization_first":
            if self.tenants:
                raise ValueError(
                    f"pool {self.name}: utilization_first keeps one queue for every request; "
                    "remove its tenants, or choose equal_share or fixed_share"
                )
            return self
        if not self.tenants:
            raise ValueError(f"pool {self.name}: {self.policy} needs tenants")
        if self.default_tenant is not None and self.default_tenant not in self.tenant_names:
            raise ValueError(
                f"pool {self.name}: default_tenant {self.default_tenant!r} is not among its "
                f"tenants {list(self.tenant_names)}"
            )
        given = [(t.share is not None, t.weight is not None) for t in self.tenants]
        if self.policy == "equal_share" and any(s or w for s, w in given):
            raise ValueError(
                f"pool {self.name}: equal_share gives every tenant the same share; remove "
                "share and weight, or choose fixed_share"
            )
        if self.policy == "fixed_share":
            if not all(s != w for s, w in given) or len({s for s, _ in given}) > 1:
                raise ValueError(
                    f"pool {self.name}: fixed_share needs a share on every tenant, or a weight "
                    "on every tenant (not both, not mixed)"
                )
            total = sum(t.share or 0.0 for t in self.tenants)
            if given[0][0] and abs(total - 1) > _SHARE_TOLERANCE:
                raise ValueError(
                    f"pool {self.name}: the tenants' shares add up to {total:g}, not 1 "
                    f"({', '.join(f'{t.name} {t.share:g}' for t in self.tenants)})"
                )
        for tenant, share in self.shares().items():
            for server in self.servers:
                if share * server.maxconn < 1 - _SHARE_TOLERANCE:
                    raise ValueError(
                        f"pool {self.name}: tenant {tenant}'s share {share:g} of server "
                        f"{server.name}'s {server.maxconn} connections (maxconn) is "
                        f"{share * server.maxconn:g}, less than one; raise its share to at "
                        f"least {1 / server.maxconn:g} or the worker's maxconn"
                    )
        return self

    @property
    def tenant_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tenants)

    def shares(self) -> dict[str, float]:
        """Each tenant's share of every worker, adding up to 1 (empty: utilization_first)."""
        if self.policy == "equal_share":
            return {t.name: 1 / len(self.tenants) for t in self.tenants}
        weights = {t.name: t.share if t.share is not None else t.weight for t in self.tenants}
        total = sum(w or 0.0 for w in weights.values())
        return {name: (w or 0.0) / total for name, w in weights.items()}

    @property
    def frontend(self) -> str:
        """The HAProxy frontend: a name no backend has (`show stat NAME` takes the first)."""
        return f"fe_{self.name}"

    def backend_of(self, tenant: str | None = None) -> str:
        """The HAProxy backend of a tenant (of the whole pool under utilization_first)."""
        return self.name if tenant is None else f"{self.name}.{tenant}"

    def backends(self) -> dict[str, Mapping[str, int]]:
        """Each backend of the pool -> its servers' maxconn there."""
        if self.policy == "utilization_first":
            return {self.name: {s.name: s.maxconn for s in self.servers}}
        slots: dict[str, dict[str, int]] = {t: {} for t in self.tenant_names}
        for server in self.servers:
            for tenant, n in _apportion(server.maxconn, self.shares()).items():
                slots[tenant][server.name] = n
        return {self.backend_of(t): slots[t] for t in self.tenant_names}


class PoolsConfig(_Model):
    """The `haproxy:` section: the pools `gpubalance deploy haproxy` renders."""

    pools: tuple[Pool, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> Self:
        _unique("pool names", [p.name for p in self.pools])
        _unique("pool binds", [p.bind for p in self.pools])
        proxies = [n for p in self.pools for n in (p.frontend, *p.backends())]
        _unique("frontend and backend names (fe_POOL, POOL or POOL.TENANT)", proxies)
        for name in proxies:
            check_name("proxy name", name)
        return self


def load(path: str | Path) -> PoolsConfig:
    """The `haproxy:` section of the config file; ConfigError names the file, line and key."""
    return load_section(PoolsConfig, path, SECTION)


def _unique(what: str, names: list[str]) -> None:
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{what} repeat: {', '.join(repeated)}")


def _apportion(slots: int, shares: Mapping[str, float]) -> dict[str, int]:
    """`slots` split in proportion to `shares` in whole numbers that add up to `slots`: each
    its whole part, the rest one each to the largest remainders (ties by order)."""
    exact = {name: slots * share for name, share in shares.items()}
    whole = {name: math.floor(x + _SHARE_TOLERANCE) for name, x in exact.items()}
    left = slots - sum(whole.values())
    by_remainder = sorted(exact, key=lambda name: whole[name] - exact[name])
    for name in by_remainder[:left]:
        whole[name] += 1
    return whole


def render(config: PoolsConfig, source: str) -> str:
    """The frontends and backends of every pool, as HAProxy config text: the same config
    always gives the same text. It goes beside the operator's `global` and `defaults`
    (`haproxy -f haproxy.cfg -f pools.cfg`)."""
    lines = [f"# Generated by `gpubalance deploy haproxy` from {source}: edit that, not this."]
    for pool in config.pools:
        lines += ["", *_frontend(pool)]
        slots = pool.backends()
        tenants = pool.tenants or (None,)
        for tenant in tenants:
            backend = pool.backend_of(None if tenant is None else tenant.name)
            max_queue = pool.admission.max_queue
            if tenant is not None and tenant.max_queue is not None:
                max_queue = tenant.max_queue
            lines += ["", *_backend(pool, backend, slots[backend], max_queue)]
    return "\n".join(lines) + "\n"


def _frontend(pool: Pool) -> list[str]:
    lines = [f"frontend {pool.frontend}", f"    bind {pool.bind}"]
    if pool.policy == "utilization_first":
        return [*lines, f"    default_backend {pool.name}"]
    shares = pool.shares()
    lines.insert(0, f"# {pool.policy}: " + ", ".join(f"{t} {s:.4g}" for t, s in shares.items()))
    default = pool.default_tenant or pool.tenants[0].name
    lines += [
        f"    use_backend {pool.backend_of(t)} if {{ req.hdr({pool.tenant_header}) -m str {t} }}"
        for t in pool.tenant_names
        if t != default
    ]
    return [*lines, f"    default_backend {pool.backend_of(default)}"]


def _backend(pool: Pool, backend: str, slots: Mapping[str, int], max_queue: int) -> list[str]:
    retry = pool.admission.retry_after_seconds
    answer = f'content-type text/plain string "{{}}; retry after {retry} s" hdr Retry-After {retry}'
    lines = [
        f"backend {backend}",
        "    balance leastconn",
        f"    timeout queue {_duration(pool.admission.queue_timeout_seconds)}",
    ]
    if pool.health_path is not None:
        lines.append(f"    option httpchk GET {pool.health_path}")
    no_server = answer.format(f"no serving server in pool {pool.name}")
    full = answer.format(f"{max_queue} requests wait in {backend}")
    waited = answer.format(f"waited {pool.admission.queue_timeout_seconds:g} s in {backend}")
    lines += [
        f"    http-request return status 503 {no_server} if {{ nbsrv eq 0 }}",
        # a deny, so that HAProxy counts it in the backend's dreq: the controller's shed count
        f"    http-request deny deny_status 429 {full} if {{ queue ge {max_queue} }}",
        # HAProxy's own 503 (the queue timeout) says when to come back too
        f"    http-error status 503 {waited}",
    ]
    inter = _duration(pool.health_check_interval_seconds)
    lines += [
        f"    server {s.name} {s.address} weight {s.weight} maxconn {slots[s.name]} "
        f"check inter {inter}"
        for s in pool.servers
    ]
    return lines
