"""The measurement harness: clocks, profiler, child-process launch, equivalence check, report."""
