"""Who is calling and what they may take, without a transport: the caller
(:class:`~inferd.access.principal.Principal`, from an API key or a JWT:
:mod:`inferd.access.authenticator`), rate limits and generation token budgets
(:mod:`inferd.access.limits`), and a request's per-model policy
(:class:`~inferd.access.policy.RequestPolicy`), shared by HTTP (:mod:`inferd.api`) and
gRPC (:mod:`inferd.grpc`) so one client is one caller with one budget over both.

Nothing here imports starlette or a gRPC module: each transport reads its credential,
its client's address and its route, and asks these.
"""
