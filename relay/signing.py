"""``relay.signing``, the documented import path of the §3 request signature: it is
:mod:`relay.wire.signing`."""

from relay.wire.signing import auth_headers, new_nonce, sign, signing_string, verify

__all__ = ["auth_headers", "new_nonce", "sign", "signing_string", "verify"]
