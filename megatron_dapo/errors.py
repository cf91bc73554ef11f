"""The one mark of an error a user can act on from its message alone.

An error of this kind names what is wrong (the key, the file, the URL, the step) and the fix, so the commands print
it as one line and exit non-zero; its traceback goes to the run's log (and to the console with --verbose). Any
other exception is a bug, and keeps its traceback on the console. Each part's own error classes derive from it.
"""


class DapoError(Exception):
    """An error whose message says what is wrong and how to fix it; printed by the commands as one line."""
