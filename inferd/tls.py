"""TLS on the client-facing ports: HTTP and gRPC of every gateway (``settings.tls``).

Not the cluster's mutual TLS between inferd's own processes (``cluster.tls_*``, see
:mod:`inferd.transport`): this one is what API clients see.

- The server process loads the files once at start (:func:`check`), before any gateway
  starts, so a missing or unreadable file is one line naming it, not a gateway that
  fails to start. Each gateway process then loads them itself: uvicorn for HTTP,
  :func:`server_context` for gRPC (ALPN ``h2``), on the port they share (SO_REUSEPORT).
- The server calls its own gateways (the job runner): it trusts exactly the certificate
  they serve (:func:`own_gateways_client`), whatever names it holds, since it reaches
  them on loopback. With client certificates required (``tls.client_ca_file``) it
  presents one of its own, made at each start (its key lives in the server's memory;
  on disk only while it is loaded, in the private run folder): the gateways trust
  ``client_ca_file`` plus that certificate.
"""

from __future__ import annotations

import datetime
import ssl
import tempfile
from pathlib import Path

from inferd.config import TLSConfig

RUNNER_NAME = "inferd job runner"


def check(config: TLSConfig) -> None:
    """SystemExit naming the setting and file when one is missing or does not load."""
    if config.cert_file is None or config.key_file is None:
        return
    named = [("tls.cert_file", config.cert_file), ("tls.key_file", config.key_file)]
    if config.client_ca_file is not None:
        named.append(("tls.client_ca_file", config.client_ca_file))
    for setting, path in named:
        if not path.is_file():
            raise SystemExit(f"error: {setting}: no such file: {path}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(config.cert_file, config.key_file)
    except OSError as exc:
        raise SystemExit(
            f"error: tls.cert_file {config.cert_file} and tls.key_file {config.key_file} do "
            f"not load as a PEM certificate chain and its private key: {_why(exc)}"
        ) from None
    if config.client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=config.client_ca_file)
        except OSError as exc:
            raise SystemExit(
                f"error: tls.client_ca_file {config.client_ca_file} does not load as PEM "
                f"CA certificates: {_why(exc)}"
            ) from None


def server_context(config: TLSConfig, alpn: list[str] | None = None) -> ssl.SSLContext:
    """A server's TLS context for ``settings.tls``: client certificates required when
    ``client_ca_file`` is set; ``alpn``: the protocols offered (HTTP/2 is ``h2``)."""
    assert config.cert_file is not None and config.key_file is not None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(config.cert_file, config.key_file)
    if config.client_ca_file is not None:
        context.load_verify_locations(cafile=config.client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    if alpn:
        context.set_alpn_protocols(alpn)
    return context


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)  # ssl.SSLError is an OSError


def own_gateways_client(config: TLSConfig, run_dir: Path) -> tuple[ssl.SSLContext, Path | None]:
    """The client context with which this server calls its own gateways, and (when client
    certificates are required) the CA bundle the gateways must trust instead of
    ``client_ca_file``: it, plus this client's certificate. Call after :func:`check`."""
    assert config.cert_file is not None
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=config.cert_file)
    # Trust the served certificate itself (a leaf, not only a root) and not its names:
    # the gateways are reached on loopback, whatever host names the certificate holds.
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    context.check_hostname = False
    if config.client_ca_file is None:
        return context, None
    cert_pem, key_pem = _client_identity()
    with tempfile.TemporaryDirectory(dir=run_dir) as tmp:
        key = Path(tmp) / "key.pem"
        key.write_bytes(key_pem)
        cert = Path(tmp) / "cert.pem"
        cert.write_bytes(cert_pem)
        context.load_cert_chain(cert, key)
    bundle = run_dir / "tls-client-ca.pem"
    bundle.write_bytes(config.client_ca_file.read_bytes().rstrip() + b"\n" + cert_pem)
    return context, bundle


def _client_identity() -> tuple[bytes, bytes]:
    """A self-signed client certificate for this process's life (PEM cert, PEM key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, RUNNER_NAME)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem
