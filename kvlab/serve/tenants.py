"""API keys -> tenants -> cache salts: who may choose a `cache_salt`, for `kvlab serve`.

A salt isolates tenants in the prefix cache only while the attacker cannot send the victim's
salt. So in key mode the server, not the client, picks it: each API key names a tenant, and a
tenant's salt is HMAC-SHA256(server secret, tenant) as 64 hex digits (256 bits, the length
vLLM's API docs ask a salt to have). Two keys of one tenant share its cache; nothing else does.

The key map, one format for `--api-keys-file` and `KVLAB_API_KEYS` (`parse_api_keys`):

* a JSON object, `{"<key>": "<tenant>", ...}` (the documented form for the file), or
* `key=tenant` pairs separated by commas or newlines, e.g. `key1=tenant-a,key2=tenant-b`
  (split at the last `=`, so base64 padding in a key survives; `#` starts a comment line).

A key is printable ASCII without spaces (it travels in an HTTP header); a tenant is any non-empty
name. No error message here, or anywhere in the server, quotes a key: only entry numbers.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets

MIN_SECRET_BYTES = 32  # the salts are only as unguessable as the secret they come from


def parse_api_keys(text: str) -> dict[str, str]:
    """`{key: tenant}` from a JSON object or `key=tenant` pairs; ValueError (never quoting a key)
    on anything else, on a duplicate key, or on an empty map."""
    if text.lstrip().startswith(("{", "[")):  # JSON (an array is refused just below)
        pairs = _json_pairs(text)
    else:
        pairs = []
        for line in text.splitlines():
            if line.strip().startswith("#"):
                continue
            for entry in line.split(","):
                if not entry.strip():
                    continue
                key, sep, tenant = entry.strip().rpartition("=")
                if not sep:
                    raise ValueError(f"API key entry {len(pairs) + 1} is not key=tenant")
                pairs.append((key.strip(), tenant.strip()))
    keys: dict[str, str] = {}
    for n, (key, tenant) in enumerate(pairs, 1):
        if not isinstance(key, str) or not key or not _is_token(key):
            raise ValueError(f"API key entry {n}: a key must be printable ASCII without spaces")
        if not isinstance(tenant, str) or not tenant.strip():
            raise ValueError(f"API key entry {n}: the tenant must be a non-empty string")
        if key in keys:
            raise ValueError(f"API key entry {n} repeats an earlier key")
        keys[key] = tenant
    if not keys:
        raise ValueError("the API key map is empty")
    return keys


def _json_pairs(text: str) -> list[tuple]:
    try:
        # object_pairs_hook keeps duplicate keys (a dict would silently keep the last one)
        pairs = json.loads(text, object_pairs_hook=_Pairs)
    except json.JSONDecodeError as e:
        # e.msg and the position only: str(e) is safe too, but the document is never quoted
        raise ValueError(f"the API key map is not valid JSON ({e.msg} at line {e.lineno})") \
            from None
    if not isinstance(pairs, _Pairs):
        raise ValueError("the API key map must be a JSON object {key: tenant}")
    return pairs


class _Pairs(list):
    """A JSON object's (key, value) pairs, in order, duplicates kept."""


def _is_token(key: str) -> bool:
    return all(33 <= ord(c) <= 126 for c in key)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "replace")).digest()


def tenant_salt(secret: bytes, tenant: str) -> str:
    """The tenant's cache salt: HMAC-SHA256(secret, tenant), 64 hex digits. Without the secret,
    knowing (or guessing) the tenant name gives nothing; with it, salts are reproducible."""
    return hmac.new(secret, tenant.encode("utf-8"), hashlib.sha256).hexdigest()


class TenantKeys:
    """Checks `Authorization: Bearer <key>` and hands out each tenant's salt.

    Holds only SHA-256 digests of the keys (as vLLM's auth middleware does), so neither this
    object nor its repr nor a traceback through it can show a key.
    """

    def __init__(self, api_keys: dict[str, str], salt_secret: bytes | None = None) -> None:
        if not isinstance(api_keys, dict):
            raise TypeError("api_keys must be a dict {key: tenant}")
        # The same checks as a parsed file; the map is rebuilt as key=tenant pairs (in memory).
        for n, (key, tenant) in enumerate(api_keys.items(), 1):
            if not isinstance(key, str) or not key or not _is_token(key):
                raise ValueError(f"api_keys entry {n}: a key must be printable ASCII "
                                 "without spaces")
            if not isinstance(tenant, str) or not tenant.strip():
                raise ValueError(f"api_keys entry {n}: the tenant must be a non-empty string")
        if not api_keys:
            raise ValueError("api_keys is empty: every request would be refused")
        if salt_secret is None:
            # No secret given: a fresh random one per process. The salts then change on every
            # restart, so no prefix cached before a restart is ever reused after it, and two
            # replicas never share. kvlab's cache lives in process memory and dies with it, so
            # here that costs nothing; a fixed secret (--salt-secret-file) matters where KV
            # outlives the process or is shared between replicas (an offloaded KV store).
            # vLLM makes the same trade for its first-block hash seed when the hash is not
            # cryptographic (a random per-process seed unless PYTHONHASHSEED fixes it).
            salt_secret = secrets.token_bytes(MIN_SECRET_BYTES)
            self.secret_source = "random"
        else:
            self.secret_source = "given"
        if not isinstance(salt_secret, bytes) or len(salt_secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the salt secret must be at least {MIN_SECRET_BYTES} bytes, e.g. "
                             "python -c 'import secrets; print(secrets.token_hex(32))'")
        self._secret = salt_secret
        self._tenants = [(_digest(k), t) for k, t in api_keys.items()]
        self._salts = {t: tenant_salt(salt_secret, t) for t in set(api_keys.values())}

    @property
    def num_keys(self) -> int:
        return len(self._tenants)

    @property
    def num_tenants(self) -> int:
        return len(self._salts)

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant of a valid `Bearer <key>` header value, else None."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = _digest(token.strip())
        found = None
        for known, tenant in self._tenants:  # every entry compared: the time says nothing
            if secrets.compare_digest(digest, known):
                found = tenant
        return found

    def salt_for(self, tenant: str) -> str:
        return self._salts[tenant]

    def __repr__(self) -> str:
        return f"TenantKeys({self.num_keys} keys, {self.num_tenants} tenants)"
