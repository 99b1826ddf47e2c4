"""How zen's own long-running processes use the machine (the daemon, the simulator, benchmarks):
the allocator and the number of torch threads (`tuning`)."""
