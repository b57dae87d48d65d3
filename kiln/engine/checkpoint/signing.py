"""Signed checkpoints (`save.signing_key_env: NAME`): the COMPLETE marker carries an HMAC-SHA256,
keyed by the value of the environment variable NAME, over everything else the marker holds (its
digest table of every file, their sizes, the step, format and version).

Unkeyed digests catch damage but not a forger who rewrites the files and their digests together; a
key the forger does not have does. For checkpoints kept where write access is wider than trust (a
shared file system, an object store). The policy, the same for resume, `kiln convert`, `kiln evaluate`
and `kiln predict`:

- a key is configured: the checkpoint must be signed, and its signature must verify with that key (an
  unsigned checkpoint is refused too, else a forger would simply drop the signature);
- no key is configured: a signed checkpoint is refused, naming the variable it was signed with, since
  reading it unverified would silently give up the protection its writer asked for.

The key is read in one place (`signing_key`), from the variable the user named in the config; it is
held in a `SigningKey`, whose repr never shows it, and never logged, printed or written."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from typing import Any

from kiln.utils.errors import ConfigError

SIGNATURE = "signature"
SCHEME = "hmac-sha256"


@dataclass(frozen=True, repr=False)
class SigningKey:
    """The checkpoint signing key and the environment variable it came from."""

    env: str
    secret: bytes

    def __repr__(self) -> str:  # the secret stays out of tracebacks and logs
        return f"SigningKey(env={self.env!r})"


def signing_key(env: str | None) -> SigningKey | None:
    """The key in the environment variable `env` (`save.signing_key_env`), or None when none is
    configured. The one place kiln reads it: the user named this variable for exactly this secret."""
    if not env:
        return None
    value = os.environ.get(env)
    if not value:
        raise ConfigError(
            f"save.signing_key_env is {env}, but that environment variable is not set (or empty): export "
            f"{env} with the checkpoint signing key, or unset save.signing_key_env."
        )
    return SigningKey(env, value.encode("utf-8"))


def _mac(meta: dict[str, Any], key: SigningKey) -> str:
    body = json.dumps({k: v for k, v in meta.items() if k != SIGNATURE}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key.secret, body.encode("utf-8"), hashlib.sha256).hexdigest()


def sign(meta: dict[str, Any], key: SigningKey) -> dict[str, str]:
    """The signature entry for the marker `meta` (everything in it but the signature itself)."""
    return {"scheme": SCHEME, "key_env": key.env, "hmac": _mac(meta, key)}


def signature_problem(meta: dict[str, Any], key: SigningKey | None) -> str | None:
    """Why the marker `meta` fails the signing policy (module docstring) with `key`, or None."""
    signature = meta.get(SIGNATURE)
    if key is None:
        if signature is None:
            return None
        env = signature.get("key_env") if isinstance(signature.get("key_env"), str) else "?"
        return (
            f"it is signed (with the key in {env}) but this run has no signing key to verify it: set "
            f"save.signing_key_env to {env} (kiln convert: --signing-key-env {env})"
        )
    if signature is None:
        return (
            f"it is not signed, and this run requires checkpoints signed with the key in {key.env} "
            "(save.signing_key_env)"
        )
    given = signature.get("hmac")
    if (
        signature.get("scheme") != SCHEME
        or not isinstance(given, str)
        or not hmac.compare_digest(given, _mac(meta, key))
    ):
        return (
            f"its signature does not verify with the key in {key.env} (the checkpoint was changed after it was "
            "signed, or signed with another key)"
        )
    return None
