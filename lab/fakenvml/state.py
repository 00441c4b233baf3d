"""Write and read the fake NVML driver's state file: flat `key = value` text.

README.md in this package lists every key. A simulator calls `write_state()`
as often as it likes; the library notices each new version on its next call.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

# Clock event ("throttle") reason bits, as pynvml's nvmlClocksThrottleReason*
# constants; `throttle_reasons` takes an OR of them.
THROTTLE_REASONS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
    "board_limit": 0x200,
    "reliability": 0x400,
}

# The only event type the fake delivers (nvmlEventTypeXidCriticalError).
EVENT_TYPE_XID = 0x8

# List keys and how many colon-separated parts each item has at most.
_LIST_KEYS: dict[str, int] = {
    "procs": 2,
    "graphics_procs": 2,
    "mps_procs": 2,
    "procs_util": 5,
    "xid": 1,
}
_ROW_KEYS: dict[str, int] = {"remapped_rows": 4}

_KEY = re.compile(r"[^\s#=][^\s=]*")

_mtime_lock = threading.Lock()
_last_mtime_ns = 0


def render_state(state: Mapping[str, object]) -> str:
    """The state file text for `state`, one `key = value` line per entry."""
    lines = []
    for key, value in state.items():
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"invalid state key {key!r}")
        # most values are plain ints: skip the type dispatch for them
        text = str(value) if type(value) is int else _render_value(key, value)
        lines.append(f"{key} = {text}\n")
    return "".join(lines)


def write_state(path: str | Path, state: Mapping[str, object]) -> None:
    """Replace the state file at `path` atomically.

    Each version gets a strictly increasing nanosecond mtime: with coarse file
    timestamps and inode reuse, two fast rewrites could otherwise look like
    one file to the library's stat() check, and the mtime is also where the
    library's sample history switches to the new values.
    """
    target = Path(path)
    text = render_state(state).encode()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from an exporter run as another user
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        stamp = _next_mtime_ns()
        os.utime(tmp, ns=(stamp, stamp))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_state(path: str | Path) -> dict[str, str]:
    """The raw `key -> value` strings of a state file, later lines winning."""
    state: dict[str, str] = {}
    for number, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{path}:{number}: expected 'key = value', got {raw!r}")
        state[key.strip()] = value.strip()
    return state


def _next_mtime_ns() -> int:
    global _last_mtime_ns
    with _mtime_lock:
        _last_mtime_ns = max(time.time_ns(), _last_mtime_ns + 1)
        return _last_mtime_ns


def _render_value(key: str, value: object) -> str:
    # gpu3.procs and gpu*.procs are the device key procs
    base = key.split(".", 1)[1] if key.startswith("gpu") and "." in key else key
    if isinstance(value, str):
        return _render_scalar(key, value)
    if base in _LIST_KEYS:
        if not isinstance(value, list | tuple):
            raise TypeError(f"state key {key!r}: expected a list, got {type(value).__name__}")
        return ",".join(_render_row(key, item, _LIST_KEYS[base]) for item in value)
    if base in _ROW_KEYS:
        return _render_row(key, value, _ROW_KEYS[base])
    return _render_scalar(key, value)


def _render_row(key: str, item: object, max_parts: int) -> str:
    parts = (item,) if isinstance(item, int) else item
    if not isinstance(parts, list | tuple) or not 1 <= len(parts) <= max_parts:
        raise ValueError(f"state key {key!r}: expected up to {max_parts} numbers, got {item!r}")
    return ":".join(_render_scalar(key, part) for part in parts)


def _render_scalar(key: str, value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        if "\n" in value or "\r" in value or value != value.strip():
            raise ValueError(f"state key {key!r}: value {value!r} would not survive the file")
        return value
    raise TypeError(f"state key {key!r}: cannot write a {type(value).__name__}")
