"""Inference graphs: model versions (framework ``graph``) that call other models.

:mod:`inferd.graphs.spec` parses and checks a graph's ``graph.json``;
:mod:`inferd.graphs.rows` is its row arithmetic; :mod:`inferd.graphs.runner` runs it in
the gateway over the data plane. See ``docs/guides/graphs.md``.
"""
