"""TLS on the HTTP and gRPC ports (``settings.tls``) against the real server, with a
self-signed CA made here: HTTPS and gRPC over TLS, refusals of plain and untrusting
clients, client certificates (``tls.client_ca_file``), the job runner calling its own
gateways over TLS, and the startup errors."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from inferd.config import Settings, TLSConfig
from tests.conftest import InferdServer, arithmetic_model, push_source, run_cli

pytestmark = pytest.mark.slow
BODY = {"inputs": [{"x": 3.0}]}


@dataclass(frozen=True)
class PKI:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def trusting(self, client_cert: bool = False) -> ssl.SSLContext:
        """A client context that trusts the CA (and shows the client certificate)."""
        context = ssl.create_default_context(cafile=self.ca)
        if client_cert:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context

    def grpc_credentials(self, client_cert: bool = False) -> grpc.ChannelCredentials:
        if not client_cert:
            return grpc.ssl_channel_credentials(self.ca.read_bytes())
        return grpc.ssl_channel_credentials(
            self.ca.read_bytes(), self.client_key.read_bytes(), self.client_cert.read_bytes()
        )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _issue(
    subject: str,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    usage: x509.ObjectIdentifier | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for ``subject``, signed by ``issuer`` (None: a self-signed CA)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, issuer_key = issuer or (name, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is None:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
    if usage == ExtendedKeyUsageOID.SERVER_AUTH:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()), key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    folder = tmp_path_factory.mktemp("pki")
    ca, ca_key = _issue("inferd test CA", None)
    signer = (ca.subject, ca_key)
    server, server_key = _issue("127.0.0.1", signer, ExtendedKeyUsageOID.SERVER_AUTH)
    client, client_key = _issue("a client", signer, ExtendedKeyUsageOID.CLIENT_AUTH)
    files = {
        "ca.pem": ca.public_bytes(serialization.Encoding.PEM),
        "server.pem": server.public_bytes(serialization.Encoding.PEM),
        "server.key": _key_pem(server_key),
        "client.pem": client.public_bytes(serialization.Encoding.PEM),
        "client.key": _key_pem(client_key),
    }
    for name, content in files.items():
        (folder / name).write_bytes(content)
    return PKI(*(folder / name for name in files))


def _data(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    data = tmp_path_factory.mktemp(name)
    push_source(data, "calc", arithmetic_model("x * 2"))
    return data


def _tls_env(pki: PKI, client_ca: bool) -> dict[str, str]:
    env = {
        "INFERD_TLS__CERT_FILE": str(pki.server_cert),
        "INFERD_TLS__KEY_FILE": str(pki.server_key),
    }
    if client_ca:
        env["INFERD_TLS__CLIENT_CA_FILE"] = str(pki.ca)
    return env


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, pki: PKI
) -> Iterator[tuple[InferdServer, InferdServer]]:
    """Two servers, started together: TLS (two gateway processes sharing the ports), and
    TLS with client certificates required."""
    plain_tls = InferdServer(
        _data(tmp_path_factory, "tls"), workers=2, env=_tls_env(pki, False), tls=pki.trusting()
    )
    mutual = InferdServer(
        _data(tmp_path_factory, "mtls"), env=_tls_env(pki, True), tls=pki.trusting(True)
    )
    try:
        for server in (plain_tls, mutual):
            server.wait_ready()
            server.wait_for(lambda s=server: "serving on" in s.log(), what="all gateways up")
            server.wait_for(
                lambda s=server: s.client.post("/api/v1/models/calc/predict", json=BODY).is_success,
                what="calc ready",
            )
        yield plain_tls, mutual
    finally:
        for server in (plain_tls, mutual):
            assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture(scope="module")
def tls_server(servers: tuple[InferdServer, InferdServer]) -> InferdServer:
    return servers[0]


@pytest.fixture(scope="module")
def mtls_server(servers: tuple[InferdServer, InferdServer]) -> InferdServer:
    return servers[1]


def _infer(channel: grpc.Channel) -> float:
    """ServerReady, then ModelInfer of calc (y = 2x) with x = 4: y, from its raw output."""
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    assert stub.ServerReady(pb.ServerReadyRequest(), timeout=10).ready
    request = pb.ModelInferRequest(model_name="calc")
    request.inputs.add(name="x", datatype="FP32", shape=[1]).contents.fp32_contents.append(4.0)
    reply = stub.ModelInfer(request, timeout=10)
    return float(np.frombuffer(reply.raw_output_contents[0], dtype=np.float32)[0])


def test_https_with_the_ca_answers_and_the_log_says_https(tls_server: InferdServer):
    for _ in range(8):  # new connections: both gateway processes on the shared port answer
        url = f"{tls_server.url}/api/v1/models/calc/predict"
        reply = httpx.post(url, json=BODY, verify=tls_server.verify, timeout=10)
        assert reply.status_code == 200 and reply.json()["outputs"] == [{"y": 6.0}]
    assert f"serving on https://127.0.0.1:{tls_server.port}, gRPC (TLS)" in tls_server.log()


def test_plain_http_to_the_tls_port_fails(tls_server: InferdServer):
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{tls_server.port}/health/live", timeout=10)


def test_a_client_that_does_not_trust_the_ca_is_refused(tls_server: InferdServer):
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(tls_server.url + "/health/live", timeout=10)  # the system's CAs


def test_grpc_over_tls_with_the_ca_as_root(tls_server: InferdServer, pki: PKI):
    target = f"127.0.0.1:{tls_server.grpc_port}"
    with grpc.secure_channel(target, pki.grpc_credentials()) as channel:
        assert _infer(channel) == 8.0
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.GRPCInferenceServiceStub(channel).ServerReady(pb.ServerReadyRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_cli_trusts_the_ca_in_ssl_cert_file(tls_server: InferdServer, pki: PKI):
    args = ("predict", "calc", "--input", '{"x": 5}', "--url", tls_server.url)
    out = run_cli(*args, data_dir=tls_server.data_dir, env={"SSL_CERT_FILE": str(pki.ca)})
    assert '"y": 10.0' in out.stdout
    refused = run_cli(*args, data_dir=tls_server.data_dir, check=False)
    assert refused.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr


def test_bench_over_https(tls_server: InferdServer, pki: PKI, tmp_path: Path):
    out = tmp_path / "bench.json"
    run_cli(
        "bench", tls_server.url, "--target", "predict", "--model", "calc", "--body",
        json.dumps(BODY), "-c", "2", "-n", "20", "--warmup", "0s", "--json", str(out),
        data_dir=tls_server.data_dir, env={"SSL_CERT_FILE": str(pki.ca)},
    )  # fmt: skip
    (level,) = json.loads(out.read_text())["levels"]
    assert level["status_counts"] == {"200": 20}, level


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_the_job_runner_calls_its_own_gateways_over_tls(
    servers: tuple[InferdServer, InferdServer], mutual: bool
):
    server = servers[mutual]
    job = server.client.post("/api/v1/batch", json={"model": "calc", "inputs": [{"x": 1.0}] * 3})
    assert job.status_code == 202, job.text
    done = server.wait_job(job.json()["batch_id"], timeout_s=30)
    assert (done["status"], done["succeeded"]) == ("succeeded", 3), done


def test_client_certificates_required_on_http(mtls_server: InferdServer, pki: PKI):
    with pytest.raises(httpx.TransportError):  # trusts the server, shows no certificate
        httpx.get(mtls_server.url + "/health/live", verify=pki.trusting(), timeout=10)
    reply = mtls_server.client.post("/api/v1/models/calc/predict", json=BODY)
    assert reply.status_code == 200 and reply.json()["outputs"] == [{"y": 6.0}]
    assert "client certificates required" in mtls_server.log()


def test_client_certificates_required_on_grpc(mtls_server: InferdServer, pki: PKI):
    target = f"127.0.0.1:{mtls_server.grpc_port}"
    no_cert = pki.grpc_credentials()  # trusts the server, shows no certificate
    with grpc.secure_channel(target, no_cert) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.GRPCInferenceServiceStub(channel).ServerReady(pb.ServerReadyRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(target, pki.grpc_credentials(client_cert=True)) as channel:
        assert _infer(channel) == 8.0


def test_the_settings_and_their_variables(monkeypatch: pytest.MonkeyPatch, pki: PKI):
    monkeypatch.setenv("INFERD_TLS__CERT_FILE", str(pki.server_cert))
    monkeypatch.setenv("INFERD_TLS__KEY_FILE", str(pki.server_key))
    monkeypatch.setenv("INFERD_TLS__CLIENT_CA_FILE", str(pki.ca))
    tls = Settings().tls
    assert (tls.cert_file, tls.key_file, tls.client_ca_file) == (
        pki.server_cert,
        pki.server_key,
        pki.ca,
    )
    with pytest.raises(ValueError, match="client_ca_file needs"):
        TLSConfig(client_ca_file=pki.ca)
    with pytest.raises(ValueError, match="go together"):
        TLSConfig(key_file=pki.server_key)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"INFERD_TLS__CERT_FILE": "{server_cert}"}, "tls.cert_file and tls.key_file go together"),
        (
            {"INFERD_TLS__CERT_FILE": "{server_cert}", "INFERD_TLS__KEY_FILE": "{missing}"},
            "tls.key_file: no such file: {missing}",
        ),
        (
            {"INFERD_TLS__CERT_FILE": "{server_key}", "INFERD_TLS__KEY_FILE": "{server_key}"},
            "do not load as a PEM certificate chain and its private key",
        ),
    ],
    ids=["cert-without-key", "missing-key", "not-a-certificate"],
)
def test_bad_tls_settings_stop_the_start_with_one_line(
    tmp_path: Path, pki: PKI, env: dict[str, str], says: str
):
    names = {"server_cert": pki.server_cert, "server_key": pki.server_key,
             "missing": tmp_path / "nope.key"}  # fmt: skip
    env = {key: value.format(**names) for key, value in env.items()}
    result = run_cli("serve", "--port", "0", "--grpc-port", "-1", data_dir=tmp_path,
                     env=env, check=False)  # fmt: skip
    assert result.returncode != 0
    assert says.format(**names) in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
