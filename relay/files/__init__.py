"""Files on this machine, for the broker and the clients alike: private files
replaced atomically (:mod:`relay.files.private`), PEM certificates and keys
(:mod:`relay.files.pem`), and the pid file of the twistd plugins
(:mod:`relay.files.pidfile`).
"""
