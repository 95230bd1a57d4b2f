"""Hypothesis strategies for any protobuf message, read from its descriptor: every field present or absent, with
values over the field type's whole range (hypothesis favours the edges: 0, -1, the extremes), NaN and infinities for
floats, enum numbers this version does not know, strings and bytes of any content, repeated fields of any length
(empty included), nested messages and maps; and raw bytes, which are usually no valid message at all."""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

F = FieldDescriptor
_INTS = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1), F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}
MAX_REPEATED = 12
MAX_DEPTH = 3


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    if field.type in _INTS:
        lo, hi = _INTS[field.type]
        return st.integers(lo, hi)
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if field.type == F.TYPE_FLOAT:
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if field.type == F.TYPE_STRING:
        return st.text(max_size=24)
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=24)
    if field.type == F.TYPE_ENUM:  # proto3 enums are open: numbers nobody defined arrive as they are
        return st.integers(-3, max(v.number for v in field.enum_type.values) + 3)
    raise AssertionError(f"no strategy for {field.full_name}")


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _field_values(field: FieldDescriptor, depth: int, overrides: dict) -> st.SearchStrategy:
    if field.name in overrides:  # the whole field's value (a list, for a repeated field)
        return overrides[field.name]
    if _is_map(field):
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return st.dictionaries(_scalar(key), _scalar(value), max_size=4)
    one = fields(field.message_type, depth + 1, overrides) if field.type == F.TYPE_MESSAGE else _scalar(field)
    if field.is_repeated:
        return st.lists(one, max_size=MAX_REPEATED)
    return one


def fields(descriptor: Descriptor, depth: int = 0, overrides: dict | None = None) -> st.SearchStrategy[dict]:
    """A dict of field name -> value for `descriptor` (nested messages as dicts); `overrides`: field name ->
    strategy, for fields whose interesting values are few (an address the fuzz should sometimes hit)."""
    overrides = overrides or {}
    if depth >= MAX_DEPTH:
        return st.just({})
    return st.fixed_dictionaries({}, optional={f.name: _field_values(f, depth, overrides)
                                               for f in descriptor.fields})


def fill(msg, values: dict):
    """Set `values` (from `fields`) on the message `msg`; returns it."""
    for name, value in values.items():
        field = msg.DESCRIPTOR.fields_by_name[name]
        if _is_map(field):
            getattr(msg, name).update(value)
        elif field.type == F.TYPE_MESSAGE and field.is_repeated:
            for item in value:
                fill(getattr(msg, name).add(), item)
        elif field.type == F.TYPE_MESSAGE:
            fill(getattr(msg, name), value)
            getattr(msg, name).SetInParent()  # present even when empty
        elif field.is_repeated:
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    return msg


def requests(message_class, overrides: dict | None = None) -> st.SearchStrategy[bytes]:
    """Serialized requests for an RPC taking `message_class`: generated messages, mostly; raw bytes sometimes."""
    messages = fields(message_class.DESCRIPTOR, overrides=overrides).map(
        lambda values: fill(message_class(), values).SerializeToString())
    return st.one_of(messages, messages, messages, st.binary(max_size=64))
