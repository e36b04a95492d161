"""The error a user's mistake raises, apart from bugs."""


class UsageError(ValueError):
    """A mistake in how accel was called (an argument, a path, an environment variable), with a
    message that says what was expected and what came. The command line prints it in one line
    and exits with code 2; any other exception is a bug and keeps its traceback."""
