"""Authenticated messages on the rendezvous store: a per-job secret and HMAC-signed values.

The store a run talks through (the launcher's, torchrun's agent's, or rank 0's
TCPStore) has no authentication of its own: whoever reaches its port can read
and write any key. meshplan's own messages on it (heartbeats and the failure
reason every rank acts on) therefore carry an HMAC-SHA256 of their text under a
per-job secret. A value that does not verify is ignored and logged, so another
host cannot make the ranks quit by posting a fake failure.

The secret travels in the environment variable MESHPLAN_JOB_SECRET, never on a
command line (where `ps` shows it to every user of the machine): `meshplan run`
makes one per run, the generated launch scripts make one unless it is set (for
a multi-node torchrun job, set the same value on every node). Messages are
authenticated, not encrypted.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass

SECRET_ENV = "MESHPLAN_JOB_SECRET"
_SEP = "|"


def new_secret() -> str:
    """A fresh job secret: 32 random bytes as 64 hex digits."""
    return secrets.token_hex(32)


@dataclass(frozen=True)
class Signer:
    """Signs and verifies store values with the job secret.

    `secret` empty means the job has none (rank scripts started by hand without
    MESHPLAN_JOB_SECRET): values are still framed and checked, which protects
    nothing; `authenticated` says which case holds.
    """

    secret: str = ""

    @property
    def authenticated(self) -> bool:
        return bool(self.secret)

    def _mac(self, text: str) -> str:
        return hmac.new(self.secret.encode(), text.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()

    def sign(self, text: str) -> str:
        """`text` with its HMAC in front: the value to store."""
        return self._mac(text) + _SEP + text

    def verify(self, value: bytes | str) -> str | None:
        """The text of a signed value, or None if it was not signed with this job's secret."""
        raw = value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)
        mac, sep, text = raw.partition(_SEP)
        if not sep or not hmac.compare_digest(mac, self._mac(text)):
            return None
        return text


def signer_from_env(environ: dict | None = None) -> Signer:
    """The Signer of the job secret in MESHPLAN_JOB_SECRET (empty when unset)."""
    env = os.environ if environ is None else environ
    return Signer(env.get(SECRET_ENV, ""))


def shown(value: bytes | str, limit: int = 80) -> str:
    """A value that failed verification, cut and escaped for a log line."""
    raw = value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)
    return repr(raw[:limit]) + ("..." if len(raw) > limit else "")
