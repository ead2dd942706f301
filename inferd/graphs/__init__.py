"""Inference graphs: model versions (framework ``graph``) that call other models.

A graph's ``graph.json`` is parsed and checked by :mod:`inferd.shapes.graph` (the spec
is shared with the registry and the push check); :mod:`inferd.graphs.rows` is its row
arithmetic; :mod:`inferd.graphs.runner` runs it in the gateway over the data plane. See
``docs/guides/graphs.md``.
"""
