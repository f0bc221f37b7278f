"""What a returning row meant for its request, and the protocol error: the vocabulary the SP
state (``slot_state``, the server's) and its test oracle (``sp_state``) share, so the server
imports no oracle."""

from __future__ import annotations

import enum

__all__ = ["Outcome", "SPProtocolError"]


class SPProtocolError(RuntimeError):
    """The caller broke the protocol (e.g. launched a row that :meth:`SPState.next_row` would
    not)."""


class Outcome(enum.Enum):
    """What a returning row's true token meant for its request."""

    #: The token confirms the draft the next in-flight row was built on.
    ACCEPTED = "accepted"
    #: The token contradicts that draft: the epoch was bumped, in-flight rows are stale.
    REJECTED = "rejected"
    #: The token was committed and no speculative row depended on it (normal decoding, or
    #: the request's draft was dropped / not launched yet).
    APPENDED = "appended"
    #: The row belongs to an old epoch or to a removed / unknown request: ignore its result.
    STALE = "stale"
