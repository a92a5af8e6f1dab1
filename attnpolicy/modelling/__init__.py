"""Modelling: replaying workloads on a cost model (simulation, compile stalls, the bucket schemes compared)."""
