"""Every tolerance a verdict of this project uses, defined once (the decision layer, analysis/, reads them;
the cost model and the connector's admission rule, which run without it, read them from here too).

Each is a user-facing figure's limit or the confidence a verdict is stated at, not a property of a machine:
nothing here is tuned to a CPU or a drive.
"""

from __future__ import annotations

# Every interval and one-sided test: 95%, two-sided intervals 97.5% a side.
CONFIDENCE = 0.95

# Paired rounds (A/B, equal engines, close calls): a ratio within 10% of 1 is "no difference" the suites
# accept; a smaller difference is shown only where it exceeds 3% with CONFIDENCE.
PAIRED_CAP = 1.10
PAIRED_FLOOR = 0.03

# The admission check: a hit up to 10% slower than its recompute is within the suite's tolerance.
ADMISSION_CAP = PAIRED_CAP - 1.0

# Our connector against another tier on one cell: at most 5% slower than a disk tier (a DRAM tier: plus the
# prefix's bytes at the drive's read rate).
TIER_TARGET_RATIO = 1.05

# Each tier against its physical limit (analysis/tier_limit.py): a tier hit at most 5% over its server's
# engine hit plus the cached bytes at its medium's rate.
TIER_LIMIT_RATIO = 1.05

# The output check (measure/output_check.py): a hit's logprobs within this many nats of a recompute's at
# every position, and a near-tie is two tokens within it. bf16 keeps 8 bits of mantissa: logits of a few
# units differ by a few hundredths between a cold prefill and a hit's other shapes; wrong KV moves more.
OUTPUT_NATS = 0.1

# The nightly gate's default limit on a slowdown between runs (kvoffload compare --fail-above).
GATE_LIMIT = 0.10
# The fewest rounds per cell, in each run, from which the gate compares a p90 (below it says so): with 20
# rounds the 90th percentile has a distribution-free 95% interval between order statistics of the run.
GATE_P90_ROUNDS = 20

# The connector's admission margin is twice the cells' median relative spread, clamped to this range.
ADMISSION_MARGIN_FLOOR = 0.02
ADMISSION_MARGIN_CEILING = 0.5
