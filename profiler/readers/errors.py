"""The error every reader raises for input it cannot use."""
from analyzers.trace import TraceError


class TraceReadError(TraceError):
    """A file that is not a readable trace (wrong kind, truncated, corrupt, empty, no kernels): one line for the user."""
