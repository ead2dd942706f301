"""Images per second of the demo image classifier from JPEG bytes (fetched from the
request, decoded, resized, normalised in the replica, then the model) vs the same ONNX
model fed ready tensors, and what the JPEG decoder's scaled decoding saves (#40).

    .venv/bin/python bench/images.py [--rounds 3] [--duration 10] [--clients 4] [--side 512]

1. **Decoding, in this process**: one ``--side`` x ``--side`` JPEG (and one 4x as wide)
   decoded and preprocessed to the model's 32 x 32 by ``inferd.runtimes.images.decode``,
   with libjpeg-turbo's scaled DCT decoding (Pillow's ``draft``, what the replica does)
   and without it (a full decode, then the resize): median ms per image over 200.
2. **Serving**: one ``inferd serve`` (default settings, one gateway) with the demo
   classifier twice: ``image-classifier`` (JPEG in, ``images.decode_threads`` 2) and
   ``image-tensors`` (the same ONNX file, no ``image`` metadata: 3 x 32 x 32 FP32 in).
   Per round, in alternating order, ``--clients`` threads send V2 binary requests of 8
   images (the JPEGs, or their tensors as the replica would make them) for
   ``--duration`` s each; images/s is what was answered. Medians over rounds and the
   ratio JPEG / tensors. Writes bench/results/images.{json,md}. Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from servers import inferd_serving

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
PER_REQUEST = 8


def decoding(side: int) -> dict[str, float]:
    from inferd.demo.images import IMAGE, jpeg, picture
    from inferd.runtimes.images import ImageSpec, decode

    spec = ImageSpec.parse(IMAGE)
    out: dict[str, float] = {}
    for width in (side, 4 * side):
        data = jpeg(picture("circle", np.random.default_rng(0)).resize((width, width)))
        for scaled in (True, False):
            took = []
            for _ in range(200):
                began = time.perf_counter()
                decode(data, spec, 10**9, "bench", scaled=scaled)
                took.append((time.perf_counter() - began) * 1000)
            kind = "scaled DCT decode" if scaled else "full decode"
            out[f"{width} x {width} JPEG, {kind}"] = round(statistics.median(took), 3)
    return out


def register(client: httpx.Client, work: Path) -> None:
    from inferd.demo.build import build_demo_model

    built = build_demo_model("image-classifier", work)
    for name, metadata in (
        ("image-classifier", built.metadata),
        ("image-tensors", {k: v for k, v in built.metadata.items() if k != "image"}),
    ):
        body = {
            "version": "v1", "source_uri": f"file://{built.path}", "framework": "onnx",
            "metadata": metadata,
        }  # fmt: skip
        client.post(f"/api/v1/models/{name}/versions", json=body).raise_for_status()
    began = time.monotonic()
    while not all(
        client.get(f"/v2/models/{m}/ready").status_code == 200
        for m in ("image-classifier", "image-tensors")
    ):
        if time.monotonic() - began > 120:
            raise RuntimeError("models not ready in 120 s")
        time.sleep(0.05)


def bodies(side: int) -> dict[str, tuple[bytes, dict[str, str]]]:
    """A V2 binary request of ``PER_REQUEST`` images for each model."""
    from inferd.demo.images import IMAGE, LABELS, jpeg, picture
    from inferd.runtimes.images import ImageSpec, decode

    rng = np.random.default_rng(1)
    jpegs = [jpeg(picture(LABELS[i % 3], rng).resize((side, side))) for i in range(PER_REQUEST)]
    spec = ImageSpec.parse(IMAGE)
    tensors = np.stack([decode(d, spec, 10**9, "bench") for d in jpegs]).astype("<f4")
    packed = b"".join(len(d).to_bytes(4, "little") + d for d in jpegs)
    out = {}
    for model, name, datatype, shape, data in (
        ("image-classifier", "image", "BYTES", [PER_REQUEST], packed),
        ("image-tensors", "pixels", "FP32", list(tensors.shape), tensors.tobytes()),
    ):
        header = json.dumps({
            "inputs": [{"name": name, "datatype": datatype, "shape": shape,
                        "parameters": {"binary_data_size": len(data)}}],
            "outputs": [{"name": "label", "parameters": {"binary_data": False}}],
        }).encode()  # fmt: skip
        out[model] = (header + data, {"Inference-Header-Content-Length": str(len(header))})
    return out


def drive(url: str, model: str, body: bytes, headers: dict[str, str], clients: int,
          duration: float) -> float:  # fmt: skip
    """Images answered per second by ``clients`` closed-loop threads."""
    answered = [0] * clients
    failed: list[str] = []
    stop_at = time.monotonic() + duration

    def loop(i: int) -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while time.monotonic() < stop_at:
                reply = client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
                if reply.status_code != 200:
                    failed.append(reply.text[:200])
                    return
                answered[i] += PER_REQUEST

    began = time.monotonic()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise RuntimeError(f"{model}: {failed[0]}")
    return sum(answered) / (time.monotonic() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--side", type=int, default=512)
    args = parser.parse_args()
    decoded = decoding(args.side)
    print("decoding:", decoded, flush=True)
    runs: dict[str, list[float]] = {"image-classifier": [], "image-tensors": []}
    with (
        tempfile.TemporaryDirectory(prefix="bench-images-") as tmp,
        inferd_serving(Path(tmp)) as url,
    ):
        with httpx.Client(base_url=url, timeout=120) as client:
            register(client, Path(tmp) / "models")
        requests = bodies(args.side)
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for model in order:
                body, headers = requests[model]
                drive(url, model, body, headers, args.clients, 1.0)  # warm
                rate = drive(url, model, body, headers, args.clients, args.duration)
                runs[model].append(rate)
                print(f"round {r} {model:16} {rate:8.1f} images/s", flush=True)
    summary = {m: round(statistics.median(v), 1) for m, v in runs.items()}
    ratio = round(summary["image-classifier"] / summary["image-tensors"], 2)
    RESULTS.mkdir(exist_ok=True)
    result = {"args": vars(args), "decoding": decoded, "rounds": runs, "summary": summary,
              "ratio": ratio}  # fmt: skip
    (RESULTS / "images.json").write_text(json.dumps(result, indent=2))
    text = table(result, args)
    (RESULTS / "images.md").write_text(text)
    print(text)


def table(result: dict[str, Any], args: argparse.Namespace) -> str:
    s, d = result["summary"], result["decoding"]
    lines = [
        f"`bench/images.py --rounds {args.rounds} --duration {args.duration:g} --clients "
        f"{args.clients} --side {args.side}` (medians over rounds)",
        "",
        "| served from | images/s |",
        "|---|---|",
        f"| JPEG bytes ({args.side} x {args.side}; decoded, resized, normalised in the "
        f"replica) | {s['image-classifier']} |",
        f"| ready tensors (3 x 32 x 32 FP32) | {s['image-tensors']} |",
        f"| ratio | {result['ratio']}x |",
        "",
        "| one JPEG to the model's 32 x 32 | ms (median of 200) |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in d.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
