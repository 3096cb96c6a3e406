"""The decision layer: every statistical verdict of a run goes through here and comes out met, missed or
undecided, with its interval and the smallest effect it could have seen.

`intervals` has the intervals (distribution-free ones for medians and quantiles, t-quantile ones for means
and fits, from scipy.stats); `outcome` the three outcomes and the one rule that gives them; `pooled_noise`
the gate's noise model between two recorded runs. The tolerances are core/tolerances.py.
"""
