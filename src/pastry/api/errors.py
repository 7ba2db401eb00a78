"""The error an inferlet sees when it misuses the API."""

from __future__ import annotations


class ApiError(ValueError):
    """An inferlet misused the API (a foreign or freed handle, a bad argument); raised in
    that inferlet only, with a message naming the bad value."""
