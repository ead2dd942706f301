"""The server's monitoring features, built on :mod:`inferd.telemetry`'s figures:
Prometheus exposition (:mod:`~inferd.monitoring.exposition`), the console's recent
figures (:mod:`~inferd.monitoring.recent`), the PromQL evaluator and alerting
(:mod:`~inferd.monitoring.promql`, :mod:`~inferd.monitoring.alerting`), drift statistics
(:mod:`~inferd.monitoring.drift_stats`), the database inference log and feedback
(:mod:`~inferd.monitoring.inference_log`, :mod:`~inferd.monitoring.feedback`) and the
payload sinks (:mod:`inferd.monitoring.sinks`).

Imported only by the control plane (``control/``, ``jobs/``) and the API modules that
serve these figures (``api/health.py``, ``api/logs.py``); never by a replica or a
gateway's predict path.
"""
