"""The handler of the worker agent in the ``request-reply`` benchmark: it answers each
request with its own body, so the figures are the relay's, not a handler's."""


def echo(message):
    return message.get("body") or {}
