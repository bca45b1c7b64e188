"""The errors the server's engine side raises to its front end (beside servelab.errors,
which the engine core raises): the engine cannot take work, or failed taking a request."""

from __future__ import annotations

from servelab.errors import ServelabError


class EngineUnavailable(ServelabError):
    """The engine is stopping or has failed; no new request can start."""


class AdmissionFailed(ServelabError):
    """The engine raised something other than RequestError while taking this request in:
    a fault of ours, not of the client's; the request is refused and nothing of it remains."""
