"""A handler for the agent runtime: `twistd -n relay-agent --handler myhandlers:answer`.

The runtime leases each request sent to its agent, calls the handler with
the envelope, and sends what it returns as the reply: a dict is the reply
body, a string becomes {"text": ...}. Raising hands the request back for a
retry, with the exception's message as the error `relay status` shows.
Copy this file into the directory you start the agent from: handlers are
imported from the working directory first.
"""


def answer(message):
    text = message["body"].get("text", "")
    if not text:
        raise ValueError("the request has no text")
    return f"you said: {text}"
