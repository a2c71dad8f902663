"""Passwords never shown, stored or passed on: the one place a database URL is masked (the
study file, the CLI and the storage all print or store URLs through it)."""

from __future__ import annotations

import re

#: the password runs to the LAST "@": an unencoded "@" inside it must not end the mask
_PASSWORD = re.compile(r"(?P<head>://[^:/]*:)(?P<password>.*)(?P<tail>@[^@]*)$", re.DOTALL)


def mask_url(url: str) -> str:
    """``postgresql://user:secret@host/db`` → ``postgresql://user:***@host/db``."""
    return _PASSWORD.sub(lambda m: f"{m['head']}***{m['tail']}", url)
