"""hermes_service/runner/processes.py ``ProcessGroups.kill_home``: a node that lost a user's lease
kills that user's process groups (CLI turns and warm ACP processes alike), no other user's."""
from __future__ import annotations

from hermes_service.runner.processes import ProcessGroups


class Member:
    """A stand-in group at the public seam (``pgid``, ``kill(reason)``)."""

    def __init__(self, pgid: int):
        self.pgid, self.killed = pgid, None

    def kill(self, reason: str) -> None:
        self.killed = reason


def test_only_the_users_groups_are_killed():
    groups = ProcessGroups(None)
    alice_cli, alice_acp, bob = Member(1), Member(2), Member(3)
    groups.add(alice_cli, "/h/alice/.hermes")
    groups.add(alice_acp, "/h/alice/.hermes")
    groups.add(bob, "/h/bob/.hermes")
    assert groups.kill_home("/h/alice/.hermes", "lease lost") == 2
    assert alice_cli.killed == alice_acp.killed == "lease lost" and bob.killed is None
    groups.forget(alice_cli)
    groups.forget(alice_acp)
    assert groups.kill_home("/h/alice/.hermes", "again") == 0
