"""The cluster secret a launcher holds for its nodes' lifetime (S2, X5d), in one place.

A cluster started by `LocalCluster` or `RayCluster` always runs with a secret: the user's
(`SECRET_ENV`, if set) or a fresh random one. It is set in this process's environment while the
cluster lives, because the router and every `Channel` of this process read `cluster_secret()`
from there and must sign as the nodes do; `restore` puts back what was there before. Children
get it in their environment (`child_env`). Not the key derivation itself: that is
`disagg/control/secret.py`.
"""

from __future__ import annotations

import os
import secrets

from disagg.control.secret import SECRET_ENV, cluster_secret

SECRET_BYTES = 32  # 256 random bits, as hex: as strong as the HMAC-SHA256 key it feeds


class SecretScope:
    """`SECRET_ENV` set for this process from construction until `restore()` (idempotent):
    the user's secret if there is one, else a random one made here."""

    def __init__(self) -> None:
        self._previous = os.environ.get(SECRET_ENV)
        user = cluster_secret()
        self.secret = user.decode() if user else secrets.token_hex(SECRET_BYTES)
        self.generated = user is None
        os.environ[SECRET_ENV] = self.secret
        self._active = True

    def child_env(self, **extra: str) -> dict[str, str]:
        """The environment for a node process: this one's, with the secret (and `extra`)."""
        return dict(os.environ, **extra, **{SECRET_ENV: self.secret})

    def restore(self) -> None:
        """Put `SECRET_ENV` back as it was before (unset, or the user's value)."""
        if not self._active:
            return
        self._active = False
        if self._previous is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = self._previous
