"""One rank's training: THE loop, and what it does beside the steps (timing, bytes on the wire, the record of
collectives, faults on purpose, replica checks, profiling, checkpoints), and the row it writes."""
