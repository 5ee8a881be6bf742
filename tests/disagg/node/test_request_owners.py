"""`RequestOwners`: a request id belongs to the connection that claimed it until released
(X5d); the running decoder's behaviour is in `test_request_scope.py`."""

from __future__ import annotations

from typing import cast

from disagg.control.channel import Channel
from disagg.node.request_owners import Claim, RequestOwners

A, B = cast(Channel, object()), cast(Channel, object())


def test_the_first_claim_owns_the_id_and_others_are_told_whose_it_is() -> None:
    owners = RequestOwners()
    assert owners.claim("r", A) is Claim.NEW
    assert owners.claim("r", A) is Claim.SAME_CONNECTION
    assert owners.claim("r", B) is Claim.OTHER_CONNECTION
    assert owners.owner("r") is A and owners.owns(A, "r") and not owners.owns(B, "r")


def test_a_connection_lists_only_its_own_requests_in_order() -> None:
    owners = RequestOwners()
    for request_id, channel in [("a1", A), ("b1", B), ("a2", A)]:
        owners.claim(request_id, channel)
    assert owners.owned_by(A) == ["a1", "a2"] and owners.owned_by(B) == ["b1"]


def test_a_released_id_is_free_for_any_connection() -> None:
    owners = RequestOwners()
    owners.claim("r", A)
    owners.release("r")
    assert "r" not in owners and owners.owner("r") is None
    assert owners.claim("r", B) is Claim.NEW
