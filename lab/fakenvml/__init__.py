"""A fake `libnvidia-ml.so.1` serving the NVML C ABI from a state file.

`build_library()` compiles the C library; a simulator drives it by rewriting
the state file with `write_state()`. README.md documents the state keys.
"""

from gpubalance.lab.fakenvml.build import (
    EXPORTED_SYMBOLS,
    LIBRARY_NAME,
    TEST_HOOKS,
    BuildError,
    build_library,
)
from gpubalance.lab.fakenvml.state import (
    EVENT_TYPE_XID,
    THROTTLE_REASONS,
    read_state,
    render_state,
    write_state,
)

__all__ = [
    "EVENT_TYPE_XID",
    "EXPORTED_SYMBOLS",
    "LIBRARY_NAME",
    "TEST_HOOKS",
    "THROTTLE_REASONS",
    "BuildError",
    "build_library",
    "read_state",
    "render_state",
    "write_state",
]
