"""The test-only connector's options: which they are, how they are read apart from the product's, and whether
a server's options need this connector at all."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pytest_kvoffload.connector.config import (ADMISSION_MODES, RIGGED_CONNECTOR, RIGGED_OPTIONS, ConnectorConfig,
                                               ConnectorConfigError)

MODULE, CLASS = RIGGED_CONNECTOR, "RiggedKVOffloadConnector"
# zero: loaded blocks zeroed; shift: each block gets its file's previous block; alternate: by turns.
FAULTS = ("zero", "shift", "alternate", "stale")
# Planted rules, wrong on purpose, for the admission suite's near-miss controls (docs/admission.md): the
# static rule with its predicted load cost times F, the static rule blind to the fixed cost, and the queue
# rule crediting the whole queue ahead as hidden load time.
PLANTED_MODES = ("static:scale=F", "static:no-fixed", "queue:full-credit")


@dataclass(frozen=True)
class PlantedMode:
    base: str  # one of ADMISSION_MODES
    scale: float = 1.0
    no_fixed: bool = False
    full_credit: bool = False

    @property
    def planted(self) -> bool:
        return self.scale != 1.0 or self.no_fixed or self.full_credit


def planted_mode(text: str) -> PlantedMode:
    """An `admission` value, a planted rule included; ValueError, one line, when it is none of them."""
    valid = ", ".join(ADMISSION_MODES + PLANTED_MODES)
    base, colon, planted = str(text).partition(":")
    if base not in ADMISSION_MODES or (colon and not planted):
        raise ValueError(f"admission {text!r} must be one of {valid}")
    if not colon:
        return PlantedMode(base)
    if base == "static" and planted == "no-fixed":
        return PlantedMode(base, no_fixed=True)
    if base == "queue" and planted == "full-credit":
        return PlantedMode(base, full_credit=True)
    key, _, value = planted.partition("=")
    if base == "static" and key == "scale":
        try:
            scale = float(value)
        except ValueError:
            scale = 0.0
        if scale > 0 and math.isfinite(scale):
            return PlantedMode(base, scale=scale)
        raise ValueError(f"admission {text!r}: scale must be a number above 0, e.g. static:scale=1.5")
    raise ValueError(f"admission {text!r} must be one of {valid}")


@dataclass(frozen=True)
class Rig:
    """What the test-only connector adds to the product's options."""

    read_bytes_per_s: float | None = None  # an emulated drive's rate (read_gbps)
    read_latency_s: float = 0.0  # and its access latency: each load's reads start this much later
    fault: str | None = None  # wrong KV planted in every load (FAULTS)
    admission: str = "queue"  # the rule, a planted one included (PLANTED_MODES)


def needs_rig(extra: dict) -> bool:
    """Whether a server's connector options include a test knob (then it runs the test-only connector)."""
    if any(extra.get(key) not in (None, "") for key in RIGGED_OPTIONS):
        return True
    return ":" in str(extra.get("admission", ""))


def split(extra: dict, block_size: int) -> tuple[ConnectorConfig, Rig]:
    """The product's config from the options it takes, and the rig from the rest; a bad value is a
    ConnectorConfigError naming it and what would be valid."""
    product = {k: v for k, v in extra.items() if k not in RIGGED_OPTIONS}
    try:
        mode = planted_mode(extra.get("admission", "queue"))
    except ValueError as exc:
        raise ConnectorConfigError(f"kvoffload connector: {exc}") from None
    product["admission"] = mode.base
    config = ConnectorConfig.from_extra(product, block_size)
    gbps = _positive(extra, "read_gbps", "a number of GB/s above 0", allow_zero=False)
    latency_ms = _positive(extra, "read_latency_ms", "a number of milliseconds, 0 or more", allow_zero=True)
    fault = extra.get("fault") or None
    if fault is not None and fault not in FAULTS:
        raise ConnectorConfigError(f"kvoffload connector: fault {fault!r} must be one of {', '.join(FAULTS)}")
    rig = Rig(read_bytes_per_s=gbps * 1e9 if gbps is not None else None,
              read_latency_s=(latency_ms or 0.0) / 1e3, fault=fault, admission=str(extra.get("admission", "queue")))
    return config, rig


def _positive(extra: dict, key: str, what: str, allow_zero: bool) -> float | None:
    value = extra.get(key)
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        raise ConnectorConfigError(f"kvoffload connector: {key} {value!r} must be {what}")
    return number


def check(extra: dict, block_size: int) -> None:
    """The options a harness-started server gets, checked before it starts, test knobs and all."""
    split(extra, block_size)

