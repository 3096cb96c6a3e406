"""The three states a cell is measured in (measure/cells.py says what each means), named here, below every
layer that reads them: the fits and the reports read recorded cells by state without the measuring code."""

from enum import Enum


class State(str, Enum):
    COLD = "cold"
    ENGINE_HIT = "engine-hit"
    TIER_HIT = "tier-hit"
