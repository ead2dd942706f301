"""The cluster transport (inferd.transport): over TCP nothing reaches a protocol before
the peer proved the cluster token and/or a certificate of the cluster's CA; real
sockets on 127.0.0.1, a real replica process over TCP."""

from __future__ import annotations

import asyncio
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from inferd import transport
from inferd.serving.client import ReplicaClient
from inferd.shapes import replica as p
from inferd.shapes.replica_spec import ReplicaSpec
from inferd.shapes.tensors import Signature, TensorSpec
from tests.conftest import ROOT, free_port

TOKEN = transport.Credentials(b"a-cluster-token-of-32-characters")
OTHER = transport.Credentials(b"another-token-of-32-characters!!")


class Echo(asyncio.Protocol):
    """Upper-cases what it gets; counts the connections that reached it."""

    reached = 0

    def connection_made(self, t: asyncio.BaseTransport) -> None:
        Echo.reached += 1
        self.t = t

    def data_received(self, data: bytes) -> None:
        self.t.write(data.upper())  # type: ignore[attr-defined]


async def _echo_round(server_creds, client_creds) -> bytes:
    server = await transport.listen("127.0.0.1:0", Echo, server_creds)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await _open(f"127.0.0.1:{port}", client_creds)
        writer.write(b"hello")
        got = await asyncio.wait_for(reader.readexactly(5), 5)
        writer.close()
        return got
    finally:
        server.close()


async def _open(where: str, creds):
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    protocol = asyncio.StreamReaderProtocol(reader)
    t, _ = await transport.connect(where, lambda: protocol, creds)
    return reader, asyncio.StreamWriter(t, protocol, reader, loop)


def test_the_token_lets_frames_through_and_a_wrong_one_reaches_nothing():
    Echo.reached = 0
    assert asyncio.run(_echo_round(TOKEN, TOKEN)) == b"HELLO"
    assert Echo.reached == 1
    with pytest.raises(transport.AuthError):
        asyncio.run(_echo_round(TOKEN, OTHER))
    assert Echo.reached == 1  # the refused connection never reached the protocol


def test_a_peer_that_skips_the_handshake_is_cut_off_unheard():
    async def scenario() -> tuple[bytes, int]:
        Echo.reached = 0
        server = await transport.listen("127.0.0.1:0", Echo, TOKEN)
        port = server.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            hello = await reader.readexactly(len(transport.MAGIC) + transport.NONCE)
            # a frame where the proof should be: 48 bytes that prove nothing
            writer.write(p.encode(p.Cancel(1)).ljust(48, b"\0"))
            rest = await asyncio.wait_for(reader.read(), 5)  # closed by the listener
            writer.close()
            return hello[:5] + rest, Echo.reached
        finally:
            server.close()

    got, reached = asyncio.run(scenario())
    assert got == transport.MAGIC and reached == 0


def test_tcp_without_credentials_is_refused_by_name():
    with pytest.raises(ValueError, match=r"cluster\.token"):
        asyncio.run(_echo_round(transport.Credentials(), transport.Credentials()))
    with pytest.raises(ValueError, match="at least 16"):
        transport.Credentials(b"short").check()


def _ca(folder: Path, name: str) -> tuple[Path, object, object]:
    pytest.importorskip("cryptography")  # a dependency here (pyjwt[crypto])
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = folder / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, cert, key


def _member(folder: Path, name: str, ca_cert, ca_key) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_mutual_tls_takes_the_clusters_certificates_only(tmp_path: Path):
    ca, ca_cert, ca_key = _ca(tmp_path, "cluster-ca")
    _, rogue_cert, rogue_key = _ca(tmp_path, "rogue-ca")
    server = transport.Credentials(None, *_member(tmp_path, "control", ca_cert, ca_key), ca)
    client = transport.Credentials(None, *_member(tmp_path, "gateway", ca_cert, ca_key), ca)
    rogue = transport.Credentials(None, *_member(tmp_path, "rogue", rogue_cert, rogue_key), ca)
    assert asyncio.run(_echo_round(server, client)) == b"HELLO"
    Echo.reached = 0
    with pytest.raises((ConnectionError, OSError, TimeoutError, EOFError)):
        asyncio.run(_echo_round(server, rogue))
    assert Echo.reached == 0
    # the token inside TLS, both required
    both = transport.Credentials(TOKEN.token, server.tls_cert, server.tls_key, ca)
    both_client = transport.Credentials(TOKEN.token, client.tls_cert, client.tls_key, ca)
    assert asyncio.run(_echo_round(both, both_client)) == b"HELLO"
    wrong = transport.Credentials(OTHER.token, client.tls_cert, client.tls_key, ca)
    with pytest.raises(transport.AuthError):
        asyncio.run(_echo_round(both, wrong))


MODEL = """
class Calc:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        return {"y": batch["x"] * 3}
"""


def test_a_replica_over_tcp_answers_only_the_clusters_clients(tmp_path: Path):
    (tmp_path / "model.py").write_text(MODEL)
    port = free_port()
    spec = ReplicaSpec(
        replica_id="calc-tcp-1",
        model="calc",
        version="v1",
        framework="python",
        artifact_dir=str(tmp_path),
        address=f"tcp:127.0.0.1:{port}",
        signature=Signature((TensorSpec("x", "FP32"),), (TensorSpec("y", "FP32"),)),
    )
    env = {**os.environ, "INFERD_CLUSTER__TOKEN": TOKEN.token.decode()}  # type: ignore[union-attr]
    replica = subprocess.Popen(
        [sys.executable, "-m", "inferd.serving.replica_server", spec.to_json(), "5"],
        cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    async def talk() -> tuple[list[float], str]:
        transport.use(TOKEN)
        client = ReplicaClient(f"tcp:127.0.0.1:{port}", "calc-tcp-1")
        deadline = time.monotonic() + 30
        while True:
            try:
                await client.connect()
                status = await client.status(timeout_s=2)
                if status.state == "ready":
                    break
                client.close()
            except (OSError, ConnectionError):
                pass
            assert time.monotonic() < deadline, "the replica never became ready"
            await asyncio.sleep(0.1)
        x = p.to_tensor(np.array([1.0, 2.0], dtype=np.float32))
        request = p.InferRequest(started=time.perf_counter(), timeout_s=5)
        out = await client.infer({"x": x}, 2, request)
        client.close()
        transport.use(OTHER)
        intruder = ReplicaClient(f"tcp:127.0.0.1:{port}", "calc-tcp-1")
        try:
            await intruder.connect()
            refused = "connected"
        except transport.AuthError as exc:
            refused = str(exc)
        finally:
            transport.use(transport.Credentials())
        return out.outputs["y"].tolist(), refused

    try:
        answer, refused = asyncio.run(talk())
    finally:
        replica.terminate()
        _, err = replica.communicate(timeout=30)
    assert answer == [3.0, 6.0]
    assert "cluster handshake failed" in refused
    assert "refused a connection" in err and "wrong cluster token" in err
