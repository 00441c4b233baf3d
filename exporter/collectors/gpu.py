"""GPU collector: one GpuSample per GPU from NVML, through the probe-once session.

Each GPU is read by a worker thread of its own, against a deadline per sample: a card falling
off the bus can hold an NVML call for seconds, and it must cost its own reading, not every
GPU's. A GPU that misses the deadline is served as stale, naming the call it is stuck in; its
worker gets no second read while the first is still running, so a stuck driver call never
piles up threads (one worker per GPU, for the life of the collector).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pynvml

from gpubalance.exporter.collectors.base import SampleParts, register
from gpubalance.exporter.config import ExporterConfig
from gpubalance.exporter.nvml import Device, NvmlGone, NvmlSession, Support, error_name
from gpubalance.telemetry import GpuProcess, GpuSample

log = logging.getLogger(__name__)

MIB = 1024 * 1024
KIB = 1024
MHZ = 1_000_000.0

# Clock-event ("throttle") reason bits by the names the exposition uses.
THROTTLE_REASONS: dict[str, int] = {
    "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
    "applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
    "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
    "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
    "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "display_clock_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
    # Only the older constant names carry these two bits in nvidia-ml-py 13.x.
    "board_limit": pynvml.nvmlClocksThrottleReasonBoardLimit,
    "reliability": pynvml.nvmlClocksThrottleReasonReliability,
}

# Field-value ids read in one batched call, by the capability each one stands for.
FIELDS: dict[str, tuple[int, ...]] = {
    "memory_temperature": (pynvml.NVML_FI_DEV_MEMORY_TEMP,),
    "nvlink_throughput": (
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
    ),
}

_VALUE_MEMBERS = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}

_EMPTY: tuple[Any, ...] = ()


def _union_value(value_type: int, value: Any) -> float:
    return float(getattr(value, _VALUE_MEMBERS.get(value_type, "ullVal")))


def _ratio(percent: float | None) -> float | None:
    return None if percent is None else percent / 100.0


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


class _Worker:
    """The one thread that reads one GPU: a read at a time, handed over by the sampler."""

    def __init__(self, name: str, read: Callable[[Device], GpuSample]) -> None:
        self._read = read
        self._jobs: queue.SimpleQueue[Device | None] = queue.SimpleQueue()
        self._done = threading.Event()
        self._done.set()
        self._result: GpuSample | BaseException | None = None
        self.device: Device | None = None  # the GPU of the read in flight, or the last one
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return not self._done.is_set()

    def submit(self, device: Device) -> None:
        self.device, self._result = device, None
        device.current_call = None
        self._done.clear()
        self._jobs.put(device)

    def wait(self, timeout: float) -> GpuSample | BaseException | None:
        """The read's result, or None when it is still running after ``timeout`` seconds."""
        return self._result if self._done.wait(max(timeout, 0.0)) else None

    def close(self) -> None:
        self._jobs.put(None)  # a worker stuck in a call exits once the call returns

    def _run(self) -> None:
        while (device := self._jobs.get()) is not None:
            try:
                result: GpuSample | BaseException = self._read(device)
            except Exception as exc:  # NvmlGone, or a bug: the sampler thread re-raises it
                result = exc
            self._result = result
            self._done.set()  # after the result: Event.set() publishes it to the waiter


class GpuCollector:
    name = "gpu"

    def __init__(self, session: NvmlSession, deadline_seconds: float = 0.5) -> None:
        self.session = session
        self.deadline_seconds = deadline_seconds
        self._workers: dict[str, _Worker] = {}
        self._stale_since: dict[str, float] = {}  # uuid -> monotonic time it went stale

    def update(self, parts: SampleParts) -> None:
        session = self.session
        if not session.ensure():
            self._unreachable(parts)
            raise RuntimeError(f"NVML unavailable: {session.status.error}")
        try:
            session.check_topology()
            self._drain_xid_events()
            parts.gpus = self._read_all(session.devices)
        except NvmlGone as exc:
            session.lose_session(exc)
            self._unreachable(parts)
            raise RuntimeError(f"NVML stopped answering: {exc}") from None
        parts.nvml = session.snapshot_status()

    def close(self) -> None:
        for worker in self._workers.values():
            worker.close()
        self._workers.clear()
        self.session.shutdown()

    def _unreachable(self, parts: SampleParts) -> None:
        # NVML is down: the GPUs known before are still there as far as anyone knows, and
        # their series say lost and stale rather than vanish.
        parts.nvml = self.session.snapshot_status()
        parts.gpus = tuple(
            _stale_sample(device, "nvmlInit", lost=True) for device in self.session.devices
        )

    # -- every GPU against one deadline ---------------------------------------------------

    def _read_all(self, devices: Sequence[Device]) -> tuple[GpuSample, ...]:
        deadline = time.monotonic() + self.deadline_seconds
        submitted: set[str] = set()
        for device in devices:
            if device.lost:
                continue
            worker = self._workers.get(device.uuid)
            if worker is None:
                worker = self._workers[device.uuid] = _Worker(
                    f"gpubalance-gpu{device.index}", self.read
                )
            if not worker.busy:  # busy: still inside an earlier read, which gets no company
                worker.submit(device)
                submitted.add(device.uuid)
        gpus = []
        for device in devices:
            if device.lost:
                gpus.append(self._lost(device))
                continue
            worker = self._workers[device.uuid]
            result = None
            if device.uuid in submitted:
                result = worker.wait(deadline - time.monotonic())
            if isinstance(result, BaseException):
                raise result
            if result is None:
                stuck_in = worker.device.current_call if worker.device is not None else None
                self._went_stale(device, stuck_in)
                gpus.append(_stale_sample(device, stuck_in))
            else:
                self._answered(device)
                gpus.append(result)
        self._retire_workers({d.uuid for d in devices})
        return tuple(gpus)

    def _went_stale(self, device: Device, call: str | None) -> None:
        if device.uuid in self._stale_since:
            return
        self._stale_since[device.uuid] = time.monotonic()
        log.warning(
            "GPU %d (%s): no NVML reading within the %.2f s deadline, stuck in %s; served as "
            "stale, without readings, until it answers in time",
            device.index,
            device.uuid,
            self.deadline_seconds,
            call or "the worker thread, before any call",
        )

    def _answered(self, device: Device) -> None:
        since = self._stale_since.pop(device.uuid, None)
        if since is not None:
            log.info(
                "GPU %d (%s) recovered: NVML answered within the deadline after %.1f s stale",
                device.index,
                device.uuid,
                time.monotonic() - since,
            )

    def _retire_workers(self, present: set[str]) -> None:
        # Only an idle worker goes: a stuck one stays counted for its UUID, so the GPU coming
        # back under it never gets a second thread.
        for uuid in [u for u, w in self._workers.items() if u not in present and not w.busy]:
            self._workers.pop(uuid).close()

    # -- one GPU ---------------------------------------------------------------------------

    def read(self, device: Device) -> GpuSample:
        if device.lost:
            return self._lost(device)
        q = self.session.query
        h = device.handle

        samples = self._utilization_samples(device)
        rates = q(device, "utilization", pynvml.nvmlDeviceGetUtilizationRates, h)
        encoder = q(device, "encoder_utilization", pynvml.nvmlDeviceGetEncoderUtilization, h)
        decoder = q(device, "decoder_utilization", pynvml.nvmlDeviceGetDecoderUtilization, h)
        memory = self._memory(device)
        temperature = self._temperature(device)
        power = q(device, "power", pynvml.nvmlDeviceGetPowerUsage, h)
        limit = q(device, "power_limit", pynvml.nvmlDeviceGetEnforcedPowerLimit, h)
        energy = q(device, "energy", pynvml.nvmlDeviceGetTotalEnergyConsumption, h)
        sm_clock = q(device, "sm_clock", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)
        mem_clock = q(
            device, "memory_clock", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM
        )
        gr_clock = q(
            device, "graphics_clock", pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_GRAPHICS
        )
        max_clocks = self._max_clocks(device)
        reasons = self._throttle_reasons(device)
        tx = q(
            device,
            "pcie_throughput",
            pynvml.nvmlDeviceGetPcieThroughput,
            h,
            pynvml.NVML_PCIE_UTIL_TX_BYTES,
        )
        rx = q(
            device,
            "pcie_throughput",
            pynvml.nvmlDeviceGetPcieThroughput,
            h,
            pynvml.NVML_PCIE_UTIL_RX_BYTES,
        )
        replays = q(device, "pcie_replay_counter", pynvml.nvmlDeviceGetPcieReplayCounter, h)
        fan = q(device, "fan_speed", pynvml.nvmlDeviceGetFanSpeed, h)
        fields = self._field_values(device)
        remapped = q(device, "remapped_rows", pynvml.nvmlDeviceGetRemappedRows, h)
        processes = self._processes(device)
        if device.lost:  # lost during this very read
            return self._lost(device)

        xid_supported = device.capabilities.get("xid_events") is Support.SUPPORTED
        nvlink = fields.get("nvlink_throughput")
        return GpuSample(
            index=device.index,
            uuid=device.uuid,
            name=device.name,
            pci_bus_id=device.pci_bus_id,
            utilization_ratio=_ratio(rates.gpu) if rates is not None else None,
            utilization_samples=samples,
            memory_utilization_ratio=_ratio(rates.memory) if rates is not None else None,
            encoder_utilization_ratio=_ratio(encoder[0]) if encoder is not None else None,
            decoder_utilization_ratio=_ratio(decoder[0]) if decoder is not None else None,
            memory_total_bytes=memory[0],
            memory_used_bytes=memory[1],
            memory_free_bytes=memory[2],
            memory_reserved_bytes=memory[3],
            temperature_celsius=None if temperature is None else float(temperature),
            memory_temperature_celsius=(fields.get("memory_temperature") or (None,))[0],
            power_watts=_scaled(power, 1e-3),
            power_limit_watts=_scaled(limit, 1e-3),
            energy_joules_total=_scaled(energy, 1e-3),
            sm_clock_hertz=_scaled(sm_clock, MHZ),
            memory_clock_hertz=_scaled(mem_clock, MHZ),
            graphics_clock_hertz=_scaled(gr_clock, MHZ),
            max_sm_clock_hertz=_scaled(max_clocks.get("sm"), MHZ),
            max_memory_clock_hertz=_scaled(max_clocks.get("memory"), MHZ),
            throttle_reasons=reasons,
            pcie_tx_bytes_per_second=_scaled(tx, KIB),
            pcie_rx_bytes_per_second=_scaled(rx, KIB),
            pcie_replays_total=replays,
            fan_speed_ratio=_ratio(fan),
            nvlink_bytes_total=None if nvlink is None else int(sum(nvlink) * KIB),
            remapped_rows_correctable_total=remapped[0] if remapped else None,
            remapped_rows_uncorrectable_total=remapped[1] if remapped else None,
            remapped_rows_failure=bool(remapped[3]) if remapped else None,
            xid_errors_total=dict(device.xid_errors_total) if xid_supported else None,
            last_xid=device.last_xid,
            processes=processes,
            supported=device.supported(),
        )

    @staticmethod
    def _lost(device: Device) -> GpuSample:
        return GpuSample(
            index=device.index,
            uuid=device.uuid,
            name=device.name,
            pci_bus_id=device.pci_bus_id,
            lost=True,
            supported=device.supported(),
        )

    def _utilization_samples(self, device: Device) -> tuple[tuple[float, float], ...]:
        result = self.session.query(
            device,
            "utilization_samples",
            pynvml.nvmlDeviceGetSamples,
            device.handle,
            pynvml.NVML_GPU_UTILIZATION_SAMPLES,
            device.last_utilization_sample_us,
            not_found=_EMPTY,
        )
        if not result:
            return ()
        value_type, raw = result
        samples = []
        for entry in raw:
            stamp = int(entry.timeStamp)
            if stamp <= device.last_utilization_sample_us:
                continue
            samples.append((stamp / 1e6, _union_value(value_type, entry.sampleValue) / 100.0))
        if samples:
            device.last_utilization_sample_us = max(int(e.timeStamp) for e in raw)
        samples.sort()
        return tuple(samples)

    def _memory(self, device: Device) -> tuple[int | None, int | None, int | None, int | None]:
        q = self.session.query
        info = q(
            device,
            "memory",
            pynvml.nvmlDeviceGetMemoryInfo,
            device.handle,
            version=pynvml.nvmlMemory_v2,
        )
        if info is not None:
            return int(info.total), int(info.used), int(info.free), int(info.reserved)
        if device.capabilities.get("memory") is None:
            return None, None, None, None  # transient failure: no fallback guesswork
        # Older drivers lack the v2 struct; v1 "used" includes the reserved memory.
        info = q(device, "memory_v1", pynvml.nvmlDeviceGetMemoryInfo, device.handle)
        if info is None:
            return None, None, None, None
        return int(info.total), int(info.used), int(info.free), None

    def _temperature(self, device: Device) -> int | None:
        q = self.session.query
        value = q(
            device,
            "temperature",
            pynvml.nvmlDeviceGetTemperatureV,
            device.handle,
            pynvml.NVML_TEMPERATURE_GPU,
        )
        if value is not None or device.capabilities.get("temperature") is None:
            return value
        # nvmlDeviceGetTemperatureV arrived with R565; older drivers answer the classic call.
        return q(
            device,
            "temperature_v1",
            pynvml.nvmlDeviceGetTemperature,
            device.handle,
            pynvml.NVML_TEMPERATURE_GPU,
        )

    def _max_clocks(self, device: Device) -> dict[str, int]:
        cached = device.static.get("max_clocks")
        if cached is not None:
            return cached
        q = self.session.query
        clocks = {}
        for name, clock in (("sm", pynvml.NVML_CLOCK_SM), ("memory", pynvml.NVML_CLOCK_MEM)):
            value = q(device, "max_clocks", pynvml.nvmlDeviceGetMaxClockInfo, device.handle, clock)
            if value is not None:
                clocks[name] = value
        if device.capabilities.get("max_clocks") is not None:
            device.static["max_clocks"] = clocks  # static for the life of the driver
        return clocks

    def _throttle_reasons(self, device: Device) -> frozenset[str] | None:
        q = self.session.query
        mask = q(
            device, "throttle_reasons", pynvml.nvmlDeviceGetCurrentClocksEventReasons, device.handle
        )
        if mask is None and device.capabilities.get("throttle_reasons") is not None:
            # Drivers before R535 know only the older name of the same query.
            mask = q(
                device,
                "throttle_reasons_v1",
                pynvml.nvmlDeviceGetCurrentClocksThrottleReasons,
                device.handle,
            )
        if mask is None:
            return None
        return frozenset(name for name, bit in THROTTLE_REASONS.items() if mask & bit)

    def _field_values(self, device: Device) -> dict[str, tuple[float, ...]]:
        wanted = [
            cap for cap in FIELDS if device.capabilities.get(cap) in (None, Support.SUPPORTED)
        ]
        if not wanted:
            return {}
        ids = [fid for cap in wanted for fid in FIELDS[cap]]
        values = self.session.query(
            device, "field_values", pynvml.nvmlDeviceGetFieldValues, device.handle, ids
        )
        if values is None:
            return {}
        by_id = {int(v.fieldId): v for v in values}
        result: dict[str, tuple[float, ...]] = {}
        for cap in wanted:
            entries = [by_id[fid] for fid in FIELDS[cap]]
            failed = [e.nvmlReturn for e in entries if e.nvmlReturn != pynvml.NVML_SUCCESS]
            if not failed:
                device.capabilities[cap] = Support.SUPPORTED
                result[cap] = tuple(_union_value(e.valueType, e.value) for e in entries)
                continue
            code = failed[0]
            if code in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                device.capabilities[cap] = Support.UNSUPPORTED
            else:
                self.session.count_error(
                    f"nvmlDeviceGetFieldValues[{cap}]", error_name(pynvml.NVMLError(code))
                )
        return result

    def _processes(self, device: Device) -> tuple[GpuProcess, ...]:
        q = self.session.query
        memory: dict[int, int | None] = {}
        for capability, fn in (
            ("compute_processes", pynvml.nvmlDeviceGetComputeRunningProcesses),
            ("graphics_processes", pynvml.nvmlDeviceGetGraphicsRunningProcesses),
        ):
            for proc in q(device, capability, fn, device.handle) or ():
                used = proc.usedGpuMemory
                previous = memory.get(proc.pid)
                memory[proc.pid] = used if previous is None else max(previous, used or 0)
        if not memory:
            return ()
        utilization = self._process_utilization(device)
        supported = device.supported().get("process_utilization", False)
        processes = []
        for pid in sorted(memory):
            sm, mem = utilization.get(pid, (0.0, 0.0)) if supported else (None, None)
            processes.append(GpuProcess(pid, memory[pid], sm, mem))
        return tuple(processes)

    def _process_utilization(self, device: Device) -> dict[int, tuple[float, float]]:
        samples: Iterable[Any] = (
            self.session.query(
                device,
                "process_utilization",
                pynvml.nvmlDeviceGetProcessUtilization,
                device.handle,
                device.last_process_sample_us,
                not_found=_EMPTY,
            )
            or ()
        )
        latest: dict[int, Any] = {}
        for entry in samples:
            current = latest.get(entry.pid)
            if current is None or entry.timeStamp > current.timeStamp:
                latest[entry.pid] = entry
        if latest:
            device.last_process_sample_us = max(int(e.timeStamp) for e in latest.values())
        return {pid: (e.smUtil / 100.0, e.memUtil / 100.0) for pid, e in latest.items()}

    # -- XID events ------------------------------------------------------------------------

    def _drain_xid_events(self) -> None:
        session = self.session
        if session.event_set is None:
            return
        by_uuid = {d.uuid: d for d in session.devices}
        for _ in range(1024):  # bounded: a storm of events must not stall the sample
            try:
                data = pynvml.nvmlEventSetWait_v2(session.event_set, 0)
            except pynvml.NVMLError as exc:
                if exc.value != pynvml.NVML_ERROR_TIMEOUT:
                    session.count_error("nvmlEventSetWait_v2", error_name(exc))
                return
            if not data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                continue
            try:
                uuid = pynvml.nvmlDeviceGetUUID(data.device)
            except pynvml.NVMLError as exc:
                session.count_error("nvmlDeviceGetUUID", error_name(exc))
                continue
            device = by_uuid.get(uuid.decode() if isinstance(uuid, bytes) else uuid)
            if device is not None:
                xid = int(data.eventData)
                device.xid_errors_total[xid] += 1
                device.last_xid = xid
                log.warning("GPU %d (%s): XID %d", device.index, device.uuid, xid)


def _stale_sample(device: Device, call: str | None, lost: bool = False) -> GpuSample:
    """A GPU without a fresh reading: its identity and flags, no measurement."""
    return GpuSample(
        index=device.index,
        uuid=device.uuid,
        name=device.name,
        pci_bus_id=device.pci_bus_id,
        lost=lost,
        stale=True,
        stale_call=call,
        supported=device.supported(),
    )


@register("gpu", order=10, help="GPUs through NVML (pynvml)")
def create(config: ExporterConfig) -> GpuCollector:
    session = NvmlSession(
        library_path=config.nvml_library,
        retry_max_seconds=config.nvml_retry_max,
        lost_recheck_seconds=config.nvml_lost_recheck,
    )
    return GpuCollector(session, deadline_seconds=min(config.nvml_deadline, config.interval))
