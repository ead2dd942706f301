"""The naive baseline: one Hugging Face ``generate`` call per request, one at a time.

    INFERD_BENCH_MODEL=folder uvicorn bench.naive_generate_app:app

Streams the finished text as one SSE token event so the same load generator reads it
(its time to first token is then its whole latency, which is what a client of such a
server experiences).
"""

import asyncio
import json
import os
import threading

import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from tokenizers import Tokenizer
from transformers import GPT2LMHeadModel

torch.set_num_threads(2)
FOLDER = os.environ["INFERD_BENCH_MODEL"]
DTYPE = getattr(torch, os.environ.get("INFERD_BENCH_DTYPE", "float32"))
model = GPT2LMHeadModel.from_pretrained(FOLDER, dtype=DTYPE).eval()
tokenizer = Tokenizer.from_file(f"{FOLDER}/tokenizer.json")
lock = threading.Lock()


def _generate(prompt: str | list[int], max_tokens: int) -> tuple[str, int]:
    ids = torch.tensor([prompt if isinstance(prompt, list) else tokenizer.encode(prompt).ids])
    with lock, torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    new = out[0, ids.shape[1] :].tolist()
    return tokenizer.decode(new), len(new)


async def generate(request: Request) -> StreamingResponse:
    body = await request.json()
    text, n = await asyncio.to_thread(_generate, body["prompt"], int(body["max_tokens"]))

    async def events():  # type: ignore[no-untyped-def]
        yield b"data: " + json.dumps({"token": text}).encode() + b"\n\n"
        final = {"finish_reason": "length", "usage": {"completion_tokens": n}}
        yield b"data: " + json.dumps(final).encode() + b"\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def health(_: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


app = Starlette(routes=[Route("/generate", generate, methods=["POST"]), Route("/health", health)])
