"""Benchmarks' shared runner (offspec bench, scripts/) and their prompt sets."""
