"""kopf's login helpers (`kopf.login_with_service_account`, `login_with_kubeconfig`,
`login_via_client`, `login_via_async_client`, `login_via_pykube`), for `@kopf.on.login`
handlers that return what they give: the credentials of this process's environment, as a
`ConnectionInfo` that the controller then uses. kopf's own rules: None when the source is
absent (no service account, no kubeconfig, the client library not installed).

The controller logs in by itself when no login handler is registered; these are for operators
that choose their credentials in a handler.
"""

import os
from typing import Optional

import yaml

from capstan.structs import ConnectionInfo

#: The pod's service account (patchable for tests).
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


class LoginError(Exception):
    """A login source is there but gives no usable credentials (kopf's `kopf.LoginError`)."""


def login_with_service_account(**_) -> Optional[ConnectionInfo]:
    """The pod's service account: its token, CA and namespace, and the API server's in-cluster
    address."""
    token_path = os.path.join(SERVICE_ACCOUNT, "token")
    if not os.path.exists(token_path):
        return None
    with open(token_path, encoding="utf-8") as f:
        token = f.read().strip()
    namespace = None
    ns_path = os.path.join(SERVICE_ACCOUNT, "namespace")
    if os.path.exists(ns_path):
        with open(ns_path, encoding="utf-8") as f:
            namespace = f.read().strip()
    ca_path = os.path.join(SERVICE_ACCOUNT, "ca.crt")
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return ConnectionInfo(server=f"https://{host}:{port}", ca_path=ca_path if os.path.exists(ca_path) else None,
                          token=token or None, default_namespace=namespace, priority=20)


def _load(path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def login_with_kubeconfig(**_) -> Optional[ConnectionInfo]:
    """The current context of `$KUBECONFIG` (its files merged, the first value winning) or
    `~/.kube/config`: tokens, basic auth, client certificates, CAs (kopf's minimal reader: no
    exec or auth-provider plugins beyond an access token already there)."""
    kubeconfig = os.environ.get("KUBECONFIG")
    if not kubeconfig and os.path.exists(os.path.expanduser("~/.kube/config")):
        kubeconfig = "~/.kube/config"
    if not kubeconfig:
        return None
    paths = [os.path.expanduser(p.strip()) for p in kubeconfig.split(os.pathsep) if p.strip()]
    current, contexts, clusters, users = None, {}, {}, {}
    for path in paths:
        config = _load(path)
        current = current or config.get("current-context")
        for section, into, key in (("contexts", contexts, "context"), ("clusters", clusters, "cluster"),
                                   ("users", users, "user")):
            for item in config.get(section) or []:
                into.setdefault(item["name"], item.get(key) or {})
    if current is None:
        raise LoginError("Current context is not set in kubeconfigs.")
    context = contexts[current]
    cluster, user = clusters[context["cluster"]], users[context["user"]]
    provider_token = ((user.get("auth-provider") or {}).get("config") or {}).get("access-token")
    return ConnectionInfo(
        server=cluster.get("server"), ca_path=cluster.get("certificate-authority"),
        ca_data=cluster.get("certificate-authority-data"), insecure=cluster.get("insecure-skip-tls-verify"),
        certificate_path=user.get("client-certificate"), certificate_data=user.get("client-certificate-data"),
        private_key_path=user.get("client-key"), private_key_data=user.get("client-key-data"),
        username=user.get("username"), password=user.get("password"), token=user.get("token") or provider_token,
        default_namespace=context.get("namespace"), priority=10,
    )


def login_via_client(**_) -> Optional[ConnectionInfo]:
    """The credentials the official `kubernetes` client library finds (in-cluster, else the
    kubeconfig); None without the library."""
    try:
        import kubernetes.client
        import kubernetes.config
    except ImportError:
        return None
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    config = kubernetes.client.Configuration.get_default_copy()
    header = config.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0]) if parts else (None, None)
    return ConnectionInfo(server=config.host, ca_path=config.ssl_ca_cert, insecure=not config.verify_ssl,
                          username=config.username or None, password=config.password or None, scheme=scheme,
                          token=token, certificate_path=config.cert_file, private_key_path=config.key_file,
                          priority=10)


def login_via_async_client(**_) -> Optional[ConnectionInfo]:
    """kopf's login through `kubernetes_asyncio`: with Capstan, the same credentials as
    `login_via_client` finds (None without the `kubernetes` library)."""
    return login_via_client()


def login_via_pykube(**_) -> Optional[ConnectionInfo]:
    """The credentials `pykube-ng` finds (in-cluster, else the kubeconfig); None without it."""
    try:
        import pykube
    except ImportError:
        return None
    try:
        config = pykube.KubeConfig.from_service_account()
    except FileNotFoundError:
        config = pykube.KubeConfig.from_file(os.environ.get("KUBECONFIG", "~/.kube/config"))
    user, cluster = config.user or {}, config.cluster or {}
    ca = cluster.get("certificate-authority")
    return ConnectionInfo(
        server=cluster.get("server"), ca_path=getattr(ca, "filename", None) if ca else None,
        insecure=cluster.get("insecure-skip-tls-verify"), username=user.get("username"),
        password=user.get("password"), token=user.get("token"), default_namespace=config.namespace, priority=20,
    )
