"""Who sees which version of a model: the TrafficRouter port and its adapters.

The router decides who sees the candidate before the swap (shadow, progressive) and the
control after it (the holdback bake); the atomic swap stays the way the fleet changes version.
"""
