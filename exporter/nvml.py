"""Every NVML call of the exporter goes through one session object.

The session owns initialisation (with backoff while the driver is away), the device list (by
UUID, so a GPU that falls off the bus stays visible as lost), and one capability table per GPU:
the first call of a capability is its probe. NOT_SUPPORTED and a missing symbol
(FunctionNotFound, pynvml's LibraryMismatch) are remembered until the next NVML init, so an
unsupported query is never retried every second; a lost GPU is flagged and skipped while the
others keep answering.

Threads: the GPU collector reads each GPU from a worker thread of its own (NVML is thread-safe,
and pynvml releases the GIL inside each ctypes call), so a device's per-read bookkeeping is
touched by its worker only; what every thread touches (the error counts, the log-once set) is
behind one lock. Init, shutdown, enumeration and events stay on the sampler thread.

Nothing here is specific to gpubalance's fake driver: only the NVML ABI, through pynvml.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, TypeVar

import pynvml

from gpubalance.telemetry import NvmlStatus

log = logging.getLogger(__name__)

T = TypeVar("T")


class Support(Enum):
    SUPPORTED = "supported"
    UNSUPPORTED = "unsupported"  # NVML answered NOT_SUPPORTED
    MISSING = "missing"  # the library lacks the symbol (older driver)


class NvmlGone(Exception):
    """NVML itself stopped answering (uninitialised, driver unloaded): re-init needed."""


# Errors after which no call can succeed until NVML is initialised again.
_SESSION_ERRORS = frozenset(
    {
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
    }
)

_INIT_HINTS = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
        "libnvidia-ml.so.1 not found: install the NVIDIA driver, or pass --nvml-library PATH"
    ),
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: (
        "NVIDIA kernel driver not loaded (check `lsmod | grep nvidia`)"
    ),
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "NVML library and kernel driver versions differ: reboot or reload the nvidia module"
    ),
    pynvml.NVML_ERROR_NO_PERMISSION: (
        "no permission to open /dev/nvidia*: run as a user in the video group"
    ),
}


def error_name(exc: BaseException) -> str:
    """A stable name for an NVML failure, used as a label value."""
    if isinstance(exc, pynvml.NVMLLibraryMismatchError):
        return "LIBRARY_MISMATCH"
    if isinstance(exc, pynvml.NVMLError):
        for name in dir(pynvml):
            if name.startswith("NVML_ERROR_") and getattr(pynvml, name) == exc.value:
                return name.removeprefix("NVML_ERROR_")
        return f"ERROR_{exc.value}"
    return type(exc).__name__


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


@dataclass
class Device:
    """One GPU as the session knows it. Mutable bookkeeping lives here, not in samples."""

    index: int
    uuid: str
    handle: Any
    name: str | None = None
    pci_bus_id: str | None = None
    lost: bool = False
    lost_at: float | None = None
    capabilities: dict[str, Support] = field(default_factory=dict)
    # the pynvml function in flight on this GPU (or the last one started): what a stuck read
    # is stuck in
    current_call: str | None = None
    # collector bookkeeping that must survive between samples
    last_utilization_sample_us: int = 0
    last_process_sample_us: int = 0
    xid_errors_total: Counter[int] = field(default_factory=Counter)
    last_xid: int | None = None
    static: dict[str, Any] = field(default_factory=dict)

    def supported(self) -> dict[str, bool]:
        # dict() copies in one step: the GPU's worker may be adding a probe result meanwhile
        capabilities = dict(self.capabilities)
        return {cap: state is Support.SUPPORTED for cap, state in capabilities.items()}


def _placeholder_uuid(index: int) -> str:
    """The UUID a GPU goes by when it was lost before NVML told its real one."""
    return f"GPU-unknown-{index}"


def library_problem(path: str) -> str | None:
    """Why ``path`` cannot be libnvidia-ml.so.1, or None. Checked once at start: retrying
    cannot make a missing file appear or another library grow NVML's entry points."""
    if "/" in path and not os.path.exists(path):
        return f"{path} does not exist"
    if os.path.isdir(path):
        return f"{path} is a directory, not a library"
    try:
        library = ctypes.CDLL(path)
    except OSError as exc:
        return f"cannot load {path}: {exc}"
    if not hasattr(library, "nvmlInit_v2"):
        return f"{path} is not an NVML library (no nvmlInit_v2)"
    return None


class NvmlSession:
    """NVML init/shutdown with backoff, devices by UUID, and the probe-once call wrapper."""

    def __init__(
        self,
        library_path: str | None = None,
        retry_max_seconds: float = 30.0,
        lost_recheck_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.library_path = library_path
        self.retry_max_seconds = retry_max_seconds
        self.lost_recheck_seconds = lost_recheck_seconds
        self._clock = clock
        self._lock = threading.Lock()  # errors_total and _logged_missing, shared by workers
        self._library: ctypes.CDLL | None = None
        self._up = False
        self._next_attempt = 0.0
        self._backoff = 1.0
        self.status = NvmlStatus(up=False, error="not initialised yet")
        self.devices: list[Device] = []
        self.errors_total: Counter[tuple[str, str]] = Counter()
        self.init_failures_total = 0
        self._logged_missing: set[str] = set()
        self.event_set: Any = None
        self._device_count: int | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def snapshot_status(self) -> NvmlStatus:
        """The status with the error counts as of now, for one sample."""
        errors: dict[str, dict[str, int]] = {}
        with self._lock:
            counts = list(self.errors_total.items())
        for (call, error), count in counts:
            errors.setdefault(call, {})[error] = count
        return replace(
            self.status,
            errors_total=errors,
            init_failures_total=self.init_failures_total,
        )

    def count_error(self, call: str, error: str) -> None:
        with self._lock:  # Counter's += is a read and a write: two workers could lose one
            self.errors_total[(call, error)] += 1

    @property
    def up(self) -> bool:
        return self._up

    def ensure(self) -> bool:
        """Initialise NVML if it is down and the backoff allows; return whether it is up."""
        if self._up:
            return True
        now = self._clock()
        if now < self._next_attempt:
            return False
        try:
            self._init()
        except pynvml.NVMLError as exc:
            self._init_failed(now, f"{error_name(exc)}: {_INIT_HINTS.get(exc.value, str(exc))}")
            return False
        except NvmlGone as exc:
            # Init answered, then the first device query found the driver gone again.
            self.shutdown()
            self._init_failed(now, f"{exc}: NVML stopped answering right after init")
            return False
        except OSError as exc:
            self._init_failed(now, f"cannot load {self.library_path}: {exc}")
            return False
        self._backoff = 1.0
        return True

    def _init_failed(self, now: float, error: str) -> None:
        self.init_failures_total += 1
        self.status = NvmlStatus(up=False, error=error)
        self._next_attempt = now + self._backoff
        log.warning("NVML init failed (%s); retrying in %.0f s", error, self._backoff)
        self._backoff = min(self._backoff * 2, self.retry_max_seconds)

    def _preload(self) -> None:
        # Loading the library by absolute path first makes pynvml's CDLL("libnvidia-ml.so.1")
        # resolve to it: the dynamic loader matches the already-loaded object by SONAME.
        if self.library_path and self._library is None:
            self._library = ctypes.CDLL(self.library_path)

    def _init(self) -> None:
        self._preload()
        pynvml.nvmlInit()
        if self._library is not None and pynvml.nvmlLib._handle != self._library._handle:
            pynvml.nvmlShutdown()
            raise OSError(
                "pynvml loaded another libnvidia-ml.so.1; the library given lacks the SONAME "
                "libnvidia-ml.so.1, or a real driver was loaded first"
            )
        self._up = True
        self.status = NvmlStatus(
            up=True,
            driver_version=self._optional(pynvml.nvmlSystemGetDriverVersion),
            nvml_version=self._optional(pynvml.nvmlSystemGetNVMLVersion),
            cuda_driver_version=self._optional(pynvml.nvmlSystemGetCudaDriverVersion),
        )
        # A re-init forgets every probe (the driver behind it may be another one): shutdown
        # marked every known GPU lost, and each comes back, probed afresh, as it answers.
        self._create_event_set()
        self.refresh_devices()
        log.info("NVML up: driver %s, %d GPU(s)", self.status.driver_version, len(self.devices))

    def _optional(self, fn: Callable[[], T]) -> T | None:
        try:
            value = fn()
        except pynvml.NVMLError as exc:
            self.count_error(fn.__name__, error_name(exc))
            return None
        return _text(value) if isinstance(value, bytes) else value  # type: ignore[return-value]

    def _create_event_set(self) -> None:
        try:
            self.event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            self.count_error("nvmlEventSetCreate", error_name(exc))
            self.event_set = None

    def shutdown(self) -> None:
        if not self._up:
            return
        self._up = False
        # Without NVML nothing is known about any GPU: each stays listed, as lost, until it
        # answers again; a worker still inside a read finds its GPU lost and skips the rest.
        now = self._clock()
        for device in self.devices:
            if not device.lost:
                device.lost, device.lost_at = True, now
        try:
            if self.event_set is not None:
                pynvml.nvmlEventSetFree(self.event_set)
        except pynvml.NVMLError:
            pass
        self.event_set = None
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()

    def lose_session(self, exc: BaseException) -> None:
        """NVML stopped answering mid-run: shut down and retry init with backoff."""
        log.warning("NVML stopped answering (%s); will re-initialise", error_name(exc))
        self.shutdown()
        self.status = NvmlStatus(up=False, error=f"{error_name(exc)}: NVML stopped answering")
        self._next_attempt = self._clock() + self._backoff

    # -- devices ---------------------------------------------------------------------------

    def _count(self) -> int | None:
        try:
            return pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            self._raise_if_session_error(exc)
            self.count_error("nvmlDeviceGetCount", error_name(exc))
            return None

    def refresh_devices(self, count: int | None = None) -> None:
        """Enumerate GPUs; keep known ones by UUID, flag those that disappeared as lost."""
        count = self._count() if count is None else count
        if count is None:
            return
        self._device_count = count
        now = self._clock()
        by_uuid = {d.uuid: d for d in self.devices}
        by_index = {d.index: d for d in self.devices}
        current: dict[str, Device] = {}
        for index in range(count):
            device = self._open(index, by_uuid.get, by_index.get(index), now)
            if device is not None:
                current[device.uuid] = device
        answering = {d.index for d in current.values() if not d.lost}
        for device in self.devices:
            if device.uuid == _placeholder_uuid(device.index) and device.index in answering:
                continue  # the GPU lost before NVML told its UUID: it answers under it now
            if device.uuid not in current:
                if not device.lost:
                    log.warning("GPU %d (%s) is gone from NVML", device.index, device.uuid)
                    device.lost, device.lost_at = True, now
                current[device.uuid] = device
        self.devices = sorted(current.values(), key=lambda d: d.index)

    def _open(
        self,
        index: int,
        known: Callable[[str], Device | None],
        at_index: Device | None,
        now: float,
    ) -> Device | None:
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        except pynvml.NVMLError as exc:
            self._raise_if_session_error(exc)
            self.count_error("nvmlDeviceGetHandleByIndex", error_name(exc))
            if exc.value != pynvml.NVML_ERROR_GPU_IS_LOST:
                return None
            device = at_index or Device(index=index, uuid=_placeholder_uuid(index), handle=None)
            if not device.lost:
                log.warning("GPU %d (%s) is lost", index, device.uuid)
                device.lost, device.lost_at = True, now
            return device
        device = known(uuid)
        if device is None or device.lost:
            # New, or back from the dead: probe everything again.
            was_lost = device is not None or (
                at_index is not None and at_index.lost and at_index.uuid == _placeholder_uuid(index)
            )
            if was_lost:
                log.info("GPU %d (%s) recovered: NVML answers for it again", index, uuid)
            device = Device(index=index, uuid=uuid, handle=handle)
            device.name = self._static(device, "name", pynvml.nvmlDeviceGetName, handle)
            pci = self._static(device, "pci_info", pynvml.nvmlDeviceGetPciInfo, handle)
            device.pci_bus_id = _text(pci.busId) if pci is not None else None
            self._register_events(device)
        device.index, device.handle = index, handle
        return device

    def _static(self, device: Device, capability: str, fn: Callable[..., Any], *args: Any) -> Any:
        value = self.query(device, capability, fn, *args)
        return _text(value) if isinstance(value, bytes) else value

    def _register_events(self, device: Device) -> None:
        if self.event_set is None:
            return
        self.query(
            device,
            "xid_events",
            pynvml.nvmlDeviceRegisterEvents,
            device.handle,
            pynvml.nvmlEventTypeXidCriticalError,
            self.event_set,
        )

    def check_topology(self) -> None:
        """Once per sample: pick up hot-added or removed GPUs and re-check lost ones."""
        count = self._count()
        if count is None:
            return
        now = self._clock()
        recheck = any(
            d.lost and d.lost_at is not None and now - d.lost_at >= self.lost_recheck_seconds
            for d in self.devices
        )
        if count != self._device_count or recheck:
            for device in self.devices:
                if device.lost and recheck:
                    device.lost_at = now
            self.refresh_devices(count)

    # -- the one call wrapper --------------------------------------------------------------

    def query(
        self,
        device: Device,
        capability: str,
        fn: Callable[..., T],
        *args: Any,
        not_found: Any = None,
        **kwargs: Any,
    ) -> T | None:
        """Call ``fn``; its first call for this GPU is the capability's probe.

        Returns None when the value cannot be had (unsupported, missing, lost GPU, transient
        error, counted in ``errors_total``). NOT_FOUND returns ``not_found``: NVML uses it for
        "no samples since the time stamp given", which is data, not an error.
        """
        if device.lost:
            return None
        state = device.capabilities.get(capability)
        if state is Support.UNSUPPORTED or state is Support.MISSING:
            return None
        device.current_call = fn.__name__
        try:
            value = fn(*args, **kwargs)
        except pynvml.NVMLLibraryMismatchError:
            self._missing(device, capability, fn.__name__)
            return None
        except pynvml.NVMLError as exc:
            return self._failed(device, capability, fn.__name__, exc, not_found)
        device.capabilities[capability] = Support.SUPPORTED
        return value

    def _failed(
        self, device: Device, capability: str, call: str, exc: pynvml.NVMLError, not_found: Any
    ) -> Any:
        code = exc.value
        if code == pynvml.NVML_ERROR_NOT_FOUND and not_found is not None:
            device.capabilities[capability] = Support.SUPPORTED
            return not_found
        if code == pynvml.NVML_ERROR_NOT_SUPPORTED:
            device.capabilities[capability] = Support.UNSUPPORTED
            log.debug("GPU %d: %s not supported (%s)", device.index, capability, call)
            return None
        if code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
            self._missing(device, capability, call)
            return None
        self.count_error(call, error_name(exc))
        if code == pynvml.NVML_ERROR_GPU_IS_LOST:
            if not device.lost:
                log.warning("GPU %d (%s) is lost", device.index, device.uuid)
            device.lost, device.lost_at = True, self._clock()
            return None
        self._raise_if_session_error(exc)
        return None

    def _missing(self, device: Device, capability: str, call: str) -> None:
        device.capabilities[capability] = Support.MISSING
        with self._lock:
            first = call not in self._logged_missing
            self._logged_missing.add(call)
        if first:
            log.warning(
                "%s is missing from this NVML library (driver %s, nvidia-ml-py %s): "
                "%s degrades to unsupported",
                call,
                self.status.driver_version,
                getattr(pynvml, "__version__", "?"),
                capability,
            )

    def _raise_if_session_error(self, exc: pynvml.NVMLError) -> None:
        if exc.value in _SESSION_ERRORS:
            raise NvmlGone(error_name(exc)) from exc
