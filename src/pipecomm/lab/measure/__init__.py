"""Measurement: the timing harness, compute calibration, sweeps of collectives and the statistics behind every timed number and verdict."""
