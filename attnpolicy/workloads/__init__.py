"""Workloads: requests and traces, the batch former, and the layout streams a runtime records."""
