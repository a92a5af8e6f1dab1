"""Planning: the compiled sizes and the graph set a workload should run with."""
