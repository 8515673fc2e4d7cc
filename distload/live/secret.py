"""The job secret: what every process that meets another over the network must know.

Anything distload listens on (a sync channel's rendezvous, ``distload serve``) and anything that
connects to it proves it knows the same secret before a single value is read from the connection
(distload/live/store.py), and every bucket of weights is checked with a tag keyed by it
(distload/live/transfer.py). It comes from, in order:

1. a file named by ``secret_file=`` / ``--secret-file`` (readable by its owner only: chmod 600);
2. ``DISTLOAD_SECRET_FILE``, the same;
3. ``DISTLOAD_SECRET``, the secret itself.

The secret is never printed, logged, put in a report or an error message: :class:`Secret` keeps
it out of ``repr``, and only keys derived from it (HMAC-SHA256) are used on the wire.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

from distload.errors import ConfigError

SECRET_ENV = "DISTLOAD_SECRET"
SECRET_FILE_ENV = "DISTLOAD_SECRET_FILE"
MIN_BYTES = 16  # a shorter secret is refused: it could be guessed by trying
HOW = ("set DISTLOAD_SECRET (or DISTLOAD_SECRET_FILE, a file readable by its owner only) to the same secret on "
       "every member, e.g. one made by `distload secret`")  # what to do, in every message that needs one


class Secret:
    """The job secret, as keys derived from it. Its bytes never appear in ``repr`` or ``str``."""

    __slots__ = ("_key", "origin")

    def __init__(self, value: bytes, origin: str):
        value = value.strip()
        if len(value) < MIN_BYTES:
            raise ConfigError(f"the job secret from {origin} is {len(value)} bytes long; it needs at least "
                              f"{MIN_BYTES} (make one with `distload secret`)")
        # Only keys derived from it are kept: the secret itself is not held past this line.
        self._key = hmac.new(b"distload job secret v1", value, hashlib.sha256).digest()
        self.origin = origin  # where it came from ("DISTLOAD_SECRET", a file's path): safe to print

    def key(self, purpose: str) -> bytes:
        """A 32-byte key for one ``purpose`` ("store", "buckets"): no key opens another's door."""
        return hmac.new(self._key, purpose.encode(), hashlib.sha256).digest()

    def __repr__(self) -> str:
        return f"Secret(from {self.origin})"

    __str__ = __repr__


def job_secret(secret_file: str | os.PathLike | None = None) -> Secret | None:
    """The job secret (see the module's docstring), or None where none is set."""
    path = secret_file if secret_file is not None else os.environ.get(SECRET_FILE_ENV) or None
    if path is not None:
        return _from_file(os.fspath(path), "--secret-file" if secret_file is not None else SECRET_FILE_ENV)
    value = os.environ.get(SECRET_ENV)
    if value:
        return Secret(value.encode(), SECRET_ENV)
    return None


def _from_file(path: str, setting: str) -> Secret:
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            value = f.read(4096)
    except OSError as exc:
        raise ConfigError(f"cannot read the job secret file {path} ({setting}): {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # As ssh does with a private key: a secret others on the host can read is no secret.
        raise ConfigError(f"the job secret file {path} ({setting}) can be read by other users "
                          f"(mode {stat.S_IMODE(mode):o}): chmod 600 {path}")
    return Secret(value, path)


def make_secret() -> str:
    """A new secret: 32 random bytes, hex."""
    import secrets

    return secrets.token_hex(32)
