"""Every gRPC method of the daemon, fed what an attacker on the node can send: arbitrary bytes and
arbitrary messages of the method's own type (every field, any value), with no token, a job's token
or a forged one. Each call must end in a status with a message; the daemon stays healthy and the
honest job keeps its exact sums."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zend.api.zen.v1 import zen_pb2 as pb
from zend.protocol import paths
from zend.protocol.descriptors import is_repeated

pytestmark = pytest.mark.daemon

F = FieldDescriptor
_INT_RANGES = {F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1),
               F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), F.TYPE_INT64: (-(2**63), 2**63 - 1),
               F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
               F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1), F.TYPE_UINT64: (0, 2**64 - 1),
               F.TYPE_FIXED64: (0, 2**64 - 1)}
METHODS = [(service.name, method) for service in pb.DESCRIPTOR.services_by_name.values()
           for method in service.methods]
# gRPC's own answers to bytes that are not the request type (the threaded server's, grpc.aio's):
# its words, before any handler of ours runs
UNPARSEABLE = ("Exception deserializing request!", "Unexpected <class 'google.protobuf.message.DecodeError'>")


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[object]:
    if field.type in _INT_RANGES:
        lo, hi = _INT_RANGES[field.type]
        return st.one_of(st.integers(lo, hi), st.sampled_from(sorted({lo, hi, 0, 1, max(lo, -1), 2**31 - 1})))
    if field.type == F.TYPE_STRING:
        return st.one_of(st.text(max_size=200), st.sampled_from(["", "\x00", "a\nb", "x" * 5000, "honest", "../.."]))
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=200)
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.floats(width=32 if field.type == F.TYPE_FLOAT else 64)
    if field.type == F.TYPE_ENUM:
        return st.integers(-3, 40)  # proto3 enums are open: unknown numbers arrive too
    assert field.type == F.TYPE_MESSAGE
    return _message(field.message_type, depth + 1)


def _message(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[object]:
    cls = message_factory.GetMessageClass(descriptor)
    if depth > 2:
        return st.just(cls())
    fields: dict[str, st.SearchStrategy[object]] = {}
    for field in descriptor.fields:
        one = _value(field, depth)
        fields[field.name] = st.lists(one, max_size=10) if is_repeated(field) else one

    def build(values: dict[str, object]) -> object:
        m = cls()
        for name, value in values.items():
            field = descriptor.fields_by_name[name]
            if is_repeated(field):
                target = getattr(m, name)
                for v in value:  # type: ignore[attr-defined]
                    target.add().CopyFrom(v) if field.type == F.TYPE_MESSAGE else target.append(v)
            elif field.type == F.TYPE_MESSAGE:
                getattr(m, name).CopyFrom(value)
            else:
                setattr(m, name, value)
        return m

    return st.fixed_dictionaries({}, optional=fields).map(build)


def _request(method: object) -> st.SearchStrategy[bytes]:
    typed = _message(method.input_type).map(lambda m: m.SerializeToString())  # type: ignore[attr-defined]
    return st.one_of(typed, st.binary(max_size=512))


def _classify(call: grpc.UnaryUnaryMultiCallable, body: bytes, metadata: list[tuple[str, str]]) -> str:
    try:
        call(body, timeout=10, metadata=metadata)
        return "clear"  # answered (Status without a token, an empty request the method accepts)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "hang"
        if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and not details.startswith(UNPARSEABLE):
            return "crash"
        return "clear" if details else "crash"


@pytest.mark.parametrize(("service", "method"), METHODS, ids=[f"{s}.{m.name}" for s, m in METHODS])
def test_every_grpc_method_refuses_what_an_attacker_sends(target, tally, service, method):
    address = paths.grpc_address(target.cluster.socket_dir(0))
    surface = "gRPC (unix socket)"
    tokens = st.sampled_from([[], [("authorization", "Bearer " + target.cluster.token("fuzz"))],
                              [("authorization", "Bearer forged")], [("authorization", "x" * 3000)]])
    outcomes: list[str] = []
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(f"/zen.v1.{service}/{method.name}", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)

        @settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow], deadline=None)
        @given(body=_request(method), metadata=tokens)
        def attack(body: bytes, metadata: list[tuple[str, str]]) -> None:
            outcome = _classify(call, body, metadata)
            outcomes.append(outcome)
            tally.count(surface, outcome)
            assert outcome == "clear", (method.name, body[:80], metadata)

        attack()
    assert outcomes and target.alive()
    assert target.healthy()
    target.honest_step(tally, surface)
