"""The columns a message is stored in by the SQL stores (sqlite and postgres).

One table, from which each store derives its column lists and the mapping
between one of its rows and a :class:`relay.rules.delivery.Message`. A new
stored field is one entry here, and a schema change in each store.

The mappings are compiled from the table once, at import, into plain functions
(:func:`relay.rules.message.compiled`): a row is read or written with one
attribute access per column, as a function written out by hand would.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence, Tuple

from relay.rules.message import Message, compiled


class Column(NamedTuple):
    """One stored field: its column, the Message attribute it holds, and its
    PostgreSQL type (sqlite keeps a ``boolean`` as 0 or 1)."""

    name: str
    attribute: str
    sql_type: str


# In the order of sqlite's table (columns were added at its end), which the frozen
# schemas of the upgrade tests follow. The body is stored as its JSON text.
STORED: Tuple[Column, ...] = (
    Column("id", "id", "text"),
    Column("sender", "sender", "text"),
    Column("recipient", "to", "text"),
    Column("ts", "ts", "text"),
    Column("type", "type", "text"),
    Column("body", "body_json", "text"),
    Column("reply_to", "reply_to", "text"),
    Column("ack", "ack", "boolean"),
    Column("kind", "kind", "text"),
    Column("root_id", "root_id", "text"),
    Column("parent_id", "parent_id", "text"),
    Column("status", "status", "text"),
    Column("attempts", "attempts", "integer"),
    Column("lease_until", "lease_until", "bigint"),
    Column("lease_id", "lease_id", "text"),
    Column("error", "error", "text"),
    Column("created", "created", "double precision"),
    Column("recovery", "recovery", "boolean"),
    Column("deliveries", "deliveries", "integer"),
    Column("not_before", "not_before", "double precision"),
    Column("dead_reason", "dead_reason", "text"),
    Column("delay_until", "delay_until", "double precision"),
    Column("expires_at", "expires_at", "double precision"),
    Column("via", "via", "text"),
    Column("sent_id", "sent_id", "text"),
    Column("v2", "v2", "text"),
    Column("priority", "priority", "integer"),
    Column("holder", "holder", "text"),
    Column("completed_at", "completed_at", "double precision"),
)
# The delivery state, what a save writes: the columns of Message.STATE_FIELDS, in order.
STATE: Tuple[Column, ...] = tuple(
    next(column for column in STORED if column.attribute == field)
    for field in Message.STATE_FIELDS)


def names(columns: Sequence[Column], lead: Sequence[str] = (), prefix: str = "") -> str:
    """``lead`` then the names of ``columns``, comma-separated, each after ``prefix``."""
    return ", ".join(prefix + name for name in [*lead, *(c.name for c in columns)])


def row_reader(skip: int = 0, int_booleans: bool = False) -> Callable[[Sequence[Any]], Message]:
    """The Message of a row of ``seq``, ``skip`` more columns, then :data:`STORED`;
    with ``int_booleans``, its booleans are read from 0 and 1."""
    fields = ["seq=row[0]"]
    for i, (_, attribute, kind) in enumerate(STORED, start=1 + skip):
        value = f"row[{i}]"
        fields.append(f"{attribute}=bool({value})" if int_booleans and kind == "boolean"
                      else f"{attribute}={value}")
    return compiled("message_of_row", "row", [f"return Message({', '.join(fields)})"],
                    {"Message": Message})


def row_writer(columns: Sequence[Column], lead: Sequence[str] = (), trail: Sequence[str] = (),
               int_booleans: bool = False) -> Callable[[Message], Tuple[Any, ...]]:
    """The values of ``columns`` of a message as a tuple, after the expressions ``lead``
    and before ``trail`` (of ``message``); with ``int_booleans``, booleans as 0 and 1."""
    values = list(lead)
    for _, attribute, kind in columns:
        if attribute == "body_json":
            values.append("message.body_json()")
        elif int_booleans and kind == "boolean":
            values.append(f"int(message.{attribute})")
        else:
            values.append(f"message.{attribute}")
    values.extend(trail)
    return compiled("row_of_message", "message", [f"return ({', '.join(values)},)"], {})


__all__ = ["Column", "STATE", "STORED", "names", "row_reader", "row_writer"]
