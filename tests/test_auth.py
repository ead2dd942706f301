"""Authentication: API keys (stored as hashes, scopes, model allow-lists, revocation) and
JWTs (HS256 secret file, RS256 public key, ES256 in a JWKS file), on the real server over
HTTP, the OpenAI client and gRPC, with the whole refusal matrix."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jwt
import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from inferd.access.principal import Principal
from inferd.api.auth import required_scope
from inferd.errors import Forbidden, InvalidInput, NotFound
from inferd.registry import Registry
from inferd.registry.api_key import parse_key, secret_matches
from tests.conftest import InferdServer, arithmetic_model, push_source, run_cli
from tests.inprocess import InProcessServer

# -- pieces ---------------------------------------------------------------------------------


def test_which_scope_each_route_needs():
    assert required_scope("GET", "/health/live") is None
    assert required_scope("GET", "/v2/health/ready") is None
    assert required_scope("GET", "/metrics") is None
    assert required_scope("POST", "/api/v1/models/fraud/predict") == "infer"
    assert required_scope("POST", "/api/v1/models/fraud/generate") == "infer"
    assert required_scope("POST", "/api/v1/models/fraud/explain") == "infer"
    assert required_scope("POST", "/api/v1/models/fraud/versions/v1/explain") == "infer"
    assert required_scope("POST", "/api/v1/models/fraud/versions") == "admin"  # a push
    assert required_scope("GET", "/api/v1/models/fraud") == "infer"
    assert required_scope("POST", "/v2/models/fraud/infer") == "infer"
    assert required_scope("POST", "/v1/chat/completions") == "infer"
    assert required_scope("GET", "/docs") == "infer"
    assert required_scope("POST", "/api/v1/deployments") == "admin"
    assert required_scope("GET", "/api/v1/keys") == "admin"
    assert required_scope("GET", "/api/v1/logs") == "admin"
    assert required_scope("POST", "/v2/repository/models/fraud/load") == "admin"
    assert required_scope("POST", "/v1/load_lora_adapter") == "admin"
    assert required_scope("DELETE", "/api/v1/models/fraud") == "admin"
    assert required_scope("GET", "/api/v1/whoami") == "infer"


def test_a_principal_may_see_what_it_may_call():
    only = Principal("API key", "k1", frozenset({"infer"}), frozenset({"open"}))
    assert only.may_use("open") and only.may_use("open:reviews")  # an adapter of its model
    assert not only.may_use("secret") and not only.may_use("secret:open")
    with pytest.raises(Forbidden, match="may not use model 'secret:open'"):
        only.allow_model("secret:open")
    anyone = Principal("token", "sub", frozenset({"infer"}), None)
    admin = Principal("token", "ops", frozenset({"admin"}), frozenset({"open"}))
    assert anyone.may_use("secret") and admin.may_use("secret") and admin.admin


def test_keys_are_stored_as_hashes_and_revocable(registry: Registry):
    record, key = registry.keys.create("svc", ["infer"], ["fraud"], actor="test")
    assert key.startswith(f"ik_{record.key_id}_") and len(key) == 3 + 12 + 1 + 43
    stored = registry.keys.get(record.key_id)
    assert stored is not None and key.split("_", 2)[2] not in json.dumps(stored.to_dict())
    assert stored.secret_sha256 != key and len(stored.secret_sha256) == 64
    _, secret = parse_key(key)  # type: ignore[misc]
    assert secret_matches(stored, secret) and not secret_matches(stored, "x" * 43)
    assert (stored.scopes, stored.models) == (("infer",), ("fraud",))
    assert registry.keys.revoke(record.key_id).revoked_at is not None
    assert [k.key_id for k in registry.keys.list_all()] == [record.key_id]
    with pytest.raises(NotFound):
        registry.keys.revoke("000000000000")
    for scopes in ([], ["root"], "infer"):
        with pytest.raises(InvalidInput, match="scopes must be"):
            registry.keys.create("bad", scopes)  # type: ignore[arg-type]
    assert parse_key("ik_short_x") is None and parse_key("sk-openai") is None


# -- the real server --------------------------------------------------------------------------

BODY = {"inputs": [{"x": 1.5}]}
SECRET = "s3cret-s3cret-s3cret-s3cret-s3cret-42"


@pytest.fixture(scope="module")
def keys_and_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data = tmp_path_factory.mktemp("auth")
    for name in ("open", "secret"):
        push_source(data, name, arithmetic_model("x * 2"))
    # an output named "embedding": an embedding model, listed by OpenAI's /v1/models too
    push_source(data, "vectors", arithmetic_model("x * 2").replace('"y"', '"embedding"'))
    (data / "hs256").write_text(SECRET)
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (data / "rsa.pem").write_bytes(
        rsa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    ec_key = ec.generate_private_key(ec.SECP256R1())
    jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(ec_key.public_key()))
    (data / "jwks.json").write_text(json.dumps({"keys": [{**jwk, "alg": "ES256", "kid": "e1"}]}))

    def key(*args: str) -> str:
        out = run_cli("keys", "create", *args, data_dir=data)
        assert "store it now" in out.stderr
        return out.stdout.strip()

    keys = {
        "admin": key("ops", "--scope", "admin"),
        "infer": key("app", "--scope", "infer"),
        "open_only": key("partner", "--scope", "infer", "--model", "open"),
        "revoked": key("old", "--scope", "infer"),
    }
    revoked_id = keys["revoked"].split("_")[1]
    run_cli("keys", "revoke", revoked_id, data_dir=data)
    env = {
        "INFERD_AUTH__ENABLED": "true",
        "INFERD_AUTH__CACHE_S": "0.5",
        "INFERD_AUTH__JWT_SECRET_FILE": str(data / "hs256"),
        "INFERD_AUTH__JWT_PUBLIC_KEY_FILE": str(data / "rsa.pem"),
        "INFERD_AUTH__JWT_JWKS_FILE": str(data / "jwks.json"),
    }
    server = InferdServer(data, workers=2, env=env)
    try:
        server.wait_ready()
        yield {"server": server, "keys": keys, "rsa": rsa_key, "ec": ec_key, "data": data}
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def _call(
    server: InferdServer, method: str, path: str, key: str | None = None, **kw: Any
) -> httpx.Response:
    headers = kw.pop("headers", {})
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return server.client.request(method, path, headers=headers, **kw)


def _token(claims: dict[str, Any], key: Any = SECRET, alg: str = "HS256", **headers: Any) -> str:
    base = {"sub": "svc-42", "exp": int(time.time()) + 300, "scope": "infer"}
    return jwt.encode({**base, **claims}, key, algorithm=alg, headers=headers or None)


@pytest.mark.slow
def test_the_refusal_matrix(keys_and_server):
    server, keys = keys_and_server["server"], keys_and_server["keys"]
    predict = "/api/v1/models/open/predict"
    assert server.client.get("/health/live").status_code == 200  # public
    assert server.client.get("/health/ready").status_code == 200

    none = _call(server, "POST", predict, json=BODY)
    assert none.status_code == 401 and none.headers["www-authenticate"].startswith("Bearer")
    assert none.json()["error"]["code"] == "unauthorized"
    basic = _call(server, "POST", predict, json=BODY, headers={"authorization": "Basic Zm9v"})
    assert basic.status_code == 401 and "malformed Authorization" in basic.text
    bad = _call(server, "POST", predict, "ik_0123456789ab_" + "A" * 43, json=BODY)
    assert bad.status_code == 401 and "unknown API key" in bad.text
    garbage = _call(server, "POST", predict, "not-a-key", json=BODY)
    assert garbage.status_code == 401 and "malformed credential" in garbage.text
    revoked = _call(server, "POST", predict, keys["revoked"], json=BODY)
    assert revoked.status_code == 401 and "revoked" in revoked.text

    ok = _call(server, "POST", predict, keys["infer"], json=BODY)
    assert ok.status_code == 200 and ok.json()["outputs"] == [{"y": 3.0}]
    header = server.client.post(predict, json=BODY, headers={"x-api-key": keys["infer"]})
    assert header.status_code == 200
    wrong_scope = _call(server, "GET", "/api/v1/deployments", keys["infer"])
    assert wrong_scope.status_code == 403 and "lacks the 'admin' scope" in wrong_scope.text
    assert _call(server, "GET", "/api/v1/deployments", keys["admin"]).status_code == 200
    assert (
        _call(
            server,
            "POST",
            "/v2/models/open/infer",
            keys["admin"],
            json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [2]}]},
        ).status_code
        == 200
    )  # fmt: skip  -- admin includes infer

    # Registering over the API is an admin's: an infer key cannot push, edit or delete.
    for method, path in (
        ("POST", "/api/v1/models"),
        ("PATCH", "/api/v1/models/open"),
        ("POST", "/api/v1/models/open/versions"),
        ("DELETE", "/api/v1/models/open/versions/v1"),
    ):
        refused = _call(server, method, path, keys["infer"], json={"name": "x"})
        assert refused.status_code == 403 and "'admin' scope" in refused.text, (path, refused.text)
        assert _call(server, method, path, json={"name": "x"}).status_code == 401
    tagged = _call(server, "PATCH", "/api/v1/models/open", keys["admin"], json={"tags": {"a": "b"}})
    assert tagged.status_code == 200 and tagged.json()["tags"] == {"a": "b"}
    pull = "/api/v1/models/open/versions/v1/artifact"  # a model's files: an admin's too
    assert _call(server, "GET", pull, keys["infer"]).status_code == 403
    assert _call(server, "GET", pull, keys["admin"]).status_code == 200

    # A key for one model: the others are refused, by path and by body.
    only = keys["open_only"]
    assert _call(server, "POST", predict, only, json=BODY).status_code == 200
    other = _call(server, "POST", "/api/v1/models/secret/predict", only, json=BODY)
    assert other.status_code == 403 and "may not use model 'secret'" in other.text
    by_body = _call(
        server, "POST", "/api/v1/predict", only, json={"model": "secret", "input": {"x": 1}}
    )
    assert by_body.status_code == 403
    v2 = _call(server, "GET", "/v2/models/secret", only)
    assert v2.status_code == 403

    # Keys made over the API (admin only), shown once; revocation is felt within cache_s.
    made = _call(
        server, "POST", "/api/v1/keys", keys["admin"], json={"name": "tmp", "scopes": ["infer"]}
    )
    assert made.status_code == 201, made.text
    new_key, new_id = made.json()["key"], made.json()["key_id"]
    assert _call(server, "POST", predict, new_key, json=BODY).status_code == 200
    listed = _call(server, "GET", "/api/v1/keys", keys["admin"]).json()["keys"]
    assert new_id in {k["key_id"] for k in listed} and "key" not in listed[0]
    assert (
        _call(server, "POST", "/api/v1/keys", keys["infer"], json={"name": "x"}).status_code == 403
    )
    assert _call(server, "DELETE", f"/api/v1/keys/{new_id}", keys["admin"]).status_code == 200
    # Refused once the cached record (kept cache_s, 0.5 s here) is read again: within
    # 1 s, the time this checked after when it slept instead.
    server.wait_for(
        lambda: _call(server, "POST", predict, new_key, json=BODY).status_code == 401,
        timeout_s=1.0,
        what="the revocation felt",
    )
    gone = _call(server, "POST", predict, new_key, json=BODY)
    assert gone.status_code == 401 and "revoked" in gone.text
    assert _call(server, "DELETE", "/api/v1/keys/000000000000", keys["admin"]).status_code == 404

    # No key ever reaches the log.
    log = server.log()
    assert all(k.split("_", 2)[2] not in log for k in [*keys.values(), new_key])


@pytest.mark.slow
def test_jwts(keys_and_server):
    server = keys_and_server["server"]
    predict = "/api/v1/models/open/predict"
    assert _call(server, "POST", predict, _token({}), json=BODY).status_code == 200
    rs = _token({}, keys_and_server["rsa"], "RS256")
    assert _call(server, "POST", predict, rs, json=BODY).status_code == 200
    es = _token({"scope": "admin"}, keys_and_server["ec"], "ES256", kid="e1")
    assert _call(server, "GET", "/api/v1/deployments", es).status_code == 200

    expired = _call(server, "POST", predict, _token({"exp": int(time.time()) - 10}), json=BODY)
    assert expired.status_code == 401 and "token expired" in expired.text
    forged = _call(
        server, "POST", predict, _token({}, "another-secret-of-32-characters!!"), json=BODY
    )
    assert forged.status_code == 401 and "invalid token" in forged.text
    no_sub = jwt.encode({"exp": int(time.time()) + 60, "scope": "infer"}, SECRET, algorithm="HS256")
    assert _call(server, "POST", predict, no_sub, json=BODY).status_code == 401
    infer_only = _call(server, "GET", "/api/v1/deployments", _token({}))
    assert infer_only.status_code == 403
    scoped = _token({"models": ["secret"]})
    assert _call(server, "POST", predict, scoped, json=BODY).status_code == 403
    listed = _token({"scopes": ["infer"], "scope": None})
    assert _call(server, "POST", predict, listed, json=BODY).status_code == 200


@pytest.mark.slow
def test_openai_client_and_grpc_use_the_same_keys(keys_and_server):
    import openai
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    server, keys = keys_and_server["server"], keys_and_server["keys"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=keys["infer"])
    assert [m.id for m in client.models.list().data] == ["vectors"]  # its embedding model
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong").models.list()

    triton = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    assert triton.is_server_live()  # public
    x = grpcclient.InferInput("x", [1], "FP32")
    x.set_data_from_numpy(np.array([4.0], dtype=np.float32))
    with pytest.raises(InferenceServerException, match="credential"):
        triton.infer("open", [x])
    auth = {"authorization": f"Bearer {keys['open_only']}"}
    assert triton.infer("open", [x], headers=auth).as_numpy("y").tolist() == [8.0]
    with pytest.raises(InferenceServerException, match="may not use model 'secret'"):
        triton.infer("secret", [x], headers=auth)
    with pytest.raises(InferenceServerException, match="admin"):
        triton.get_model_repository_index(headers=auth)
    admin = {"x-api-key": keys["admin"]}
    assert triton.get_model_repository_index(headers=admin, as_json=True)["models"]
    triton.close()


# -- what a credential may see -------------------------------------------------------------


def _listed(server: Any, credential: str | None) -> tuple[list[str], list[str]]:
    """The models ``GET /api/v1/models`` and OpenAI's ``GET /v1/models`` show a caller."""
    ours = _call(server, "GET", "/api/v1/models", credential)
    openai = _call(server, "GET", "/v1/models", credential)
    assert ours.status_code == openai.status_code == 200, (ours.text, openai.text)
    names = sorted(m["name"] for m in ours.json()["models"])
    return names, [m["id"] for m in openai.json()["data"]]


@pytest.mark.slow
def test_a_restricted_credential_lists_only_its_models(keys_and_server):
    server, keys = keys_and_server["server"], keys_and_server["keys"]
    everything = (["open", "secret", "vectors"], ["vectors"])
    assert _listed(server, keys["admin"]) == everything
    assert _listed(server, keys["infer"]) == everything
    assert _listed(server, keys["open_only"]) == (["open"], [])
    assert _listed(server, _token({"models": ["vectors"]})) == (["vectors"], ["vectors"])
    assert _listed(server, _token({"models": ["open"], "scope": "admin"})) == everything


@pytest.mark.slow
def test_whoami(keys_and_server):
    server, keys = keys_and_server["server"], keys_and_server["keys"]

    def whoami(credential: str | None) -> dict[str, Any]:
        reply = _call(server, "GET", "/api/v1/whoami", credential)
        assert reply.status_code == 200, reply.text
        assert credential is None or credential not in reply.text  # never echoed
        return dict(reply.json())

    admin_id, only_id = (keys[k].split("_")[1] for k in ("admin", "open_only"))
    assert whoami(keys["admin"]) == {
        "auth": True, "kind": "API key", "subject": admin_id,
        "scopes": ["admin"], "models": None, "admin": True,
    }  # fmt: skip
    assert whoami(keys["open_only"]) == {
        "auth": True, "kind": "API key", "subject": only_id,
        "scopes": ["infer"], "models": ["open"], "admin": False,
    }  # fmt: skip
    assert whoami(_token({"models": ["vectors", "open"]})) == {
        "auth": True, "kind": "token", "subject": "svc-42",
        "scopes": ["infer"], "models": ["open", "vectors"], "admin": False,
    }  # fmt: skip
    assert _call(server, "GET", "/api/v1/whoami").status_code == 401


def test_whoami_and_listings_with_auth_off(tmp_path):
    server = InProcessServer(tmp_path)
    try:
        server.push_source("open", arithmetic_model("x * 2"))
        ignored = {"authorization": "Bearer ik_0123456789ab_" + "A" * 43}  # auth is off
        reply = server.client.get("/api/v1/whoami", headers=ignored)
        assert reply.json() == {
            "auth": False, "kind": None, "subject": None,
            "scopes": ["admin", "infer"], "models": None, "admin": True,
        }  # fmt: skip
        listed = server.client.get("/api/v1/models", headers=ignored).json()["models"]
        assert [m["name"] for m in listed] == ["open"]
    finally:
        server.stop()
