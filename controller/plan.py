"""plan(): observed HAProxy state + recommendations -> the changes that move it toward them.

Pure: the same inputs give the same plan, and a state that already shows what the
recommendations ask for plans nothing. What a recommendation asks, per action:

- `set_weights`: as the analyzer makes it, target a pool (`pool:NAME`) and
  `parameters["weights"]` a list of `{gpu, worker, weight}`, each worker's share of the pool's
  work: the workers are the backend's servers of those names, and the shares become weights
  in proportion (on a leastconn backend, each over its GPU's capacity: leastconn sends a
  server its weight times its capacity), the largest `SHARE_WEIGHT` (where they name all of
  the backend's servers,
  at the scale the step reaches soonest, and none where HAProxy's weights are within
  `SHARE_TOLERANCE` of the shares already); or target a backend (`be_gpu`) with
  `parameters["weights"]` mapping its server names to weights 0..256. Each pass moves a weight
  by at most `Settings.max_weight_step`;
- `drain`: target `backend/server`, or (the analyzer's) `gpu:N` with `parameters["workers"]`
  naming its servers, which take no new requests (their sessions finish);
- `remove_worker`: the same targets, drained first, then `maint` once the sessions reach 0
  (failed after `Settings.drain_timeout_seconds`);
- `add_worker`: the same targets, back to `ready` (the analyzer's, for a GPU back from being lost
  that its drain took out), but for a split's server in maint (`_split_off`): a drain of a server
  in maint leaves it there, so that one is the split's.

A weight above 0 for a server this controller took out of rotation itself (`taken_out`: its
own drain or maint was its last word on the server, as its audit log shows) readies it too:
the analyzer gives a removed GPU a share again when its pool needs it back, and a weight alone
routes nothing to a server in `maint`. A server someone else took out stays out; its weight is
set, for when they ready it.

`split_pools`: the analyzer's pool whose `batch_workers` and `interactive_workers` are servers
of one backend `NAME` and of its batch backend `NAME_batch` (`BATCH_BACKEND`: the same
servers, in maint, which the frontend routes the batch class to while one is up): first the
batch side's servers are readied in `NAME_batch` (the interactive side's stay in maint there),
then, once HAProxy shows that, they leave `NAME` (drained, then maint), which keeps serving the
interactive side. A weight readies no server a split took out of `NAME`, nor one of `NAME_batch`.
A split that asks other servers than `NAME_batch` serves from already is refused: re-splitting
a pool under load is a person's call.

`move_worker` goes to the mover (controller/mover.py) where a worker supervisor is configured;
`plan_moves` checks it first: its `to` is a backend, or the analyzer's pool whose `to_workers`
are servers of one backend; it waits while its GPU is frozen after another recommendation's
move, and while a cheaper change is planned on the backend it leaves (the ladder's move
rung). Without a supervisor it is refused as unsupported, as is batching. A
recommendation that is expired, stale, aimed at an unknown backend or server, or asks one server
for two values at once together with another one, is refused with the reason. Within a backend
the cheapest rung of the ladder (lowest `cost_rank`) goes first; dearer ones wait until it is
met.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from gpubalance.controller.haproxy import MAX_WEIGHT, AdminState
from gpubalance.controller.model import (
    Applied,
    Change,
    Observed,
    ObservedServer,
    Plan,
    Refusal,
    RefusalReason,
    Settings,
    server_key,
)
from gpubalance.diagnosis import Recommendation

# the weight the largest share of a pool's work becomes (HAProxy's own default is 1; a
# hundred leaves room to tell shares apart), unless a scale nearer the weights HAProxy has
# gets there sooner
SHARE_WEIGHT = 100
# a backend's weights whose proportions are this close to the shares asked (of the pool's
# traffic, per server) already route as asked
SHARE_TOLERANCE = 0.02

# a backend `NAME` that may be split has a batch backend `NAME_batch`: the same servers, in
# maint until a split readies the batch side's, which the frontend routes the batch class to
# while one of them is up (HAProxy's `nbsrv`)
BATCH_BACKEND = "_batch"


def batch_backend(backend: str) -> str:
    """The batch backend of ``backend``, where it may be split."""
    return backend + BATCH_BACKEND


def split_from(backend: str) -> str | None:
    """The backend a batch backend splits; None for a backend that is not one."""
    return backend.removesuffix(BATCH_BACKEND) if backend.endswith(BATCH_BACKEND) else None


# the admin state each server action asks for
_ADMIN_OF: Mapping[str, AdminState] = {
    "drain": "drain",
    "remove_worker": "maint",
    "add_worker": "ready",
}


@dataclass(frozen=True, slots=True)
class _Want:
    """One value a recommendation asks of one server."""

    server: ObservedServer
    attribute: str  # "weight" | "admin"
    value: int | AdminState


def plan(
    observed: Observed,
    recommendations: Sequence[Recommendation],
    history: Sequence[Applied],
    settings: Settings,
    taken_out: frozenset[str] = frozenset(),
) -> Plan:
    now = observed.at_seconds
    refusals: list[Refusal] = []
    wants: dict[str, list[_Want]] = {}
    by_id: dict[str, Recommendation] = {}
    for rec in recommendations:
        if settings.host is not None and rec.host != settings.host:
            continue  # another host's controller acts on it
        refusal = _check(rec, now, settings)
        if refusal is None:
            parsed = _wants(rec, observed, settings.max_weight_step)
            if isinstance(parsed, Refusal):
                refusal = parsed
            else:
                wants[rec.id] = _readied(parsed, taken_out, observed)
                by_id[rec.id] = rec
        if refusal is not None:
            refusals.append(refusal)

    split = _contradictory(wants)
    for rec_id, others in split.items():
        refusals.append(
            Refusal(
                rec_id,
                "contradictory",
                f"asks {_describe(wants[rec_id])} while {', '.join(others)} asks otherwise",
                ack="rejected",
                target=by_id[rec_id].target,
            )
        )
    for rec_id in split:
        del wants[rec_id]

    open_ids = [rec_id for rec_id, ws in wants.items() if not all(_met(w) for w in ws)]
    converged = tuple(sorted(rec_id for rec_id in wants if rec_id not in open_ids))
    cheapest: dict[str, int] = {}
    for rec_id in open_ids:
        backend = wants[rec_id][0].server.backend
        cheapest[backend] = min(
            cheapest.get(backend, by_id[rec_id].cost_rank), by_id[rec_id].cost_rank
        )

    changes: list[Change] = []
    planned: set[tuple[str, str]] = set()
    for rec_id in sorted(open_ids):
        rec = by_id[rec_id]
        backend = wants[rec_id][0].server.backend
        if rec.cost_rank > cheapest[backend]:
            refusals.append(
                Refusal(
                    rec_id,
                    "ladder",
                    f"waits for the cheaper recommendations on {backend} (cost rank "
                    f"{cheapest[backend]}) to be met first",
                    target=rec.target,
                )
            )
            continue
        for want in wants[rec_id]:
            if _met(want):
                continue
            step = _step(want, rec, now, history, settings)
            if isinstance(step, Refusal):
                refusals.append(step)
            elif (step.key, step.kind) not in planned:
                # two recommendations that agree on a server change it once
                planned.add((step.key, step.kind))
                changes.append(step)
    changes.sort(key=lambda c: (c.cost_rank, c.key, c.kind))
    return Plan(changes=tuple(changes), refusals=tuple(refusals), converged=converged)


def _check(rec: Recommendation, now: float, settings: Settings) -> Refusal | None:
    if rec.expires_seconds <= now:
        return Refusal(
            rec.id,
            "expired",
            f"expired {now - rec.expires_seconds:.0f} s ago",
            ack="rejected",
            target=rec.target,
        )
    # stale: the newest telemetry it rests on is old, however long the situation has held
    # (a scale-in waits for many windows of low demand, and is no less current for it)
    observed = rec.observed_seconds if rec.observed_seconds is not None else rec.created_seconds
    age = now - observed
    if age > settings.max_age_seconds:
        return Refusal(
            rec.id,
            "stale",
            f"rests on telemetry from {age:.0f} s ago, over the {settings.max_age_seconds:.0f} s "
            "limit",
            ack="rejected",
            target=rec.target,
        )
    return None


def _wants(rec: Recommendation, observed: Observed, step: int) -> list[_Want] | Refusal:
    def refuse(reason: RefusalReason, detail: str) -> Refusal:
        return Refusal(rec.id, reason, detail, ack="rejected", target=rec.target)

    if rec.action == "set_weights" and isinstance(rec.parameters.get("weights"), list):
        return _shares(rec, observed, step, refuse)
    if rec.action == "split_pools":
        return _split(rec, observed, refuse)
    if rec.action in _ADMIN_OF and "/" not in rec.target and "workers" in rec.parameters:
        servers = _servers_named(rec.parameters["workers"], observed)
        if isinstance(servers, str):
            return refuse("unknown_target", f"{rec.action} of {rec.target}: {servers}")
        return [
            _Want(server, "admin", _ADMIN_OF[rec.action])
            for server in servers
            # the side of a split a server is in maint on stays so (a split's, not a drain's)
            if not (
                rec.action == "add_worker"
                and server.admin == "maint"
                and _split_off(server, observed)
            )
        ]
    if rec.action == "set_weights":
        pool = {s.server: s for s in observed.pool(rec.target)}
        if not pool:
            return refuse(
                "unknown_target",
                f"backend {rec.target!r} is not among {sorted(observed.backends)}",
            )
        weights = rec.parameters.get("weights")
        if not isinstance(weights, Mapping) or not weights:
            return refuse("bad_parameters", "set_weights needs parameters.weights {server: 0..256}")
        found = []
        for name, weight in weights.items():
            if name not in pool:
                return refuse("unknown_target", f"server {name!r} is not in backend {rec.target!r}")
            if isinstance(weight, bool) or not isinstance(weight, int):
                return refuse("bad_parameters", f"weight of {name!r} is {weight!r}, not a number")
            if not 0 <= weight <= MAX_WEIGHT:
                return refuse("bad_parameters", f"weight {weight} of {name!r} is outside 0..256")
            found.append(_Want(pool[name], "weight", weight))
        return found
    if rec.action in _ADMIN_OF:
        backend, sep, name = rec.target.partition("/")
        server = observed.servers.get(server_key(backend, name)) if sep else None
        if server is None:
            return refuse(
                "unknown_target",
                f"{rec.action} needs a target backend/server HAProxy has; {rec.target!r} is not",
            )
        return [_Want(server, "admin", _ADMIN_OF[rec.action])]
    return refuse(
        "unsupported_action",
        f"{rec.action} is not carried out by this controller (set_weights, drain, "
        "remove_worker, add_worker, split_pools are)",
    )


def _readied(wants: list[_Want], taken_out: frozenset[str], observed: Observed) -> list[_Want]:
    """``wants`` and a `ready` for each server given a weight above 0 that this controller
    took out of rotation, unless it is a split's (`_split_off`)."""
    return wants + [
        _Want(w.server, "admin", "ready")
        for w in wants
        if w.attribute == "weight"
        and isinstance(w.value, int)
        and w.value > 0
        and w.server.admin != "ready"
        and w.server.key in taken_out
        and not _split_off(w.server, observed)
    ]


def _split_off(server: ObservedServer, observed: Observed) -> bool:
    """A split's server: of a batch backend (whose rotation only a split changes), or of a
    shared backend while its twin in the batch backend is out of maint (ready, or drained
    for its GPU's loss)."""
    shared = split_from(server.backend)
    if shared is not None and server_key(shared, server.server) in observed.servers:
        return True
    twin = observed.servers.get(server_key(batch_backend(server.backend), server.server))
    return twin is not None and twin.admin != "maint"


def _split(
    rec: Recommendation, observed: Observed, refuse: Callable[[RefusalReason, str], Refusal]
) -> list[_Want] | Refusal:
    """The analyzer's split_pools: the batch side's servers ready in the pool's batch backend,
    the others in maint there; once that holds, the batch side's servers leave the shared
    backend (drained, then maint), which keeps the interactive side."""
    sides: dict[str, list[ObservedServer]] = {}
    for side in ("batch_workers", "interactive_workers"):
        servers = _servers_named(rec.parameters.get(side), observed)
        if isinstance(servers, str):
            return refuse("unknown_target", f"split_pools of {rec.target}: {side}: {servers}")
        sides[side] = servers
    backends = {s.backend for side in sides.values() for s in side}
    shared = sorted(b for b in backends if batch_backend(b) in backends)
    if len(shared) != 1 or backends != {shared[0], batch_backend(shared[0])}:
        name = next(iter(backends)) if len(backends) == 1 else "NAME"
        split = batch_backend(name)
        return refuse(
            "unknown_target",
            f"split_pools of {rec.target}: its workers are servers of "
            f"{', '.join(sorted(backends))}; a split needs them in one backend {name} and in "
            f"{split}, the same servers `disabled`, which the frontend sends the batch class "
            f"to while one is up: use_backend {split} if {{ req.hdr(X-Class) -m str batch }} "
            f"{{ nbsrv({split}) gt 0 }}",
        )
    batch = {s.server for s in sides["batch_workers"]}
    if batch & {s.server for s in sides["interactive_workers"]}:
        return refuse("bad_parameters", f"split_pools of {rec.target}: a worker on both sides")
    own = batch_backend(shared[0])
    split_now = {s.server for s in observed.pool(own) if s.admin != "maint"}
    if split_now and split_now != batch:
        return refuse(
            "already_split",
            f"split_pools of {rec.target}: {own} serves the batch class from "
            f"{', '.join(sorted(split_now))} already, not {', '.join(sorted(batch))}; to split "
            f"otherwise, a person first puts {own}'s servers in maint and readies them in "
            f"{shared[0]}",
        )
    first = [
        _Want(s, "admin", "ready" if s.server in batch else "maint")
        for side in sides.values()
        for s in side
        if s.backend == own
    ]
    if not all(_met(w) for w in first):
        return first
    return first + [
        _Want(s, "admin", "maint") for s in sides["batch_workers"] if s.backend == shared[0]
    ]


def _servers_named(workers: object, observed: Observed) -> list[ObservedServer] | str:
    """The servers named as the analyzer's workers, all in one backend, or each in the same
    backends at one address (a share pool's tenant backends: the worker behind each); else
    why not."""
    if not isinstance(workers, list) or not workers:
        return "names no worker (the telemetry did not say which serves it)"
    if not all(isinstance(w, str) for w in workers):
        return f"workers {workers!r} are not all names"
    found: list[ObservedServer] = []
    for name in workers:
        matches = [s for s in observed.servers.values() if s.server == name]
        if len({(s.address, s.port) for s in matches}) != 1:
            where = "no backend" if not matches else f"{len(matches)} backends, at two addresses"
            return f"worker {name!r} is a server of {where} HAProxy shows"
        found += matches
    if len({frozenset(s.backend for s in found if s.server == w) for w in workers}) > 1:
        return f"workers {workers!r} are servers of more than one backend"
    return found


def _shares(
    rec: Recommendation,
    observed: Observed,
    step: int,
    refuse: Callable[[RefusalReason, str], Refusal],
) -> list[_Want] | Refusal:
    """The analyzer's set_weights: each worker's share of the pool, as weights in proportion."""
    weights = rec.parameters["weights"]
    assert isinstance(weights, list)
    shares: dict[str, float] = {}
    for item in weights:
        if not isinstance(item, Mapping) or not isinstance(item.get("worker"), str):
            return refuse(
                "unknown_target",
                f"{rec.target}: a weight names no worker ({item!r}): no server to give it to",
            )
        share = item.get("weight")
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
            return refuse("bad_parameters", f"share {share!r} of {item['worker']!r} is not 0..1")
        shares[item["worker"]] = shares.get(item["worker"], 0.0) + float(share)
    servers = _servers_named(list(shares), observed)
    if isinstance(servers, str):
        return refuse("unknown_target", f"set_weights of {rec.target}: {servers}")
    if max(shares.values()) <= 0:
        return refuse("bad_parameters", f"set_weights of {rec.target} gives every worker 0")
    if observed.algorithms.get(servers[0].backend) == "leastconn":
        shares = per_connection_weights(shares, weights, rec)
    current = {s.server: s.weight for s in servers}
    if {s.server for s in observed.pool(servers[0].backend)} == set(current):
        # the whole backend: only the proportions route, and any scale of them will do
        weights = _proportional(shares, current, step)
    else:
        weights = _scaled(shares, SHARE_WEIGHT)
    return [_Want(server, "weight", weights[server.server]) for server in servers]


def per_connection_weights(
    shares: Mapping[str, float], items: Sequence[Mapping[str, object]], rec: Recommendation
) -> dict[str, float]:
    """What to weigh each server by for `shares` on a leastconn backend: HAProxy evens out
    requests in flight per unit of weight, and a server holds its requests for as long as its
    card takes, so it is sent its weight times its capacity; the weight is its share over its
    capacity (its GPU's, split over the GPU's workers). Capacity shares come out as equal
    weights: leastconn already sends a slow card less. Where the recommendation gives no
    capacity for a GPU with a share, the shares as they are."""
    capacity = rec.expected.capacity_per_second if rec.expected is not None else {}
    gpu_of = {str(item["worker"]): item.get("gpu") for item in items}
    workers_on = Counter(gpu_of.values())
    out: dict[str, float] = {}
    for worker, share in shares.items():
        gpu = gpu_of[worker]
        each = capacity.get(gpu) if isinstance(gpu, int) else None
        if share > 0 and not (each and each > 0):
            return dict(shares)
        out[worker] = share * workers_on[gpu] / each if share > 0 and each else 0.0
    return out


def _scaled(shares: Mapping[str, float], scale: int) -> dict[str, int]:
    """The shares as weights, the largest `scale` (a share above 0 at least 1)."""
    largest = max(shares.values())
    return {k: max(round(scale * v / largest), 1 if v > 0 else 0) for k, v in shares.items()}


def _share_error(weights: Mapping[str, int], shares: Mapping[str, float]) -> float:
    """The largest difference between a server's share of the weights and the one asked."""
    total, asked = sum(weights.values()), sum(shares.values())
    if total <= 0:
        return math.inf
    return max(abs(weights[k] / total - shares[k] / asked) for k in shares)


def _proportional(
    shares: Mapping[str, float], current: Mapping[str, int], step: int
) -> dict[str, int]:
    """Weights in the proportions of `shares` that the fewest passes of `step` reach from
    `current`: the current ones where their proportions are within `SHARE_TOLERANCE` already
    (the analyzer's shares are estimates: a point's difference is noise, not a change to make),
    else the scale, among those that place the shares as closely as the largest weight
    `SHARE_WEIGHT` would, reached soonest (and of those, nearest `SHARE_WEIGHT`). A ramp of
    weights from 10/1/1/1 to even shares is then 33/33/33/33 in one pass, not four passes of
    the step to 100/100/100/100 whose later three hardly change the routing."""
    if _share_error(current, shares) <= SHARE_TOLERANCE:
        return dict(current)
    bound = max(SHARE_TOLERANCE, _share_error(_scaled(shares, SHARE_WEIGHT), shares))
    best: tuple[tuple[int, int], dict[str, int]] | None = None
    for scale in range(1, MAX_WEIGHT + 1):
        weights = _scaled(shares, scale)
        if max(weights.values()) > MAX_WEIGHT or _share_error(weights, shares) > bound:
            continue
        passes = max(math.ceil(abs(weights[k] - current[k]) / step) for k in weights)
        key = (passes, abs(scale - SHARE_WEIGHT))
        if best is None or key < best[0]:
            best = (key, weights)
    assert best is not None  # SHARE_WEIGHT itself is within the bound
    return best[1]


def _contradictory(wants: Mapping[str, list[_Want]]) -> dict[str, list[str]]:
    """Each recommendation asking a server for a value another one asks differently -> those."""
    asked: dict[tuple[str, str], dict[str, object]] = {}
    for rec_id, ws in wants.items():
        for w in ws:
            asked.setdefault((w.server.key, w.attribute), {})[rec_id] = w.value
    split: dict[str, set[str]] = {}
    for values in asked.values():
        if len(set(values.values())) > 1:
            for rec_id in values:
                split.setdefault(rec_id, set()).update(set(values) - {rec_id})
    return {rec_id: sorted(others) for rec_id, others in sorted(split.items())}


def _describe(ws: list[_Want]) -> str:
    return ", ".join(f"{w.server.key} {w.attribute} {w.value}" for w in ws)


def _met(want: _Want) -> bool:
    if want.attribute == "weight":
        return want.server.weight == want.value
    # a server in maint takes no new requests already: a drain leaves it there
    return want.server.admin == want.value or (want.value, want.server.admin) == ("drain", "maint")


def _step(
    want: _Want,
    rec: Recommendation,
    now: float,
    history: Sequence[Applied],
    settings: Settings,
) -> Change | Refusal:
    server = want.server
    if want.attribute == "weight":
        assert isinstance(want.value, int)
        delta = max(
            -settings.max_weight_step, min(settings.max_weight_step, want.value - server.weight)
        )
        return Change(
            "set_weight",
            server.backend,
            server.server,
            server.weight + delta,
            server.weight,
            rec.id,
            rec.cost_rank,
            server.initial_weight,
        )
    state = want.value
    if state == "maint" and server.admin != "drain":
        # maint only from drain: the requests in flight finish before the server leaves
        state = "drain"
    elif state == "maint" and server.sessions > 0:
        drained = [a.at_seconds for a in history if a.key == server.key and a.action == "drain"]
        since = max(drained) if drained else rec.created_seconds
        if now - since > settings.drain_timeout_seconds:
            return Refusal(
                rec.id,
                "drain_timeout",
                f"{server.key} still has {server.sessions} sessions {now - since:.0f} s after "
                f"its drain (limit {settings.drain_timeout_seconds:.0f} s); it stays drained",
                ack="failed",
                target=rec.target,
            )
        return Refusal(
            rec.id,
            "draining",
            f"{server.key} drains: {server.sessions} sessions left",
            target=rec.target,
        )
    return Change(
        "set_state", server.backend, server.server, state, server.admin, rec.id, rec.cost_rank
    )


def plan_moves(
    moves: Sequence[Recommendation],
    observed: Observed,
    history: Sequence[Applied],
    changes: Sequence[Change],
    settings: Settings,
) -> tuple[list[Recommendation], list[Refusal]]:
    """The `move_worker` recommendations the mover may admit now, `to` as the backend, and a
    refusal or a wait for each of the others."""
    passed: list[Recommendation] = []
    refusals: list[Refusal] = []
    for rec in moves:
        checked = _move(rec, observed, history, changes, settings)
        if isinstance(checked, Refusal):
            refusals.append(checked)
        else:
            passed.append(checked)
    return passed, refusals


def _move(
    rec: Recommendation,
    observed: Observed,
    history: Sequence[Applied],
    changes: Sequence[Change],
    settings: Settings,
) -> Recommendation | Refusal:
    now = observed.at_seconds

    def refuse(reason: RefusalReason, detail: str, ack: bool = True) -> Refusal:
        return Refusal(rec.id, reason, detail, "rejected" if ack else None, rec.target)

    expired = _check(rec, now, settings)
    if expired is not None:
        return expired
    to = rec.parameters.get("to")
    if isinstance(to, str) and to not in observed.backends and "to_workers" in rec.parameters:
        # the analyzer's pool, not a backend: the backend its workers are servers of
        servers = _servers_named(rec.parameters.get("to_workers"), observed)
        if isinstance(servers, str):
            return refuse(
                "unknown_target", f"move_worker to {to!r}: no such backend, and {servers}"
            )
        to = servers[0].backend
        rec = replace(rec, parameters={**rec.parameters, "to": to})
    for named in ("workers", "to_workers"):
        servers = _servers_named(rec.parameters.get(named), observed)
        if not isinstance(servers, str) and len({s.backend for s in servers}) > 1:
            return refuse(
                "unsupported_action",
                f"move_worker: {named} {rec.parameters[named]!r} serve the tenant backends "
                f"{', '.join(sorted({s.backend for s in servers}))}, and a move changes one "
                "backend; change the pool's servers in the config and render it again",
            )
    gpu = rec.parameters.get("gpu")
    frozen = [
        a.at_seconds
        for a in history
        if a.key == f"gpu:{gpu}"
        and a.recommendation_id != rec.id
        and now - a.at_seconds < settings.freeze_seconds
    ]
    if frozen:
        return refuse(
            "frozen",
            f"GPU {gpu} moved {now - max(frozen):.0f} s ago "
            f"(freeze {settings.freeze_seconds:.0f} s)",
            ack=False,
        )
    # the ladder on the backend it leaves: a pool being re-weighted or drained keeps its
    # capacity until that is done; the one it joins gains a server whatever its weights
    leaving = _servers_named(rec.parameters.get("workers"), observed)
    touched = set() if isinstance(leaving, str) else {s.backend for s in leaving}
    cheaper = sorted(
        {c.backend for c in changes if c.backend in touched and c.cost_rank < rec.cost_rank}
    )
    if cheaper:
        return refuse(
            "ladder",
            f"waits for the cheaper changes planned on {', '.join(cheaper)} to be made first",
            ack=False,
        )
    return rec
