"""``inferd bench``: a load generator for any HTTP inference server.

Self-contained: nothing here imports the inferd server, so it benchmarks inferd and
other servers alike. See :mod:`inferd.bench.runner` for the entry point.
"""
