"""Benchmarks on this machine: mode and kernel timings, dispatcher overhead, calibration, real replays."""
