"""Lockout counters and signed nonces shared by every broker on the database."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from relay.rules.auth import AGENT_LOCK_ADDRESSES, EVERY_ADDRESS
from relay.store.postgres.records import PostgresRecords
from relay.store.postgres.statements import STATEMENTS

log = Logger(namespace="relay.store.postgres")

LOCKOUT_FORGET_SECONDS = 86400.0
LOCKOUT_SWEEP_SECONDS = 60.0


def lockout_failed(records: PostgresRecords, agent: str, address: str, now: float, after: int,
                   seconds: float) -> Optional[Tuple[str, float]]:
    """Count a failure of ``agent`` from ``address`` for every broker, by the rules of
    :class:`relay.rules.auth.Lockout`; the lock it caused (its address, or ``*`` for the
    agent's own, and its end), or None."""
    cursor = records.cursor
    cursor.execute(STATEMENTS["lockout_spread"],
                   {"agent": agent, "now": now, "period": now - seconds})
    count, started = cursor.fetchone()
    cursor.execute(STATEMENTS["lockout_failed"], {"agent": agent, "address": address, "now": now})
    (failures,) = cursor.fetchone()
    cursor.execute(STATEMENTS["lockout_addresses"], (agent, started))
    (addresses,) = cursor.fetchone()
    if count >= after and addresses >= AGENT_LOCK_ADDRESSES:
        address = EVERY_ADDRESS
    elif failures < after:
        records.notice["fail"] = [agent, address]
        return None
    until = now + seconds
    cursor.execute(STATEMENTS["lockout_lock"], (until, now, agent, address))
    records.notice["lock"] = [agent, until, address]
    return address, until


def lockout_impose(records: PostgresRecords, agent: str, address: str, until: float,
                   now: float) -> None:
    """Lock ``agent`` from ``address`` (``*``: every address) until ``until`` on every
    broker."""
    records.cursor.execute(STATEMENTS["lockout_impose"], (agent, address, until, now))
    records.notice["lock"] = [agent, until, address]


def lockout_succeeded(records: PostgresRecords, agent: str, address: str, now: float) -> None:
    records.cursor.execute(STATEMENTS["lockout_reset"], (now, agent, address))
    records.notice["reset"] = [agent, address]


def lockout_unlock(records: PostgresRecords, agent: str) -> None:
    """An operator cleared ``agent``'s locks and counts, for every broker."""
    records.cursor.execute(STATEMENTS["lockout_unlock"], (agent,))
    records.notice["unlock"] = agent


def lockout_load(records: PostgresRecords) -> List[Tuple[str, str, int, Optional[float]]]:
    records.cursor.execute(STATEMENTS["lockout_load"])
    return [tuple(row) for row in records.cursor.fetchall()]


def lockout_forget(records: PostgresRecords, now: float) -> int:
    records.cursor.execute(STATEMENTS["lockout_forget"], (now - LOCKOUT_FORGET_SECONDS, now))
    return records.cursor.rowcount


# -- shared nonces -----------------------------------------------------------------------


def nonce_claim(records: PostgresRecords, agent: str, nonce: str, expires: int,
                now: int) -> bool:
    """Claim ``nonce`` of ``agent`` until ``expires``; True when it was not in use at
    ``now`` (epoch seconds)."""
    records.cursor.execute(STATEMENTS["nonce_claim"], (agent, nonce, expires, now))
    return records.cursor.fetchone() is not None


def nonce_claim_locked(records: PostgresRecords, agent: str, nonce: str, expires: int,
                       now: int, address: str) -> Tuple[bool, Optional[str], Optional[float]]:
    """:func:`nonce_claim`, and the lock of ``agent`` in force at ``now`` for
    ``address`` or every address: ``(first, its address or "*", its end)``, Nones
    for no lock."""
    records.cursor.execute(STATEMENTS["nonce_claim_locked"], {
        "agent": agent, "nonce": nonce, "expires": expires, "now": now, "address": address})
    count, scope, until = records.cursor.fetchone()
    return count > 0, scope, until


def nonce_forget(records: PostgresRecords, now: int) -> int:
    """Delete the nonces whose window ended before ``now``; returns how many."""
    records.cursor.execute(STATEMENTS["nonce_forget"], (now,))
    return records.cursor.rowcount


class PostgresLockouts:
    """Lockout counters shared by every broker on the database.

    The authentication path reads the broker's own :class:`relay.rules.auth.Lockout`,
    at once. Each failure is also counted in ``relay_lockouts`` (one transaction,
    by the same rules), and the refusal is answered only once that is done
    (:attr:`relay.wire.errors.RelayError.pending`): the broker whose count reaches a
    lock sets it there, applies it to its own ``Lockout`` before answering, and
    notifies the others, which apply it to theirs when PostgreSQL delivers the
    notification (sent at the commit, before the refusal is answered). N brokers
    give an attacker the attempts of one. A success resets the shared count of
    its address when some broker counted failures there; a broker whose own
    count locks an agent (the shared one was reset meanwhile) sets that lock for
    every broker too. An operator's unlock clears the agent everywhere.
    """

    def __init__(self, run: Callable[..., Deferred], clock: IReactorTime, lockout: Any) -> None:
        """``run(operation, *args)`` runs ``operation(records, *args)`` in one
        transaction of the store and answers with its result; ``clock`` is the store's."""
        self.run = run
        self.clock = clock
        self.lockout = lockout
        # (agent, address) with failures counted on some broker
        self.failing: Dict[Tuple[str, str], None] = {}
        self.sweep = LoopingCall(self._forget)
        self.sweep.clock = clock

    def start(self) -> None:
        d = self.run(lockout_load)
        d.addCallbacks(self._loaded, self._warn)
        self.sweep.start(LOCKOUT_SWEEP_SECONDS, now=False)

    def stop(self) -> None:
        if self.sweep.running:
            self.sweep.stop()

    def _loaded(self, rows: List[Tuple[str, str, int, Optional[float]]]) -> None:
        now = self.clock.seconds()
        for agent, address, failures, until in rows:
            if until is not None and until > now:
                self.lockout.lock(agent, until, address)
            if failures and address != EVERY_ADDRESS:
                self._note(agent, address)

    def _note(self, agent: str, address: str) -> None:
        self.failing[(agent, address)] = None
        if len(self.failing) > self.lockout.max_tracked:
            del self.failing[next(iter(self.failing))]

    def _warn(self, failure) -> None:
        log.warn("postgres: shared lockout counters not updated ({kind})",
                 kind=failure.type.__name__)

    # -- what relay.rules.auth.Lockout reports ---------------------------------------------------

    def failed(self, agent: str, address: str) -> Deferred:
        self._note(agent, address)
        now = self.clock.seconds()
        d = self.run(lockout_failed, agent, address, now, self.lockout.after,
                            self.lockout.seconds)

        def counted(locked: Optional[Tuple[str, float]]) -> Optional[Deferred]:
            if locked is not None:
                scope, until = locked
                self.failing.pop((agent, address), None)
                if self.lockout.lock(agent, until, scope) is not None:
                    log.warn("agent {agent} is locked {scope} after repeated authentication "
                             "failures (counted on every broker)", agent=agent,
                             scope="from every address" if scope == EVERY_ADDRESS
                             else f"for address {scope}")
                return None
            # Locked here on this broker's own count while the shared one was reset
            # meanwhile (a success on another broker between the failures): the
            # lock holds on every broker all the same.
            left, scope = self.lockout.seconds_left(agent, address)
            if left > 0:
                self.failing.pop((agent, address), None)
                ends = self.clock.seconds() + left
                return self.run(lockout_impose, agent, scope, ends, now)
            return None

        d.addCallback(counted)
        d.addErrback(self._warn)
        return d

    def succeeded(self, agent: str, address: str) -> None:
        if (agent, address) not in self.failing:
            return
        del self.failing[(agent, address)]
        d = self.run(lockout_succeeded, agent, address, self.clock.seconds())
        d.addErrback(self._warn)

    def unlocked(self, agent: str) -> Deferred:
        for key in [key for key in self.failing if key[0] == agent]:
            del self.failing[key]
        return self.run(lockout_unlock, agent)

    # -- what other brokers report ---------------------------------------------------------

    def heard(self, notice: Mapping[str, Any]) -> None:
        lock = notice.get("lock")
        if (isinstance(lock, list) and len(lock) == 3 and isinstance(lock[0], str)
                and isinstance(lock[1], (int, float)) and isinstance(lock[2], str)):
            self.failing.pop((lock[0], lock[2]), None)
            self.lockout.lock(lock[0], float(lock[1]), lock[2])
        failed = _pair(notice.get("fail"))
        if failed is not None:
            self._note(*failed)
        reset = _pair(notice.get("reset"))
        if reset is not None:
            self.failing.pop(reset, None)
            self.lockout.clear(*reset)
        unlocked = notice.get("unlock")
        if isinstance(unlocked, str):
            for key in [key for key in self.failing if key[0] == unlocked]:
                del self.failing[key]
            self.lockout.forget(unlocked)

    def _forget(self) -> Deferred:
        d = self.run(lockout_forget, self.clock.seconds())
        d.addErrback(self._warn)
        return d


def _pair(value: Any) -> Optional[Tuple[str, str]]:
    """``(agent, address)`` of a notification, or None for anything else."""
    if (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
            and isinstance(value[1], str)):
        return value[0], value[1]
    return None
