"""What crosses a layer or a process: the types two layers share, in one leaf package.

- :mod:`~inferd.shapes.tensors`: datatypes, :class:`TensorSpec`, :class:`Signature`;
- :mod:`~inferd.shapes.replica`: the gateway <-> replica frames, their framing, and the
  requests the gateway builds for them;
- :mod:`~inferd.shapes.control`: the control channel's frames (routing tables down, log
  rows, demands and queries up, joined replicas' frames);
- :mod:`~inferd.shapes.replica_spec`: what a replica is told to serve;
- :mod:`~inferd.shapes.logs`: inference-log rows and their payloads;
- :mod:`~inferd.shapes.graph`: an inference graph's spec and its checks;
- :mod:`~inferd.shapes.drift`: a version's drift reference profile;
- :mod:`~inferd.shapes.llm`: sampling parameters and an engine's token outputs.

The rule: a module here imports only :mod:`inferd.errors`, msgspec, numpy, the standard
library and the package's own modules (:mod:`~inferd.shapes.replica_spec` also the
replica's settings groups, :mod:`inferd.replica_config`, itself a leaf), so every layer
may import it and a wire field can carry its real type rather than a dict. Behaviour
that needs more (building a profile, counting on it, running a graph) stays with its
layer. Importing this package imports none of its modules.
"""
