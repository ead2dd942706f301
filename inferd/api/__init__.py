"""The HTTP surface of a gateway process: the routes of ``/api/v1``, the Open Inference
Protocol's ``/v2``, OpenAI's ``/v1`` (and its Files and Batches), the console's API, the
gateway's ASGI app and its HTTP protocol with the direct path for hot routes, and the
gateway process itself (:mod:`inferd.api.worker`). Requests go to replicas through
:mod:`inferd.routing`; nothing below imports this package.
"""
