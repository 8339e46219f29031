"""The pieces every stream transport shares: listening, receiving, sending, the
handshake, socket helpers and the options."""
