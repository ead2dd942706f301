"""Instrumentation every layer may import: metric primitives and sketches
(:mod:`~inferd.telemetry.metrics`), tracing (:mod:`~inferd.telemetry.tracing`), logging
set-up for entry points (:mod:`~inferd.telemetry.logging`), a replica's drift counter
(:mod:`~inferd.telemetry.drift`) and a gateway's inference-log row buffer and shipper
(:mod:`~inferd.telemetry.log_rows`).

A leaf below ``serving/``, ``llm/`` and ``runtimes/``: it imports only the standard
library, numpy, msgspec and :mod:`inferd.shapes` (OpenTelemetry lazily, when tracing is
on). What the server does with the figures is :mod:`inferd.monitoring`'s.
"""
