"""Client pieces that need no server: targets, status → exception mapping, result assembly."""

from __future__ import annotations

import json

import grpc
import pytest

from qil_client import errors, pb
from qil_client._channel import ROUND_ROBIN, channel_options, resolve_target
from qil_client.results import ResultBuilder


def test_single_target_is_used_as_is():
    assert resolve_target("127.0.0.1:50051") == ("127.0.0.1:50051", False)


def test_list_of_targets_becomes_round_robin_ipv4():
    target, rr = resolve_target(["127.0.0.1:1", "127.0.0.1:2"])
    assert target == "ipv4:127.0.0.1:1,127.0.0.1:2" and rr
    assert resolve_target("127.0.0.1:1,127.0.0.1:2") == (target, True)
    assert resolve_target(["[::1]:5", "[::1]:6"]) == ("ipv6:[::1]:5,[::1]:6", True)


def test_dns_target_uses_round_robin():
    target, rr = resolve_target("dns:///qil.example:50051")
    assert rr and target == "dns:///qil.example:50051"
    assert ("grpc.service_config", ROUND_ROBIN) in channel_options(rr, None)
    assert json.loads(ROUND_ROBIN)["loadBalancingConfig"][0] == {"round_robin": {}}


@pytest.mark.parametrize(
    "code, cls",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
        (grpc.StatusCode.ALREADY_EXISTS, errors.AlreadyExists),
        (grpc.StatusCode.NOT_FOUND, errors.NotFound),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
        (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
        (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
        (3, errors.InvalidArgument),
    ],
)
def test_status_codes_map_to_typed_errors(code, cls):
    err = errors.error_for(code, "token_ids: bad", "token_ids")
    assert type(err) is cls and isinstance(err, errors.QilError)
    assert err.field == "token_ids"


def test_result_builder_detects_gaps_and_reads_final():
    b = ResultBuilder()
    b.add(pb.Event(request_id="r", seq=0, token_ids=[1, 2]))
    with pytest.raises(RuntimeError):
        b.add(pb.Event(request_id="r", seq=3, token_ids=[4]))
    b.add(pb.Event(request_id="r", seq=2, token_ids=[3], finished=True,
                   finish_reason=pb.FINISH_REASON_STOP, num_output_tokens=3,
                   metrics=pb.RequestMetrics(ttft_s=0.5)))
    r = b.result()
    assert r.token_ids == [1, 2, 3] and r.finish_reason == "stop" and r.metrics.ttft_s == 0.5
