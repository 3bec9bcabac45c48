"""User-facing errors: the CLI prints their message (no traceback) and exits with status 2."""


class UserError(ValueError):
    """Something the user can fix: the message names the problem and the fix."""
