"""Passwords never shown, stored or passed on: the one place a database URL is masked (the
study file, the CLI and the storage all print or store URLs through it), and the one place
its credentials are encoded before a database library parses them."""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

#: the password runs to the LAST "@": an unencoded "@" inside it must not end the mask
_PASSWORD = re.compile(r"(?P<head>://[^:/]*:)(?P<password>.*)(?P<tail>@[^@]*)$", re.DOTALL)
#: the same split, with the scheme and the user name: ``scheme://user:password@rest``
_CREDENTIALS = re.compile(r"^(?P<scheme>[^:/]+://)(?P<user>[^:/]*):(?P<password>.*)@(?P<rest>[^@]*)$", re.DOTALL)
#: the passwords of the URLs this process opened (raw and as given), masked in any text
_secrets: set[str] = set()
#: a shorter password is masked in URLs only: replacing every "ab" in a message would garble it
MIN_SECRET_CHARS = 4


def mask_url(url: str) -> str:
    """``postgresql://user:secret@host/db`` → ``postgresql://user:***@host/db``."""
    return _PASSWORD.sub(lambda m: f"{m['head']}***{m['tail']}", url)


def encoded_credentials(url: str) -> str:
    """``url`` with its user name and password percent-encoded, so that a database library
    reads the password whatever characters it holds (SQLAlchemy ends an unencoded password
    at its first "@" and takes the rest for the host, which then shows in its errors). The
    password is remembered for ``mask_secrets``."""
    m = _CREDENTIALS.match(url)
    if m is None or url.startswith("sqlite"):
        return url
    password = unquote(m["password"])
    _secrets.update(s for s in (m["password"], password) if len(s) >= MIN_SECRET_CHARS)
    return f"{m['scheme']}{quote(unquote(m['user']), safe='')}:{quote(password, safe='')}@{m['rest']}"


def mask_secrets(text: str) -> str:
    """``text`` with each URL's password masked, and each password this process opened a
    database with (``encoded_credentials``) masked wherever it stands."""
    text = mask_url(text)
    for secret in sorted(_secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text
