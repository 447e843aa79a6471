"""Measurement: environment records, benchmarks (and later the cost model and planner)."""
