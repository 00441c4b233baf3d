"""What a card's sensors read while it works: power, temperature, clocks, throttle reasons.

Service speed follows only the scenario's throttle events (clock ratio), so that both lab speeds
and the ground truth agree on capacity; the readings here follow the work done, as NVML would
report them. Utilization is the busy fraction of the period: a kernel ran or it did not, which
is why NVML utilization saturates early.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpubalance.lab.catalogue import Card

AMBIENT_CELSIUS = 30.0
STEADY_CELSIUS_AT_TGP = 74.0  # a well-cooled card at its board power
THERMAL_SLOWDOWN_CELSIUS = 84.0  # GeForce Ada / Ampere software thermal slowdown point
THERMAL_TAU_SECONDS = 25.0
IDLE_POWER_FRACTION = 0.06
BUSY_POWER_FRACTION = 0.92
IDLE_SM_CLOCK_MHZ = 210
IDLE_MEMORY_CLOCK_MHZ = 405
BUSY_THRESHOLD = 0.02  # below this share of the period the driver reports the GPU idle
THERMAL_REASONS = frozenset({"sw_thermal_slowdown", "hw_thermal_slowdown", "hw_slowdown"})


@dataclass(frozen=True, slots=True)
class Reading:
    utilization_ratio: float
    power_watts: float
    temperature_celsius: float
    sm_clock_mhz: float
    memory_clock_mhz: float
    throttle_reasons: frozenset[str]
    fan_speed_ratio: float
    energy_joules_total: float


class GpuPhysics:
    def __init__(self, card: Card, power_limit_watts: float) -> None:
        self.card = card
        self.power_limit_watts = power_limit_watts
        self.temperature_celsius = AMBIENT_CELSIUS + 5.0
        self.energy_joules_total = 0.0
        # kelvin per watt so that the board power settles at STEADY_CELSIUS_AT_TGP
        self._resistance = (STEADY_CELSIUS_AT_TGP - AMBIENT_CELSIUS) / card.power_limit_watts

    def step(
        self, seconds: float, busy_ratio: float, clock_ratio: float = 1.0, reason: str | None = None
    ) -> Reading:
        busy_ratio = min(1.0, max(0.0, busy_ratio))
        idle_w = IDLE_POWER_FRACTION * self.card.power_limit_watts
        busy_w = BUSY_POWER_FRACTION * self.card.power_limit_watts * clock_ratio**1.5
        if reason == "sw_power_cap":
            busy_w = min(busy_w, self.power_limit_watts)
        busy_w = min(busy_w, self.power_limit_watts)
        power = idle_w + busy_ratio * (busy_w - idle_w)
        target = AMBIENT_CELSIUS + power * self._resistance
        if reason in THERMAL_REASONS and busy_ratio > BUSY_THRESHOLD:
            target = max(target, THERMAL_SLOWDOWN_CELSIUS + 1.0)  # cooling failed: pinned hot
        self.temperature_celsius += (target - self.temperature_celsius) * (
            1.0 - math.exp(-seconds / THERMAL_TAU_SECONDS)
        )
        self.energy_joules_total += power * seconds
        busy = busy_ratio > BUSY_THRESHOLD
        reasons: frozenset[str]
        if not busy:
            reasons = frozenset({"gpu_idle"})
        elif clock_ratio < 1.0 and reason:
            reasons = frozenset({reason})
        else:
            reasons = frozenset()
        fan = min(1.0, 0.3 + 0.7 * max(0.0, (self.temperature_celsius - 40.0) / 45.0))
        return Reading(
            utilization_ratio=busy_ratio,
            power_watts=power,
            temperature_celsius=self.temperature_celsius,
            sm_clock_mhz=self.card.boost_clock_mhz * clock_ratio if busy else IDLE_SM_CLOCK_MHZ,
            memory_clock_mhz=self.card.memory_clock_mhz if busy else IDLE_MEMORY_CLOCK_MHZ,
            throttle_reasons=reasons,
            fan_speed_ratio=fan,
            energy_joules_total=self.energy_joules_total,
        )
