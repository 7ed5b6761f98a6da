"""Deprecated: ``relay.signing`` moved to :mod:`relay.wire.signing`.

The old path is kept for one release and warns when imported."""

import warnings

from relay.wire.signing import auth_headers, new_nonce, sign, signing_string, verify

__all__ = ["auth_headers", "new_nonce", "sign", "signing_string", "verify"]

warnings.warn("relay.signing moved to relay.wire.signing: import it from there "
              "(the old path goes in the next release)", DeprecationWarning, stacklevel=2)
