"""kopf's webhook servers and tunnels (`settings.admission.server = kopf.WebhookServer(...)`):
with Capstan the controller's webhook server answers admission requests, so these classes hold
kopf's parameters and say which controller flags serve the same way (`flags()`), for the
settings review (`capstan.settings`) to name. They serve nothing themselves."""

from typing import Any, Dict, List, Optional


class WebhookServer:
    """kopf's local HTTPS webhook server: `--webhook-listen`, `--webhook-cert-dir`,
    `--webhook-cert-names`, `--webhook-url` are the controller's equivalents."""

    #: The host the API server reaches the operator by (kopf's cluster-flavoured servers).
    DEFAULT_HOST: Optional[str] = None

    def __init__(self, *, addr: Optional[str] = None, port: Optional[int] = None, path: Optional[str] = None,
                 host: Optional[str] = None, cadata: Optional[bytes] = None, cafile: Any = None, cadump: Any = None,
                 context: Any = None, insecure: bool = False, certfile: Any = None, pkeyfile: Any = None,
                 password: Optional[str] = None, extra_sans: Any = (), verify_mode: Any = None,
                 verify_cafile: Any = None, verify_capath: Any = None, verify_cadata: Any = None):
        self.addr, self.port, self.path, self.host = addr, port, path, host or self.DEFAULT_HOST
        self.cadata, self.cafile, self.cadump, self.context, self.insecure = cadata, cafile, cadump, context, insecure
        self.certfile, self.pkeyfile, self.password, self.extra_sans = certfile, pkeyfile, password, list(extra_sans)
        self.verify_mode, self.verify_cafile, self.verify_capath, self.verify_cadata = (
            verify_mode, verify_cafile, verify_capath, verify_cadata)

    def _params(self) -> Dict[str, Any]:
        return dict(vars(self))

    def __eq__(self, other):
        return type(self) is type(other) and self._params() == other._params()

    def __hash__(self):
        return hash(type(self))

    def __repr__(self):
        params = ", ".join(f"{k}={v!r}" for k, v in self._params().items() if v not in (None, False, []))
        return f"{type(self).__name__}({params})"

    def flags(self) -> List[str]:
        out = []
        if self.addr or self.port:
            out += ["--webhook-listen", f"{self.addr or '0.0.0.0'}:{self.port or 9443}"]
        names = [n for n in [self.host, *self.extra_sans] if n]
        if names:
            out += ["--webhook-cert-names", ",".join(names)]
        if self.host:
            port = f":{self.port}" if self.port else ""
            out += ["--webhook-url", f"https://{self.host}{port}{self.path or ''}"]
        return out


class WebhookK3dServer(WebhookServer):
    DEFAULT_HOST = "host.k3d.internal"


class WebhookMinikubeServer(WebhookServer):
    DEFAULT_HOST = "host.minikube.internal"


class WebhookDockerDesktopServer(WebhookServer):
    DEFAULT_HOST = "host.docker.internal"


class WebhookAutoServer(WebhookServer):
    """kopf picks a server by the cluster it detects; the controller's own defaults do."""

    def flags(self):
        return []


class WebhookNgrokTunnel:
    """kopf's ngrok tunnel: the controller has none (its `--webhook-url` takes an external
    tunnel's address)."""

    def __init__(self, *, addr: Optional[str] = None, port: Optional[int] = None, path: Optional[str] = None,
                 token: Optional[str] = None, region: Optional[str] = None, binary: Any = None):
        self.addr, self.port, self.path, self.token, self.region, self.binary = addr, port, path, token, region, binary

    def __eq__(self, other):
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self):
        return hash(type(self))

    def __repr__(self):
        return f"{type(self).__name__}(addr={self.addr!r}, port={self.port!r}, path={self.path!r})"

    def flags(self) -> List[str]:
        return []


class WebhookAutoTunnel(WebhookNgrokTunnel):
    def __init__(self, *, addr: Optional[str] = None, port: Optional[int] = None, path: Optional[str] = None):
        super().__init__(addr=addr, port=port, path=path)
