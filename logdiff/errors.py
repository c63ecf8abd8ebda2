"""The one exception type for user mistakes: the CLI prints its message on one line and exits with 2."""


class UserError(Exception):
    """A problem with what the user asked for; the message names the problem and the fix."""
