"""Planted admission rules, wrong on purpose, for the admission suite's near-miss controls: static:scale=F
(the predicted load times F), static:no-fixed (the load's fixed cost ignored: only the base cost a seen),
queue:full-credit (the whole queue ahead counted as hidden load time)."""

from __future__ import annotations

from pytest_kvoffload.connector.admission_rule import Admission
from pytest_kvoffload.connector.counters import Counters
from pytest_kvoffload.rigged.knobs import planted_mode


class PlantedAdmission(Admission):
    def __init__(self, tier: dict, kv_bytes_per_token: int, counters: Counters, mode: str = "queue") -> None:
        self.planted = planted_mode(mode)
        super().__init__(tier, kv_bytes_per_token, counters, self.planted.base)

    def fixed_cost(self) -> float:
        return self.recompute.a if self.planted.no_fixed else super().fixed_cost()

    def predicted(self, load_tokens: int, local_tokens: int, prompt_tokens: int | None = None) -> tuple[float, float]:
        load, recompute = super().predicted(load_tokens, local_tokens, prompt_tokens)
        return load * self.planted.scale, recompute

    def queue_credit(self) -> float:
        return 1.0 if self.planted.full_credit else super().queue_credit()


def rule(tier: dict, kv_bytes_per_token: int, counters: Counters, mode: str = "queue") -> Admission:
    """The rule a mode names: the connector's own, or a planted one."""
    if planted_mode(mode).planted:
        return PlantedAdmission(tier, kv_bytes_per_token, counters, mode)
    return Admission(tier, kv_bytes_per_token, counters, planted_mode(mode).base)
