"""The errors a handler raises to tell the controller what to do next, with kopf's names and
meaning, and the errors the SDK raises at registration.

A handler's outcome is decided by what it raises: `TemporaryError` asks for a retry after its
delay, `PermanentError` (and `HandlerTimeoutError`) ends the handler until the next change,
and any other exception is "unclassified": the handler's `errors=` mode decides, on the
controller's side, as kopf's `ErrorsMode` does.
"""

import enum


class HandlerError(Exception):
    """Base of the errors a handler raises on purpose."""


class TemporaryError(HandlerError):
    """The handler failed but may succeed later: retried after `delay` seconds (kopf's
    default: 60)."""

    def __init__(self, message="", delay=60.0):
        super().__init__(message)
        self.delay = delay


class PermanentError(HandlerError):
    """The handler failed and must not be retried until the object changes."""


class HandlerTimeoutError(PermanentError):
    """The handler ran out of its `timeout` (kopf's name)."""


class HandlerRetriesError(PermanentError):
    """The handler ran out of its `retries` (kopf's name)."""


class AdmissionError(PermanentError):
    """Raised by a validating or mutating handler to deny the request (kopf's
    `kopf.AdmissionError`): `message` is shown to the user, `code` is the HTTP status (500,
    as kopf, when not given)."""

    def __init__(self, message="", code=500):
        super().__init__(message)
        self.code = code


class ErrorsMode(enum.Enum):
    """How errors that the handler did not classify are treated (kopf's `errors=`)."""

    IGNORED = "ignored"
    TEMPORARY = "temporary"
    PERMANENT = "permanent"


class RegistrationError(Exception):
    """A handler's registration is invalid or asks for something this controller does not
    support. Raised at decoration time, so that a mistake stops the operator at start."""


class ConnectionFatal(Exception):
    """The controller refused the handler process for good (for example, it accepted none of
    its handlers): reconnecting would not help."""


class StreamStalled(ConnectionError):
    """The stream to the controller took no message for the stall timeout: its outgoing
    queue stayed full, so results could neither be sent nor dropped. The process closes the
    stream and connects again (the controller re-queues the work of a lost stream)."""
