"""kopf's type names for handler signatures (`def fn(spec: kopf.Spec, logger: kopf.Logger,
**_)`), defined as kopf defines them — aliases and TypedDicts of the plain values the SDK
passes — so that annotations evaluate at import, and `isinstance` and type checkers see the
same types as under kopf. The classes among them (`Spec`, `Status`, `Meta`, `Body`, `Patch`)
live in `capstan.structs`: they are what handlers receive.
"""

import logging
from typing import Any, AsyncIterator, Callable, Dict, List, Mapping, NewType, Optional, Tuple, Union

try:  # Literal and TypedDict are in typing from Python 3.8.
    from typing import Literal, TypedDict
except ImportError:  # pragma: no cover
    from typing_extensions import Literal, TypedDict  # type: ignore

#: The handler's `logger` (kopf's `kopf.Logger`).
Logger = Union[logging.Logger, logging.LoggerAdapter]

#: The object's labels and annotations, as the `labels` and `annotations` kwargs give them.
Labels = Mapping[str, str]
Annotations = Mapping[str, str]

#: A handler's id (kopf's `kopf.HandlerId`).
HandlerId = NewType("HandlerId", str)

#: A field's path: a tuple of keys, or as decorators take it (kopf's `FieldPath`, `FieldSpec`).
FieldPath = Tuple[str, ...]
FieldSpec = Union[None, str, FieldPath, List[str]]

#: The admission request's operation (kopf's `kopf.Operation`).
Operation = Literal["CREATE", "UPDATE", "DELETE", "CONNECT"]

#: A watch event's type (kopf's `kopf.RawEventType`).
RawEventType = Literal[None, "ADDED", "MODIFIED", "DELETED", "BOOKMARK"]

#: An admission request's HTTP headers and the client's certificate (kopf's `kopf.Headers`,
#: `kopf.SSLPeer`); Capstan's webhook server passes on the headers, not the certificate (see
#: the README).
Headers = Dict[str, str]
SSLPeer = Dict[str, Any]


class RawMeta(TypedDict, total=False):
    """An object's raw metadata."""

    uid: str
    name: str
    namespace: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    finalizers: List[str]
    resourceVersion: str
    deletionTimestamp: str
    creationTimestamp: str
    selfLink: str


class RawBody(TypedDict, total=False):
    """An object as the API gives it (kopf's `kopf.RawBody`)."""

    apiVersion: str
    kind: str
    metadata: RawMeta
    spec: Mapping[str, Any]
    status: Mapping[str, Any]


class MetaEssence(TypedDict, total=False):
    labels: Mapping[str, str]
    annotations: Mapping[str, str]


class BodyEssence(TypedDict, total=False):
    """What of an object its diff is computed on (kopf's `kopf.BodyEssence`)."""

    metadata: MetaEssence
    spec: Mapping[str, Any]
    status: Mapping[str, Any]


class RawEvent(TypedDict):
    """A watch event, as `on.event` handlers get it in `event` (kopf's `kopf.RawEvent`)."""

    type: RawEventType
    object: RawBody


class OwnerReference(TypedDict, total=False):
    """An entry of `metadata.ownerReferences` (kopf's `kopf.OwnerReference`)."""

    controller: bool
    blockOwnerDeletion: bool
    apiVersion: str
    kind: str
    name: str
    uid: str


class ObjectReference(TypedDict, total=False):
    """An object's identity, as Events refer to it (kopf's `kopf.ObjectReference`)."""

    apiVersion: str
    kind: str
    namespace: Optional[str]
    name: str
    uid: str


class UserInfo(TypedDict):
    """Who sent an admission request: the `userinfo` kwarg (kopf's `kopf.UserInfo`)."""

    username: str
    uid: str
    groups: List[str]


class WebhookClientConfigService(TypedDict, total=False):
    namespace: Optional[str]
    name: Optional[str]
    path: Optional[str]
    port: Optional[int]


class WebhookClientConfig(TypedDict, total=False):
    """How the API server reaches a webhook (kopf's `kopf.WebhookClientConfig`)."""

    caBundle: Optional[str]
    url: Optional[str]
    service: Optional[WebhookClientConfigService]


#: A function that changes a raw body in place (kopf's `kopf.PatchFn`).
PatchFn = Callable[[RawBody], None]

#: What a webhook server calls for each request (kopf's `kopf.WebhookFn`).
WebhookFn = Callable[..., Any]

#: A webhook server or tunnel: given the request handler, yields client configs (kopf's
#: `kopf.WebhookServerProtocol`). With Capstan, the controller serves admission.
WebhookServerProtocol = Callable[[WebhookFn], AsyncIterator[WebhookClientConfig]]


def build_object_reference(body) -> ObjectReference:
    """The object's reference, as kopf posts Events with it (kopf's
    `kopf.build_object_reference`)."""
    meta = body.get("metadata", {}) or {}
    return ObjectReference(apiVersion=body.get("apiVersion"), kind=body.get("kind"), name=meta.get("name"),
                           uid=meta.get("uid"), namespace=meta.get("namespace"))
