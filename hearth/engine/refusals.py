"""Why the engine refuses a request, as a type: the request field at fault and an error code,
not a "param: message" string for the HTTP edge to split.

Every refusal an engine-side check can raise is a `RequestRejected` (a ValueError, so callers
that only care that the request is bad keep catching ValueError). Across the engine-core
socket it travels as a `Rejection` (msgspec), and the server turns it into an OpenAI 400 with
`param` and `code` copied over.
"""

from __future__ import annotations

import msgspec


class Rejection(msgspec.Struct, frozen=True):
    message: str  # whole, for the client: "prompt: 5000 tokens, but the model's context ..."
    param: str | None = None  # the request field at fault (OpenAI error `param`)
    code: str | None = None  # OpenAI error `code`, e.g. "context_length_exceeded"

    @classmethod
    def of(cls, exc: BaseException) -> "Rejection":
        """A RequestRejected's own fields; any other error is a rejection of no field."""
        if isinstance(exc, RequestRejected):
            return cls(str(exc), exc.param, exc.code)
        return cls(str(exc))


class RequestRejected(ValueError):
    """A request the engine will not run; `param` names the request field at fault."""

    def __init__(self, param: str | None, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code
