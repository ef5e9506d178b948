"""Side-by-side measurements (not timed tests). Run one with ``python -m benchmarks.<name>``."""
