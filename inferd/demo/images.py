"""The demo image classifier: circles, squares and triangles, drawn here and learnt in
seconds by a small CNN, exported to ONNX and served from encoded images.

Nothing is downloaded: each picture is a shape of a random colour, size and place on a
noisy background of another colour, 64 x 64, saved as a JPEG and decoded to the model's
32 x 32 exactly as the server decodes it (:func:`inferd.runtimes.images.decode`).
:func:`picture` draws one, so tests and examples can make JPEGs of a known label.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import numpy as np

LABELS = ("circle", "square", "triangle")
DRAWN = 64
"""Pixels a side of the pictures drawn."""
SIZE = 32
"""Pixels a side of the model's input."""
IMAGE = {"size": [SIZE, SIZE], "resize": SIZE, "mean": [0.5] * 3, "std": [0.5] * 3}
"""The version's ``image`` metadata: shorter side to 32, centre crop, to [-1, 1]."""


def picture(label: str, rng: np.random.Generator, size: int = DRAWN) -> Any:
    """A PIL image of ``label``'s shape (``size`` pixels square; drawn at 64 and scaled)."""
    from PIL import Image, ImageDraw

    back = rng.integers(0, 256, 3)
    fore = (back + rng.integers(80, 176, 3)) % 256  # far enough from the background
    noise = rng.normal(0, 12, (DRAWN, DRAWN, 3))
    canvas = np.clip(back + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(canvas)
    draw = ImageDraw.Draw(image)
    r = int(rng.integers(10, 24))
    cx, cy = (int(v) for v in rng.integers(r + 2, DRAWN - r - 2, 2))
    colour = tuple(int(v) for v in fore)
    if label == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif label == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    return image if size == DRAWN else image.resize((size, size))


def jpeg(image: Any, quality: int = 90) -> bytes:
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=quality)
    return out.getvalue()


def dataset(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` pictures as the model takes them (N, 3, 32, 32 in [-1, 1]) and their labels,
    each saved as a JPEG and decoded as the server decodes it."""
    from inferd.runtimes.images import ImageSpec, decode

    spec = ImageSpec.parse(IMAGE)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(LABELS), n)
    x = np.empty((n, *spec.shape), dtype=np.float32)
    for i, label in enumerate(labels):
        x[i] = decode(jpeg(picture(LABELS[label], rng)), spec, DRAWN * DRAWN, "a picture")
    return x, labels


def build(folder: Path, seed: int = 0) -> dict[str, Any]:
    """Train the CNN, write ``model.onnx`` (input ``pixels``; outputs ``label`` and
    ``probabilities``) and return its metadata."""
    import torch

    torch.manual_seed(seed)
    x, y = dataset(2000, seed)
    x_test, y_test = dataset(500, seed + 1)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveMaxPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(16, len(LABELS)),
    )  # fmt: skip
    optimiser = torch.optim.Adam(net.parameters(), lr=3e-3)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(8):
        order = torch.randperm(len(xs))
        for start in range(0, len(xs), 64):
            batch = order[start : start + 64]
            loss = torch.nn.functional.cross_entropy(net(xs[batch]), ys[batch])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    net.eval()
    with torch.no_grad():
        accuracy = float((net(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean())
    _export(net, folder / "model.onnx")
    return {"labels": list(LABELS), "image": IMAGE, "accuracy": round(accuracy, 4)}


def _head(net: Any) -> Any:
    """The exported graph: the label and the class probabilities from the logits."""
    import torch

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            probabilities = torch.softmax(self.net(pixels), dim=1)
            return probabilities.argmax(dim=1), probabilities

    return Head()


def _export(net: Any, path: Path) -> None:
    import torch

    with warnings.catch_warnings():  # the TorchScript exporter: no onnxscript needed
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _head(net), (torch.zeros(1, 3, SIZE, SIZE),), str(path),
            input_names=["pixels"], output_names=["label", "probabilities"],
            dynamic_axes={"pixels": {0: "n"}, "label": {0: "n"}, "probabilities": {0: "n"}},
            dynamo=False,
        )  # fmt: skip
