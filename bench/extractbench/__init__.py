"""The parts of bench/bench_extract.py, the entry point (its docstring says what the bench measures and
how to run it): the shapes and workloads, the phases, the disk measurement and the report."""
