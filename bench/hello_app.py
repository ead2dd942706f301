"""The trivial server of the load-generator comparison: a raw ASGI hello world.

uvicorn bench.hello_app:app --workers 2 --http httptools --loop uvloop --no-access-log
"""

BODY = b'{"hello":"world"}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"17")]


async def app(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    more = True
    while more:  # read (and drop) the request body
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})
