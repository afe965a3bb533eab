"""Measuring: trials, targets, reports, statistics, tuning, the load client."""
