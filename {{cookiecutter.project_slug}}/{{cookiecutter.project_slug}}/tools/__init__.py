"""Helpers of benchmark.py: data-pipeline measurements and the BENCHMARKS.md report."""
