"""Where a run runs: the devices and every CUDA call, the --devices grammar, the machine and its load, the process
group, the parallel dims, and the one error type for bad input."""
