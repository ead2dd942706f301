"""Image inputs: the demo image classifier served from JPEG/PNG bytes (multipart, base64,
V2's binary extension, gRPC) and from s3:// URIs of an allowed bucket (a moto server), the
design documents' batch example, and what is refused; the allow-list by whole path
segments, each version's own pixel limit beside Pillow's untouched global, and s3://
requests never answered from the result cache (an overwritten object, a bucket no
longer allowed)."""

from __future__ import annotations

import base64
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from inferd.demo.build import build_demo_model
from inferd.demo.images import LABELS, jpeg, picture
from inferd.errors import InvalidInput, PayloadTooLarge
from inferd.replica_config import ImagesConfig
from inferd.runtimes.base import Runtime
from inferd.runtimes.images import ImageInput, ImageSpec, PixelBudget, allowed_object, decode
from inferd.shapes.tensors import Signature, TensorSpec
from tests.conftest import InferdServer, moto_s3, push_folder
from tests.inprocess import InProcessServer
from tests.test_jobs import Receiver

MODEL = "image-classifier-v1"  # as the design documents' batch example names it
BUCKET = "images"


def _png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


# -- decoding, no sockets ------------------------------------------------------------


def test_the_image_spec_is_checked_by_name():
    assert ImageSpec.parse({"size": 224, "resize": 256}).shape == (3, 224, 224)
    spec = ImageSpec.parse({"size": [32, 48], "channels": "L", "layout": "NHWC"})
    assert spec.shape == (32, 48, 1)
    for bad, says in [
        ({"size": [0, 3]}, "size"),
        ({"size": 8, "colour": "RGB"}, "unknown key"),
        ({"size": 8, "layout": "CHW"}, "layout"),
        ({"size": 8, "mean": [0.1, 0.2]}, "mean"),
        ({"size": 8, "std": [0.0]}, "std"),
    ]:
        with pytest.raises(ValueError, match=says):
            ImageSpec.parse(bad)


def test_decoding_resizes_crops_and_normalises_any_image():
    spec = ImageSpec.parse({"size": 32, "resize": 32, "mean": [0.5], "std": [0.5]})
    rng = np.random.default_rng(0)
    wide = picture("square", rng, size=64).resize((96, 64))  # 3:2, cropped to the centre
    for data in (jpeg(wide), _png(wide), jpeg(wide.convert("L"))):
        x = decode(data, spec, 10**6, "an image")
        assert x.shape == (3, 32, 32) and x.dtype == np.float32
        assert x.min() >= -1.0 and x.max() <= 1.0
    small = picture("circle", np.random.default_rng(5), size=64)
    big = jpeg(small.resize((2048, 2048)))  # decoded at an eighth of its size (scaled DCT)
    gap = decode(big, spec, 10**7, "big") - decode(jpeg(small), spec, 10**7, "small")
    assert float(np.abs(gap).mean()) < 0.05


def test_corrupt_images_and_decompression_bombs_are_refused_before_decoding():
    from PIL import Image

    spec = ImageSpec.parse({"size": 32})
    good = jpeg(picture("triangle", np.random.default_rng(1)))
    with pytest.raises(InvalidInput, match="row 3 is not an image"):
        decode(b"GIF89a not really" + good[:50], spec, 10**6, "image of row 3")
    with pytest.raises(InvalidInput, match="is corrupt"):
        decode(good[: len(good) // 3], spec, 10**6, "image of row 0")
    bomb = io.BytesIO()  # 20,000 x 20,000 pixels in a 60 kB PNG
    Image.new("1", (20_000, 20_000)).save(bomb, format="PNG")
    assert len(bomb.getvalue()) < 100_000
    began = time.perf_counter()
    with pytest.raises(InvalidInput, match="20000 x 20000 pixels, over the limit of 40,000,000"):
        decode(bomb.getvalue(), spec, ImagesConfig().max_pixels, "image of row 0")
    assert time.perf_counter() - began < 0.05  # the header only


def test_the_allow_list_matches_whole_path_segments():
    entries = ["images/x", "photos"]
    assert allowed_object("images", "x/a.jpg", entries)
    assert allowed_object("images", "x/deeper/a.jpg", entries)
    assert not allowed_object("images", "x-private/a.jpg", entries)  # a prefix, not x/
    assert not allowed_object("images", "xa.jpg", entries)
    assert not allowed_object("images", "x", entries)  # the folder's name, no object in it
    assert not allowed_object("images", "y/a.jpg", entries)
    assert allowed_object("photos", "any/key.png", entries)  # a bare bucket: all of it
    assert not allowed_object("photos-other", "any/key.png", entries)  # only that bucket
    assert not allowed_object("photo", "any/key.png", entries)
    for sneaky in ("x/../x-private/a.jpg", "x//a.jpg", "x/./a.jpg", "x/", ""):
        assert not allowed_object("images", sneaky, entries), sneaky
    assert allowed_object("images", "x/a.jpg", ["images/x/"])  # a trailing / is the same
    assert not allowed_object("images", "x/a.jpg", [])
    for bad in ("s3://images", "images//x", "images/../x", ""):
        with pytest.raises(ValueError, match="allowed_buckets entry"):
            ImagesConfig(allowed_buckets=[bad])


class Pixels(Runtime):
    """A model of one 3 x 8 x 8 pixel input: each row's mean."""

    framework = "test-pixels"

    def load(self) -> None:
        pass

    def infer_signature(self) -> Signature:
        return Signature(
            (TensorSpec("x", "FP32", (-1, 3, 8, 8)),), (TensorSpec("y", "FP32", (-1,)),)
        )

    def predict_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": inputs["x"].mean(axis=(1, 2, 3))}


def _runtime(max_pixels: int) -> ImageInput:
    runtime = ImageInput(Pixels(Path(".")), ImageSpec.parse({"size": 8}), ImagesConfig(
        max_pixels=max_pixels))  # fmt: skip
    runtime.load()
    return runtime


def _encoded(side: int, fmt: str) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (side, side), (200, 100, 50)).save(out, format=fmt)
    return out.getvalue()


def _predict(runtime: ImageInput, data: bytes) -> float:
    column = np.empty(1, dtype=object)
    column[0] = data
    return float(runtime.run({"image": column})["y"][0])


def test_image_runtimes_leave_pillows_process_wide_pixel_limit_alone():
    from PIL import Image

    before = Image.MAX_IMAGE_PIXELS
    assert before is not None  # Pillow's check is on in this process
    runtime = _runtime(10**6)
    for fmt in ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"):
        assert _predict(runtime, _encoded(64, fmt)) > 0
    decode(_encoded(64, "PNG"), ImageSpec.parse({"size": 8}), 10**6, "an image")
    assert before == Image.MAX_IMAGE_PIXELS  # a shared process's neighbours keep theirs


def test_image_runtimes_in_one_process_each_enforce_their_own_pixel_limit(monkeypatch):
    from PIL import Image

    # Pillow's own limit below both versions' (as 89 Mpx is below a version allowing
    # 150 Mpx): Image.open would refuse (or warn about, an error in these tests) every
    # image below, and the version with the larger limit must not see that.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000)
    small, large = _runtime(5_000), _runtime(10**6)
    for fmt in ("JPEG", "PNG", "GIF", "BMP"):
        data = _encoded(100, fmt)  # 10,000 pixels
        with pytest.raises(InvalidInput, match="100 x 100 pixels, over the limit of 5,000"):
            _predict(small, data)
        assert _predict(large, data) > 0, fmt
        assert _predict(small, _encoded(50, fmt)) > 0  # 2,500: within its own limit
    for fmt in ("WEBP", "TIFF"):  # Pillow's readers of these check its global themselves
        with pytest.raises(InvalidInput, match="Pillow refuses to decode it"):
            _predict(large, _encoded(100, fmt))
    assert Image.MAX_IMAGE_PIXELS == 1_000


def test_only_the_formats_named_are_read():
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (16, 16)).save(out, format="ICO")  # Pillow reads it; inferd does not
    with pytest.raises(InvalidInput, match="is not an image"):
        decode(out.getvalue(), ImageSpec.parse({"size": 8}), 10**6, "image of row 0")


# -- the server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_env(tmp_path_factory):
    with moto_s3(BUCKET) as env:
        import s3fs

        fs = s3fs.S3FileSystem(key="test", secret="test", endpoint_url=env["AWS_ENDPOINT_URL"])
        fs.mkdir("private")
        yield env, fs


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_demo_model("image-classifier", tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, s3_env, demo):
    env, _ = s3_env
    data = tmp_path_factory.mktemp("images")
    push_folder(data, MODEL, demo.path, framework="onnx", **demo.metadata)
    server_env = {
        **env,
        "INFERD_IMAGES__ALLOWED_BUCKETS": json.dumps([BUCKET]),
        "INFERD_IMAGES__MAX_PIXELS": "4000000",
        "INFERD_IMAGES__MAX_REQUEST_PIXELS": "12000000",
        "INFERD_JOBS__CALLBACK_FIRST_DELAY_S": "0.2",
    }
    srv = InferdServer(data, env=server_env)
    try:
        srv.wait_ready()
        srv.wait_for(
            lambda: srv.client.get(f"/v2/models/{MODEL}/ready").status_code == 200,
            what="the image classifier ready",
        )
        yield srv
    finally:
        assert srv.stop() == 0


def _pictures(n: int, seed: int) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(seed)
    return [(LABELS[i % 3], jpeg(picture(LABELS[i % 3], rng))) for i in range(n)]


def test_an_image_sent_every_way_gets_the_same_answer(server):
    from PIL import Image

    (_, data), *_ = _pictures(1, 10)
    client = server.client
    b64 = base64.b64encode(data).decode()

    def v1(value) -> dict:
        reply = client.post(f"/api/v1/models/{MODEL}/predict", json={"inputs": [value]})
        assert reply.status_code == 200, reply.text
        return reply.json()["outputs"][0]

    answers = [
        v1({"image": {"b64": b64}}),
        v1({"b64": b64}),
        v1(f"data:image/jpeg;base64,{b64}"),
        v1(b64),
    ]
    multipart = client.post(f"/api/v1/models/{MODEL}/predict", files={"image": ("a.jpg", data)})
    assert multipart.status_code == 200, multipart.text
    answers.append(multipart.json()["outputs"][0])

    length = len(data).to_bytes(4, "little") + data
    header = json.dumps({
        "inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                    "parameters": {"binary_data_size": len(length)}}],
    }).encode()  # fmt: skip
    reply = client.post(
        f"/v2/models/{MODEL}/infer",
        content=header + length,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert reply.status_code == 200, reply.text
    outputs = {o["name"]: o["data"] for o in reply.json()["outputs"]}
    answers.append(
        {"label": LABELS[outputs["label"][0]], "probabilities": outputs["probabilities"]}
    )
    v2_json = client.post(f"/v2/models/{MODEL}/infer", json={"inputs": [
        {"name": "image", "datatype": "BYTES", "shape": [1], "data": [b64]}]})  # fmt: skip
    assert v2_json.status_code == 200, v2_json.text
    assert v2_json.json()["outputs"][0]["data"] == [LABELS.index(answers[0]["label"])]

    import tritonclient.grpc as grpcclient

    triton = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    tensor = grpcclient.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([data], dtype=object))
    result = triton.infer(MODEL, [tensor])
    probabilities = result.as_numpy("probabilities")[0].tolist()
    answers.append({"label": LABELS[result.as_numpy("label")[0]], "probabilities": probabilities})

    for answer in answers:
        assert answer["label"] == answers[0]["label"]
        assert answer["probabilities"] == pytest.approx(answers[0]["probabilities"], abs=1e-6)
    png = io.BytesIO()
    Image.open(io.BytesIO(data)).save(png, format="PNG")  # another format, the same picture
    assert v1({"b64": base64.b64encode(png.getvalue()).decode()})["label"] == answers[0]["label"]


def test_the_design_documents_batch_over_s3_uris_calls_back_with_labels(server, s3_env):
    _, fs = s3_env
    pictures = _pictures(24, 20)
    for i, (_, data) in enumerate(pictures):
        fs.pipe(f"{BUCKET}/batch/img{i}.jpg", data)
    receiver = Receiver(fail_first=0)
    try:
        reply = server.client.post("/api/v1/batch", json={
            "model": MODEL,
            "inputs": [f"s3://{BUCKET}/batch/img{i}.jpg" for i in range(len(pictures))],
            "callback_url": receiver.url,
        })  # fmt: skip
        assert reply.status_code == 202, reply.text
        job = reply.json()
        assert job["status"] == "queued"
        done = server.wait_job(job["batch_id"])
        assert done["status"] == "succeeded", done
        deadline = time.monotonic() + 20
        while not receiver.calls:
            assert time.monotonic() < deadline, "no callback"
            time.sleep(0.05)
        assert json.loads(receiver.calls[0][1])["succeeded"] == len(pictures)
    finally:
        receiver.close()
    lines = server.client.get(f"/api/v1/batch/{job['batch_id']}/results").text.splitlines()
    labels = [json.loads(line)["output"]["label"] for line in lines]
    uris = [f"s3://{BUCKET}/batch/img{i}.jpg" for i in range(len(pictures))]
    direct = server.client.post(f"/api/v1/models/{MODEL}/predict", json={"inputs": uris})
    assert labels == [o["label"] for o in direct.json()["outputs"]]  # as asked one by one
    right = sum(a == b for a, (b, _) in zip(labels, pictures, strict=True))
    assert right >= len(pictures) - 4, (labels, [b for b, _ in pictures])  # a real classifier


@pytest.mark.parametrize(
    ("value", "status", "says"),
    [
        ("s3://private/secret.jpg", 422, "outside the buckets image inputs may name"),
        (f"s3://{BUCKET}/missing.jpg", 422, "does not exist"),
        ("https://169.254.169.254/latest/meta-data", 422, "https:// URLs are not fetched"),
        ("file:///etc/passwd", 422, "file:// URLs are not fetched"),
        ("bm90IGFuIGltYWdl", 422, "is not an image"),
        ("not base64 !", 422, "not valid base64"),
        ({"b64": 3}, 422, "must be an image"),
    ],
)
def test_what_is_not_an_allowed_image_is_a_4xx_naming_it(server, value, status, says):
    reply = server.client.post(f"/api/v1/models/{MODEL}/predict", json={"inputs": [value]})
    assert reply.status_code == status, reply.text
    assert says in reply.json()["error"]["message"]


def test_a_bomb_or_a_corrupt_image_fails_only_its_own_request(server):
    from PIL import Image

    bomb = io.BytesIO()
    Image.new("1", (3000, 3000)).save(bomb, format="PNG")  # over this server's 4 Mpx
    good = _pictures(16, 30)
    client = httpx.Client(base_url=server.url, timeout=30)

    def send(data: bytes) -> httpx.Response:
        body = {"inputs": [{"b64": base64.b64encode(data).decode()}]}
        return client.post(f"/api/v1/models/{MODEL}/predict", json=body)

    alone = [send(d).json()["outputs"][0]["label"] for _, d in good]  # one at a time
    bad = [bomb.getvalue(), good[0][1][:200]] * 4
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(send, [d for _, d in good] + bad))
    client.close()
    ok, refused = replies[: len(good)], replies[len(good) :]
    assert all(r.status_code == 200 for r in ok), [r.text for r in ok if r.status_code != 200]
    assert [r.json()["outputs"][0]["label"] for r in ok] == alone
    assert all(r.status_code == 422 for r in refused), [r.text for r in refused]
    assert "3000 x 3000 pixels, over the limit of 4,000,000" in refused[0].text
    assert "corrupt" in refused[1].text or "not an image" in refused[1].text


def test_a_multipart_form_of_several_images_is_several_rows(server, tmp_path: Path):
    pictures = _pictures(3, 40)
    files = [("image", (f"{i}.jpg", d, "image/jpeg")) for i, (_, d) in enumerate(pictures)]
    reply = server.client.post(
        f"/api/v1/models/{MODEL}/predict",
        files=files,
        data={"params": json.dumps({"version": "v1"})},
    )
    assert reply.status_code == 200, reply.text
    rows = [{"b64": base64.b64encode(d).decode()} for _, d in pictures]
    as_json = server.client.post(f"/api/v1/models/{MODEL}/predict", json={"inputs": rows})
    assert reply.json()["outputs"] == as_json.json()["outputs"]
    reply = server.client.post(
        f"/api/v1/models/{MODEL}/predict", files={"picture": ("a.jpg", pictures[0][1])}
    )
    assert reply.status_code == 422 and "form field 'picture'" in reply.text


# -- the result cache and s3:// inputs -------------------------------------------------


def _cached_server(data: Path, redis_url: str, buckets: list[str]) -> InProcessServer:
    """A server whose gateways cache answers in Redis, which outlives it (as a gateway's
    cache outlives a replica restarted with other settings)."""
    server = InProcessServer(
        data, cache={"enabled": True}, redis_url=redis_url, images={"allowed_buckets": buckets}
    )
    server.wait_ready()
    server.wait_for(
        lambda: server.client.get(f"/v2/models/{MODEL}/ready").status_code == 200,
        what="the image classifier ready",
    )
    return server


def test_s3_inputs_are_never_answered_from_the_result_cache(
    tmp_path: Path, s3_env, demo, redis_url: str, monkeypatch: pytest.MonkeyPatch
):
    env, fs = s3_env
    for name, value in env.items():  # the in-process replica fetches with the AWS_* ones
        monkeypatch.setenv(name, value)
    data = tmp_path / "data"
    push_folder(data, MODEL, demo.path, framework="onnx", **demo.metadata)
    (_, first), (_, second) = _pictures(2, 50)
    uri = f"s3://{BUCKET}/cached/over.jpg"

    def predict(client: httpx.Client, value) -> httpx.Response:
        return client.post(f"/api/v1/models/{MODEL}/predict", json={"inputs": [value]})

    def b64(image: bytes) -> dict[str, str]:
        return {"b64": base64.b64encode(image).decode()}

    server = _cached_server(data, redis_url, [BUCKET, "private"])
    try:
        c = server.client
        predict(c, b64(first))
        assert predict(c, b64(first)).headers["x-cache"] == "hit"  # the cache is on
        expected = {
            image: predict(c, b64(image)).json()["outputs"][0]["probabilities"]
            for image in (first, second)
        }
        assert expected[first] != pytest.approx(expected[second], abs=1e-4)

        # An object overwritten under its URI: the next answer is the new object's.
        fs.pipe(uri[5:], first)
        for _ in range(2):
            reply = predict(c, uri)
            assert reply.status_code == 200, reply.text
            assert "x-cache" not in reply.headers  # neither a hit nor kept
            assert reply.json()["outputs"][0]["probabilities"] == pytest.approx(
                expected[first], abs=1e-6
            )
        fs.pipe(uri[5:], second)
        reply = predict(c, uri)
        assert reply.json()["outputs"][0]["probabilities"] == pytest.approx(
            expected[second], abs=1e-6
        )

        # A bucket allowed now, answered twice...
        fs.pipe("private/secret.jpg", first)
        assert predict(c, "s3://private/secret.jpg").status_code == 200
        assert predict(c, "s3://private/secret.jpg").status_code == 200
    finally:
        server.stop()

    # ... and no longer: the replicas restarted with the smaller allow-list refuse it,
    # though the gateways' cache (Redis) outlived them.
    server = _cached_server(data, redis_url, [BUCKET])
    try:
        reply = predict(server.client, "s3://private/secret.jpg")
        assert reply.status_code == 422, reply.text
        assert "outside the buckets image inputs may name" in reply.text
        assert predict(server.client, b64(first)).headers["x-cache"] == "hit"  # still on
    finally:
        server.stop()


def _png_of(width: int, height: int, noise: bool = False) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    if noise:
        pixels = np.random.default_rng(width).integers(0, 255, (height, width, 3), np.uint8)
        Image.fromarray(pixels).save(out, format="PNG", compress_level=1)
    else:
        Image.new("RGB", (width, height), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def test_a_request_s_images_share_one_pixel_budget() -> None:
    spec = ImageSpec(size=(8, 8))
    budget = PixelBudget(10_000)
    decode(_png_of(90, 100), spec, 10**6, "first", budget=budget)
    with pytest.raises(PayloadTooLarge, match=r"images\.max_request_pixels"):
        decode(_png_of(90, 100), spec, 10**6, "second", budget=budget)  # 18,000 > 10,000


def test_many_images_in_one_request_are_refused_past_the_request_s_pixels(server) -> None:
    """Five 2000 x 1500 images (3 Mpx each, under this server's 4 Mpx per image, a few
    KiB each compressed): the fifth passes the request's 12 Mpx, a 413 before it is
    decoded."""
    image = base64.b64encode(_png_of(2000, 1500)).decode()
    body = {"inputs": [{"b64": image}] * 5}
    reply = httpx.post(f"{server.url}/api/v1/models/{MODEL}/predict", json=body, timeout=30)
    assert reply.status_code == 413, reply.text
    message = reply.json()["error"]["message"]
    assert "image of row 4" in message and "images.max_request_pixels" in message
    ok = httpx.post(
        f"{server.url}/api/v1/models/{MODEL}/predict",
        json={"inputs": [{"b64": image}] * 4},
        timeout=30,
    )
    assert ok.status_code == 200, ok.text


@pytest.fixture(scope="module")
def tight(tmp_path_factory, demo):
    """The classifier on a replica with one decoding thread and room for 2 waiting."""
    data = tmp_path_factory.mktemp("images-tight")
    push_folder(data, MODEL, demo.path, framework="onnx", **demo.metadata)
    env = {"INFERD_IMAGES__DECODE_THREADS": "1", "INFERD_IMAGES__MAX_QUEUED": "2"}
    srv = InferdServer(data, env=env)
    try:
        srv.wait_ready()
        srv.wait_for(
            lambda: srv.client.get(f"/v2/models/{MODEL}/ready").status_code == 200,
            what="the image classifier ready",
        )
        yield srv
    finally:
        assert srv.stop() == 0


def test_decoding_has_a_bounded_queue_and_skips_what_is_past_its_deadline(tight) -> None:
    """Twelve requests of three 1000 x 1000 noise PNGs (some 20 ms of decoding each) at once,
    on one decoding thread with room for 2 waiting: some are refused at once (503,
    Retry-After, naming images.max_queued), the others answered; a request whose
    deadline passes while it waits is answered 504 without being decoded."""
    image = base64.b64encode(_png_of(1000, 1000, noise=True)).decode()
    body = {"inputs": [{"b64": image}] * 3}

    def send(timeout_s: float | None = None) -> tuple[int, str, float]:
        headers = {} if timeout_s is None else {"x-request-timeout": str(timeout_s)}
        started = time.monotonic()
        reply = httpx.post(
            f"{tight.url}/api/v1/models/{MODEL}/predict", json=body, headers=headers, timeout=60
        )
        return reply.status_code, reply.text, time.monotonic() - started

    with ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(lambda _: send(), range(12)))
    statuses = sorted(status for status, _, _ in replies)
    assert 503 in statuses and 200 in statuses, statuses
    assert set(statuses) <= {200, 503}, replies
    refused = next(text for status, text, _ in replies if status == 503)
    assert "images.max_queued" in refused
    big = base64.b64encode(_png_of(3000, 3000)).decode()  # small, and slow to decode
    with ThreadPoolExecutor(3) as pool:
        slow = pool.submit(
            httpx.post,
            f"{tight.url}/api/v1/models/{MODEL}/predict",
            json={"inputs": [{"b64": big}] * 4},
            timeout=60,
        )
        time.sleep(0.1)
        late = pool.submit(send, 0.2).result()
        assert slow.result().status_code == 200
    assert late[0] == 504, late
