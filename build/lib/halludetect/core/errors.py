"""The one base class of bad-input errors.

A stage that raises a `UserError` (bad params, a missing or damaged input file, an endpoint
that refuses a key, ...) prints its message and exits 2, without a traceback: the message
names the file, line or params key and the fix. Anything else is a bug and keeps its
traceback. Each module defines its own subclass next to the code that raises it; this module
imports nothing, so catching them costs a stage nothing.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: a message for the user, naming what to fix."""


class DataError(UserError, ValueError):
    """Labels, states or P_sem that cannot be trained or evaluated on as they are."""
