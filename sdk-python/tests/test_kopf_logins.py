"""kopf's login helpers return the credentials of this process's environment as kopf's do —
None when their source is absent — and the credentials go on the wire as PEM, whether given as
PEM or as a kubeconfig's base64."""

import base64
import json

import pytest

import capstan.kopf as kopf
from capstan import logins, wire

PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def test_service_account(tmp_path, monkeypatch):
    monkeypatch.setattr(logins, "SERVICE_ACCOUNT", str(tmp_path))
    assert kopf.login_with_service_account() is None
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "namespace").write_text("ops")
    (tmp_path / "ca.crt").write_bytes(PEM)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    info = kopf.login_with_service_account(logger=None, settings=kopf.OperatorSettings())
    assert (info.server, info.token, info.default_namespace, info.ca_path) == (
        "https://10.0.0.1:6443", "tok", "ops", str(tmp_path / "ca.crt"))
    assert wire.credentials(info).certificate_authority == PEM


def test_kubeconfig(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert kopf.login_with_kubeconfig() is None
    config = {
        "current-context": "dev",
        "contexts": [{"name": "dev", "context": {"cluster": "c", "user": "u", "namespace": "team"}}],
        "clusters": [{"name": "c", "cluster": {"server": "https://api:6443",
                                               "certificate-authority-data": base64.b64encode(PEM).decode()}}],
        "users": [{"name": "u", "user": {"token": "secret"}}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("KUBECONFIG", str(path))
    info = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
    assert (info.server, info.token, info.default_namespace) == ("https://api:6443", "secret", "team")
    creds = wire.credentials(info)
    assert creds.certificate_authority == PEM and creds.token == "secret"


def test_kubeconfig_without_a_current_context_is_a_login_error(tmp_path, monkeypatch):
    path = tmp_path / "kubeconfig"
    path.write_text("{}")
    monkeypatch.setenv("KUBECONFIG", str(path))
    with pytest.raises(kopf.LoginError, match="Current context"):
        kopf.login_with_kubeconfig()


def test_client_libraries_absent_give_none():
    assert kopf.login_via_client(logger=None, settings=None) is None
    assert kopf.login_via_async_client() is None
    assert kopf.login_via_pykube() is None
