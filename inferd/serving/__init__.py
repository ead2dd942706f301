"""The replica: its process and socket server, the dynamic batcher and its priority
queue, the cores every runtime or engine is served by (predict, inferd's generation
engine, vLLM), the client gateways and the server reach it with, in-process pipes, and
``inferd replica`` (a replica joining a server from another host, or a Kubernetes pod).
Imports :mod:`inferd.runtimes`, :mod:`inferd.llm` and the leaves, nothing above.
"""
