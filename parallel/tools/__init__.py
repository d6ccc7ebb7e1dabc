"""Standalone timing tools, each `python -m parallel.tools.NAME`: what the harness, the record of collectives and a
real-size batch cost."""
