"""Image inputs: a model that takes a tensor of pixels, served from encoded images.

A version whose metadata declares ``image`` (its preprocessing, :class:`ImageSpec`) is
served by :class:`ImageInput` around its framework's runtime: the model's pixel input
becomes ``image`` (BYTES, ``media: image``), one encoded image (JPEG, PNG, WebP, …) or
``s3://`` URI per row, and the rest of the signature stays the model's.

Each request's images are fetched and decoded in :meth:`ImageInput.prepare`, which the
replica runs on its decoding threads (``images.decode_threads``), a request at a time
each, before the request is batched: requests decode in parallel (the decoders release
the GIL), a corrupt image fails its own request only, and the model sees batches of
ready tensors. Per image:

1. an ``s3://`` URI is checked against ``images.allowed_buckets`` by whole path segments
   (:func:`allowed_object`) and fetched (at most ``images.max_object_bytes``); nothing
   else is ever fetched;
2. its header is read (:func:`identify`: JPEG, PNG, WebP, GIF, BMP or TIFF, nothing
   else): not one → 422; more than ``images.max_pixels`` pixels → 422 before any
   decoding (a decompression bomb costs a header's read), and the request's images
   together over ``images.max_request_pixels`` → 413 (a body of thousands of small
   compressed images);
3. a JPEG is decoded at the smallest DCT scale (1/2, 1/4, 1/8) still at least the size
   resizing needs (libjpeg-turbo's scaled decoding through Pillow's ``draft``: a 4000 x
   3000 photo for a 224 x 224 model decodes an eighth of the pixels); truncated data is a
   422 too;
4. converted to ``channels``, its shorter side resized to ``resize`` (or straight to
   ``size``), centre-cropped to ``size``, scaled to [0, 1], normalised by ``mean`` and
   ``std``, laid out ``NCHW`` or ``NHWC`` in the model's float type.

The pixel limit is each version's own: several versions may share one replica process
(``models.versions_per_process``), so nothing here sets Pillow's process-wide
``PIL.Image.MAX_IMAGE_PIXELS``, and :func:`identify` reads headers without
``Image.open``'s check of that global. Pillow's WebP and TIFF readers still check it
themselves (WebP above twice it, TIFF warns above it and refuses above twice it, as does
GIF for a frame larger than its screen): such an image within ``max_pixels`` but over
Pillow's limit is a 422 naming Pillow's.
"""

from __future__ import annotations

import dataclasses
import io
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from inferd.errors import InvalidInput, PayloadTooLarge, StoreUnavailable
from inferd.replica_config import ImagesConfig
from inferd.runtimes.base import Runtime, RuntimeConfig
from inferd.shapes.tensors import Signature, TensorSpec

if TYPE_CHECKING:
    from PIL.ImageFile import ImageFile

IMAGE_INPUT = "image"
_MODES = {"RGB": "RGB", "BGR": "RGB", "L": "L"}
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
"""What an image input may be. Pillow reads many more (EPS through Ghostscript, PSD,
ICO, …): none of them is tried on a client's bytes."""


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """A version's ``image`` metadata: how an image becomes the model's tensor."""

    size: tuple[int, int]
    """(height, width) the model takes."""
    resize: int | None = None
    """The shorter side's length before the centre crop to ``size``; None: resized
    straight to ``size`` (the aspect ratio not kept)."""
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    channels: str = "RGB"
    layout: str = "NCHW"
    input: str | None = None
    """The model's pixel input (None: its only input)."""

    @classmethod
    def parse(cls, meta: Any) -> ImageSpec:
        """ValueError naming what is wrong (a push answers it as a 422)."""
        if not isinstance(meta, dict):
            raise ValueError("metadata image must be an object (size, resize, mean, std, …)")
        unknown = set(meta) - {"size", "resize", "mean", "std", "channels", "layout", "input"}
        if unknown:
            raise ValueError(f"metadata image: unknown key(s) {sorted(unknown)}")
        size = meta.get("size")
        if isinstance(size, int):
            size = [size, size]
        if not (isinstance(size, list) and len(size) == 2 and all(_positive(v) for v in size)):
            raise ValueError("metadata image.size must be [height, width] (or one number)")
        resize = meta.get("resize")
        if resize is not None and not _positive(resize):
            raise ValueError("metadata image.resize must be a positive number of pixels")
        channels = meta.get("channels", "RGB")
        if channels not in _MODES:
            raise ValueError(f"metadata image.channels must be one of {sorted(_MODES)}")
        layout = meta.get("layout", "NCHW")
        if layout not in ("NCHW", "NHWC"):
            raise ValueError("metadata image.layout must be NCHW or NHWC")
        n = 1 if channels == "L" else 3
        mean, std = meta.get("mean", [0.0]), meta.get("std", [1.0])
        for name, values in (("mean", mean), ("std", std)):
            if not (
                isinstance(values, list)
                and len(values) in (1, n)
                and all(isinstance(v, int | float) for v in values)
            ):
                raise ValueError(f"metadata image.{name} must be a list of 1 or {n} numbers")
        if any(v == 0 for v in std):
            raise ValueError("metadata image.std must not hold 0")
        pixels = meta.get("input")
        return cls(
            (int(size[0]), int(size[1])), None if resize is None else int(resize),
            tuple(float(v) for v in mean), tuple(float(v) for v in std), channels, layout,
            pixels if isinstance(pixels, str) else None,
        )  # fmt: skip

    @property
    def shape(self) -> tuple[int, ...]:
        """One image's tensor shape."""
        c = 1 if self.channels == "L" else 3
        h, w = self.size
        return (c, h, w) if self.layout == "NCHW" else (h, w, c)


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 65536


class ImageInput(Runtime):
    """``inner`` (any runtime whose model takes one pixel tensor) from encoded images."""

    framework = "image"
    prepares_off_loop = True

    def __init__(self, inner: Runtime, spec: ImageSpec, limits: ImagesConfig) -> None:
        super().__init__(inner.artifact_dir, inner.config)
        self.inner = inner
        self.spec = spec
        self.limits = limits
        self._s3: Any = None
        model = inner.signature
        candidates = [t for t in model.inputs if spec.input in (None, t.name)]
        if len(candidates) != 1 or len(model.inputs) != 1:
            names = [t.name for t in model.inputs]
            raise ValueError(
                f"metadata image: the model's pixel input must be its only input, or named "
                f"by image.input; it takes {names}"
            )
        pixels = candidates[0]
        if pixels.datatype not in ("FP32", "FP16", "FP64", "UINT8"):
            raise ValueError(f"metadata image: input {pixels.name!r} is {pixels.datatype}")
        want = tuple(d for d in pixels.shape[1:])
        if len(want) != 3 or any(d not in (-1, g) for d, g in zip(want, spec.shape, strict=True)):
            raise ValueError(
                f"metadata image: input {pixels.name!r} has shape {list(pixels.shape)}; "
                f"size, channels and layout give [-1, {', '.join(map(str, spec.shape))}]"
            )
        self.pixels = pixels
        self._signature = Signature(
            (TensorSpec(IMAGE_INPUT, "BYTES", (-1,), media="image"),), model.outputs, model.labels
        )

    def load(self) -> None:
        """The inner runtime is loaded; Pillow's format plugins are registered now, once:
        its first open of an image no early plugin claims registers them all, and two
        decoding threads doing that at once could see a half-filled registry."""
        from PIL import Image

        Image.init()

    def infer_signature(self) -> Signature:
        return self._signature

    @property
    def signature(self) -> Signature:
        return self._signature

    def prepare(self, inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Any]:
        """One request's images as the model's tensor (see the module)."""
        images = inputs[IMAGE_INPUT]
        batch = np.empty((len(images), *self.spec.shape), dtype=self.pixels.numpy_dtype)
        budget = PixelBudget(self.limits.max_request_pixels)
        for i, value in enumerate(images):
            where = f"image of row {i}"
            if isinstance(value, str) and value.startswith("s3://"):
                where = value
                value = self._fetch(value)
            elif isinstance(value, str):  # registered samples: base64 text
                value = _b64(value, where)
            batch[i] = self.decode(bytes(value), where, budget)
        return {self.pixels.name: batch}, None

    def decode(self, data: bytes, where: str, budget: PixelBudget | None = None) -> np.ndarray:
        normalise = self.pixels.datatype != "UINT8"
        return decode(data, self.spec, self.limits.max_pixels, where, normalise, budget=budget)

    def _fetch(self, uri: str) -> bytes:
        """An allowed bucket's object, at most ``max_object_bytes``."""
        bucket, _, key = uri[5:].partition("/")
        if not allowed_object(bucket, key, self.limits.allowed_buckets):
            allowed = ", ".join(self.limits.allowed_buckets) or "none"
            raise InvalidInput(
                f"{uri} is outside the buckets image inputs may name "
                f"(images.allowed_buckets: {allowed})"
            )
        limit = self.limits.max_object_bytes
        try:
            with self._store().open(f"{bucket}/{key}", "rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError:
            raise InvalidInput(f"{uri} does not exist") from None
        except PermissionError:
            raise InvalidInput(f"{uri}: access denied") from None
        except OSError as exc:
            raise StoreUnavailable(f"fetching {uri} failed: {exc}") from None
        if len(data) > limit:
            raise InvalidInput(f"{uri} is over {limit:,} bytes (images.max_object_bytes)")
        return bytes(data)

    def _store(self) -> Any:
        if self._s3 is None:
            import s3fs

            self._s3 = s3fs.S3FileSystem()  # the AWS_* endpoint and credentials, as the store
        return self._s3

    def predict_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.inner.predict_batch(inputs)

    def generated_inputs(self, rows: int) -> dict[str, np.ndarray]:
        """Mid-grey PNGs of the model's size (warm-up without registered samples)."""
        from PIL import Image

        h, w = self.spec.size
        out = io.BytesIO()
        Image.new(_MODES[self.spec.channels], (w, h), 128).save(out, format="PNG")
        column = np.empty(rows, dtype=object)
        column[:] = [out.getvalue()] * rows
        return {IMAGE_INPUT: column}

    def unload(self) -> None:
        self.inner.unload()


@dataclass(slots=True)
class PixelBudget:
    """What is left of one request's ``images.max_request_pixels``."""

    limit: int
    used: int = 0

    def take(self, pixels: int, where: str) -> None:
        self.used += pixels
        if self.used > self.limit:
            raise PayloadTooLarge(
                f"{where} brings the request's images to {self.used:,} pixels, over the "
                f"limit of {self.limit:,} (images.max_request_pixels)"
            )


def decode(
    data: bytes,
    spec: ImageSpec,
    max_pixels: int,
    where: str,
    normalise: bool = True,
    scaled: bool = True,
    budget: PixelBudget | None = None,
) -> np.ndarray:
    """One encoded image as the model takes it (steps 2 to 4 of the module's list);
    ``scaled`` False: every pixel of a JPEG decoded, then resized (what step 3 saves).
    ``budget``: the request's, its pixels taken from it (from the header) before
    decoding."""
    from PIL import Image

    image: Image.Image = identify(data, where)
    width, height = image.size
    if width * height > max_pixels:
        raise InvalidInput(
            f"{where} is {width} x {height} pixels, over the limit of {max_pixels:,} "
            "(images.max_pixels)"
        )
    if budget is not None:
        budget.take(width * height, where)
    if spec.resize is None:
        need_w, need_h = spec.size[1], spec.size[0]
    else:
        scale = spec.resize / min(width, height)
        need_w, need_h = (
            max(spec.size[1], round(width * scale)),
            max(spec.size[0], round(height * scale)),
        )
    mode = _MODES[spec.channels]
    try:
        if scaled:
            image.draft(mode, (need_w, need_h))  # a JPEG: scaled DCT decoding
        image = image.convert(mode)
    except (OSError, SyntaxError, ValueError) as exc:
        raise InvalidInput(f"{where} is corrupt: {exc}") from None
    except Image.DecompressionBombError as exc:  # a TIFF over Pillow's own limit
        raise _over_pillows_limit(where, exc) from None
    if image.size != (need_w, need_h):
        image = image.resize((need_w, need_h), Image.Resampling.BILINEAR)
    if spec.resize is not None:
        h, w = spec.size
        left, top = (need_w - w) // 2, (need_h - h) // 2
        image = image.crop((left, top, left + w, top + h))
    pixels: np.ndarray = np.asarray(image, dtype=np.float32)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if spec.channels == "BGR":
        pixels = pixels[:, :, ::-1]
    if normalise:
        mean, std = np.asarray(spec.mean, np.float32), np.asarray(spec.std, np.float32)
        pixels = (pixels / 255.0 - mean) / std
    return pixels.transpose(2, 0, 1) if spec.layout == "NCHW" else pixels


def identify(data: bytes, where: str) -> ImageFile:
    """The image in ``data``, its header read and nothing decoded: ``Image.open``'s
    identification over :data:`FORMATS`, without its decompression-bomb check, which
    compares the size with Pillow's process-wide ``MAX_IMAGE_PIXELS`` (in a shared
    replica process, every neighbour's too): :func:`decode` checks the version's own
    ``max_pixels`` instead. A JPEG is read as its primary image (an MPO's other frames,
    whose reader checks Pillow's limit again, are never decoded). InvalidInput when it
    is none of the formats."""
    from PIL import Image, JpegImagePlugin

    if not all(name in Image.OPEN for name in FORMATS):
        Image.init()
    prefix = data[:16]
    for name in FORMATS:
        factory, accept = Image.OPEN[name]
        if accept is not None and accept(prefix) is not True:
            continue
        reader = JpegImagePlugin.JpegImageFile if name == "JPEG" else factory
        try:
            return reader(io.BytesIO(data), "")
        except (SyntaxError, IndexError, TypeError, ValueError, OSError, struct.error):
            continue  # as Image.open: the next format may take it
        except Image.DecompressionBombError as exc:  # a WebP (a GIF's frame) over it
            raise _over_pillows_limit(where, exc) from None
    raise InvalidInput(f"{where} is not an image (JPEG, PNG, WebP, BMP, GIF, TIFF)")


def _over_pillows_limit(where: str, exc: Exception) -> InvalidInput:
    return InvalidInput(
        f"{where}: Pillow refuses to decode it: {exc} (its process-wide "
        "PIL.Image.MAX_IMAGE_PIXELS, which its WebP, TIFF and GIF readers check besides "
        "images.max_pixels)"
    )


def allowed_object(bucket: str, key: str, allowed: list[str]) -> bool:
    """Whether ``s3://bucket/key`` is inside an ``images.allowed_buckets`` entry, by
    whole path segments: ``bucket`` takes that bucket's objects (not ``bucket-other``'s),
    ``bucket/a/b`` those whose key begins ``a/b/`` (not ``a/b-private/…``, ``a/bc``, nor
    the object ``a/b`` itself). A key with an empty, ``.`` or ``..`` segment is never
    taken: a store or proxy that normalised it would serve another object than the one
    checked."""
    if not key or any(part in ("", ".", "..") for part in key.split("/")):
        return False
    for entry in allowed:
        entry_bucket, _, prefix = entry.strip("/").partition("/")
        if entry_bucket == bucket and (not prefix or key.startswith(prefix.strip("/") + "/")):
            return True
    return False


def _b64(text: str, where: str) -> bytes:
    import base64
    import binascii

    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"{where} is not base64") from None


def inner_config(config: RuntimeConfig) -> RuntimeConfig:
    """The config of the runtime an :class:`ImageInput` wraps: a declared signature that
    takes ``image`` (as registered) becomes the model's own again: its pixel input named
    by ``image.input`` (or, unnamed, as the model's runtime reads it from the model)."""
    declared = config.signature
    if declared is None or not any(t.media for t in declared.inputs):
        return config
    spec = ImageSpec.parse(config.metadata["image"])
    if spec.input is None:
        return dataclasses.replace(config, signature=None)
    pixels = TensorSpec(spec.input, "FP32", (-1, *spec.shape))
    return dataclasses.replace(
        config, signature=Signature((pixels,), declared.outputs, declared.labels)
    )
