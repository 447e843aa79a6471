"""Measurement: environment records, benchmarks, the cost model and the planner."""
