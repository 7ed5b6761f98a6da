"""The pid file ``twistd`` writes for the ``relay`` and ``relay-agent`` plugins.

twistd's default, ``twistd.pid`` in the working directory, is shared by every
twistd program: an agent started beside ``make run`` stopped at once with
"Another twistd server is running". Each plugin chooses its own instead.
"""

from __future__ import annotations

from twisted.python import usage

TWISTD_DEFAULT_PIDFILE = "twistd.pid"


def choose_pidfile(options: usage.Options, detached_name: str) -> None:
    """Replace twistd's shared default pid file with this program's own.

    In the foreground (``twistd -n``) none is written: the process is watched
    by a person or a supervisor, and a second copy would fail on its port
    (the broker) or is allowed (agents share work through leases). Detached,
    the pid file is ``detached_name`` in the working directory. A
    ``--pidfile`` given on the command line is kept, except
    ``--pidfile twistd.pid``, which cannot be told from the default.

    :param options: the plugin's options; twistd's own are its ``parent``.
    """
    parent = getattr(options, "parent", None)
    if parent is None or parent.get("pidfile") != TWISTD_DEFAULT_PIDFILE:
        return
    parent["pidfile"] = "" if parent.get("nodaemon") else detached_name
