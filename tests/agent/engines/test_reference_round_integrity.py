"""Round integrity on the reference engine, over real HTTP: round ids, forward-only versions, a clean abort.

The engine serves in a thread of the test process (``serve_in_thread``) and sources write its memory through an
in-process transport, as in test_reference_server.py; what is checked is the engine's answer to each call.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from refsync import new_transport, write_version

from weightsync_agent.http.client import HttpCallError
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_testing.reference_engine.model import full_state
from weightsync_testing.reference_engine.server import ENDED_ROUNDS_KEPT, EngineError, ReferenceEngine, serve_in_thread

TP = 2
BUCKET = 8192


class Rig:
    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.source = new_transport()

    def write(self, seed: int) -> dict[int, list[str]]:
        full = full_state(seed)
        out = {}
        for rank in range(TP):
            written = write_version(self.source, self.client.manifest(rank), full, BUCKET)
            assert not written.failed
            out[rank] = written.checksums
        return out

    def verify_all(self, version: str, sums: dict[int, list[str]], round_id: str | None) -> None:
        for rank, rank_sums in sums.items():
            assert self.client.verify(rank, version, BUCKET, rank_sums, round_id=round_id).ok

    def sync(self, version: str, seed: int, round_id: str) -> None:
        self.client.pause_generation(round_id=round_id)
        self.client.begin(version, round_id=round_id)
        self.verify_all(version, self.write(seed), round_id)
        self.client.commit(version, round_id=round_id)
        self.client.continue_generation(round_id=round_id)


@pytest.fixture
def rig() -> Iterator[Rig]:
    engine = ReferenceEngine(engine=0, tp=TP, seed=0, transports=[new_transport() for _ in range(TP)])
    with serve_in_thread(engine) as server:
        r = Rig(EngineClient(server.url, timeout=10))
        yield r
        r.source.close()
    engine.close()


def refused(call: object, *args: object, **kwargs: object) -> HttpCallError:
    with pytest.raises(HttpCallError) as err:
        call(*args, **kwargs)  # type: ignore[operator]
    assert err.value.status == 409, err.value
    return err.value


def test_a_late_abort_of_an_earlier_round_of_the_same_version_does_not_cancel_the_newer_one(rig: Rig) -> None:
    """The issue's bug: round A of v1 fails and its abort is still in flight when round B of v1 begins."""
    client = rig.client
    client.pause_generation(round_id="A")
    client.begin("1", round_id="A")
    client.begin("1", round_id="B")  # A's coordinator gave up (or died); B supersedes it
    sums = rig.write(seed=1)
    late = refused(client.abort, "1", round_id="A")
    assert "round id mismatch" in late.message and "B" in late.message and "A" in late.message
    assert client.status()["round"]["round_id"] == "B"  # B's round is still open
    for rank in range(TP):  # A's verify and commit are refused the same way; B's go through
        refused(client.verify, rank, "1", BUCKET, sums[rank], round_id="A")
    rig.verify_all("1", sums, "B")
    refused(client.commit, "1", round_id="A")
    arm = refused(client.request, "POST", "/weightsync/broadcast/receive", body={"version": "1", "round_id": "A"})
    assert "round id mismatch" in arm.message  # a broadcast round is armed only by its own round
    assert client.weight_version() == "default"
    client.commit("1", round_id="B")
    assert client.weight_version() == "1"


def test_a_late_continue_of_a_finished_round_does_not_unpause_the_round_now_writing(rig: Rig) -> None:
    client = rig.client
    rig.sync("1", seed=1, round_id="A")
    client.pause_generation(round_id="B")  # round B pauses, about to begin and write live weights
    err = refused(client.continue_generation, round_id="A")
    assert "round B paused it" in err.message
    assert client.status()["paused"] and client.status()["paused_by"] == "B"
    client.continue_generation(round_id="B")
    assert not client.status()["paused"]


def test_a_late_pause_or_begin_of_a_round_that_ended_is_refused(rig: Rig) -> None:
    """docs/faults.md, finding 1: a coordinator that bounds its calls by the round's deadline gives up on a slow pause
    or begin, then aborts and resumes the engine; the call it gave up on may still land. It must not leave the engine
    paused (or a round open) for nobody."""
    client = rig.client
    client.pause_generation(round_id="A")
    client.continue_generation(round_id="A")  # round A is over: a pause of A landing from now on is late
    late = refused(client.pause_generation, round_id="A")
    assert "round A already ended" in late.message and "pause" in late.message
    assert not client.status()["paused"]

    client.pause_generation(round_id="B")
    client.abort("1", round_id="B", written=False)  # B's begin is still on the way: nothing open here to close
    client.continue_generation(round_id="B")
    assert "round B already ended" in refused(client.begin, "1", round_id="B").message
    assert "round B already ended" in refused(client.pause_generation, round_id="B").message
    status = client.status()
    assert status["round"] is None and status["writable"] == [False, False]
    assert not status["paused"] and not status["live_dirty"]

    rig.sync("1", seed=1, round_id="C")  # a fresh round goes through, and one without an id is taken as before
    assert client.weight_version() == "1" and not client.status()["paused"]
    refused(client.pause_generation, round_id="C")  # committed and resumed: ended too
    client.pause_generation()
    client.continue_generation()


def test_a_late_pause_during_another_round_does_not_take_its_pause(rig: Rig) -> None:
    client = rig.client
    client.pause_generation(round_id="A")
    client.continue_generation(round_id="A")
    client.pause_generation(round_id="B")
    refused(client.pause_generation, round_id="A")
    assert client.status()["paused_by"] == "B"
    client.begin("1", round_id="B")
    rig.verify_all("1", rig.write(seed=1), "B")
    client.commit("1", round_id="B")
    client.continue_generation(round_id="B")  # B still holds the pause: its own continue ends it
    assert not client.status()["paused"]


def test_the_semantic_gate_may_pause_its_round_again_after_resuming_it(rig: Rig) -> None:
    """The gate resumes mid-round to score its canary and, when the gate fails, pauses again and aborts: that resume
    does not end the round. A gate's pause landing after its abort still pauses: the applied weights must not serve."""
    client = rig.client
    for round_id, pause_first in (("G1", True), ("G2", False)):
        client.pause_generation(round_id=round_id)
        client.begin("1", round_id=round_id)
        rig.verify_all("1", rig.write(seed=1), round_id)
        client.apply("1", round_id=round_id)
        client.continue_generation(round_id=round_id)  # the canary is scored; it fails
        if pause_first:
            client.pause_generation(round_id=round_id)
            client.abort("1", round_id=round_id)
        else:
            client.abort("1", round_id=round_id)
            assert client.status()["live_dirty"] and not client.status()["paused"]
            client.pause_generation(round_id=round_id)  # late
        assert client.status()["paused"] and client.status()["live_dirty"]
        assert client.weight_version() == "default"


def test_ended_round_ids_are_remembered_up_to_a_bound() -> None:
    engine = ReferenceEngine(engine=0, tp=1, seed=0, transports=[new_transport()])
    try:
        for index in range(ENDED_ROUNDS_KEPT + 1):
            engine.pause("abort", f"r{index}")
            engine.resume(f"r{index}")
        assert len(engine.ended_rounds) == ENDED_ROUNDS_KEPT
        with pytest.raises(EngineError) as err:
            engine.pause("abort", f"r{ENDED_ROUNDS_KEPT}")
        assert err.value.status == 409 and not engine.paused
        engine.pause("abort", "r0")  # forgotten: the oldest id is taken as a new one
        assert engine.paused and engine.paused_by == "r0"
    finally:
        engine.close()


def test_verified_ranks_refuse_writes_until_their_round_begins_again(rig: Rig) -> None:
    """A rank's verify closes its memory to writes (test_reference_verify_window.py), so a retry that has the sources
    write every rank again needs the round begun again first (same id): that opens every rank and forgets what was
    verified, so the commit needs every rank checked again."""
    client = rig.client
    client.pause_generation(round_id="R")
    client.begin("1", round_id="R")
    sums = rig.write(seed=1)
    rig.verify_all("1", sums, "R")
    assert client.status()["writable"] == [False, False]
    written = write_version(rig.source, client.manifest(0), full_state(1), BUCKET)
    assert written.failed, "a verified rank took a write"
    assert client.begin("1", round_id="R")["resumed"]
    assert client.status()["writable"] == [True, True] and client.status()["round"]["verified"] == {}
    rig.verify_all("1", rig.write(seed=1), "R")
    client.commit("1", round_id="R")
    client.continue_generation(round_id="R")
    assert client.weight_version() == "1" and not client.status()["paused"]


def test_versions_only_move_forward(rig: Rig) -> None:
    client = rig.client
    rig.sync("5", seed=5, round_id="r5")
    client.pause_generation(round_id="r4")
    assert "already holds version 5" in refused(client.begin, "5", round_id="r4").message
    assert "not newer than the version this engine holds (5)" in refused(client.begin, "4", round_id="r4").message
    assert client.weight_version() == "5" and client.status()["round"] is None
    # SGLang's relabel route is a commit on this engine: refused the same way.
    with pytest.raises(HttpCallError) as err:
        client.update_weight_version("3")
    assert err.value.status == 400 and client.weight_version() == "5"
    # The trainer's next legitimate version is not blocked by the refusals.
    client.continue_generation(round_id="r4")
    rig.sync("6", seed=6, round_id="r6")
    assert client.weight_version() == "6"


def test_the_held_version_may_be_rewritten_only_to_repair_dirty_live_weights(rig: Rig) -> None:
    """A live round of v3 fails after writing: the engine is paused and dirty at v2; a catch-up to v2 (the
    committed version) may repair it, and the engine then serves again."""
    client = rig.client
    rig.sync("2", seed=2, round_id="r2")
    client.pause_generation(round_id="r3")
    client.begin("3", round_id="r3")
    rig.write(seed=3)
    client.abort("3", round_id="r3")  # written: the live weights stay dirty
    assert client.status()["live_dirty"]
    refused(client.continue_generation, round_id="r3")
    client.pause_generation(round_id="c2")
    client.begin("2", round_id="c2")
    rig.verify_all("2", rig.write(seed=2), "c2")
    client.commit("2", round_id="c2")
    client.continue_generation(round_id="c2")
    assert client.weight_version() == "2" and not client.status()["live_dirty"]


def test_an_abort_with_nothing_written_lets_the_engine_serve_again(rig: Rig) -> None:
    """A round that failed before any source was asked to write (another engine refused its begin) resumes."""
    client = rig.client
    rig.sync("1", seed=1, round_id="r1")
    client.pause_generation(round_id="r2")
    client.begin("2", round_id="r2")
    assert client.status()["live_dirty"]
    client.abort("2", round_id="r2", written=False)
    assert not client.status()["live_dirty"]
    client.continue_generation(round_id="r2")
    assert not client.status()["paused"] and client.weight_version() == "1"


def test_an_abort_with_nothing_written_does_not_serve_bytes_a_foreign_peer_wrote_in_the_window(rig: Rig) -> None:
    """The review's hole: the coordinator aborts with ``written: false`` (no source was asked to write), but the live
    memory took writes from the begin: a peer that reached the transport wrote there. The engine re-verifies its
    live memory against what served before: it stays dirty and paused, says which ranks drifted, and serves again only
    after a round lands. Both over the engine's own load and over a committed version (then repaired by a catch-up of
    that version)."""
    client = rig.client

    def foreign_write_then_abort(version: str, held: str) -> None:
        client.pause_generation(round_id=f"r{version}")
        client.begin(version, round_id=f"r{version}")
        rig.write(seed=99)  # not asked by the coordinator: a foreign write while the window is open
        _, answer = client.request("POST", "/weightsync/abort",
                                   body={"version": version, "round_id": f"r{version}", "written": False})  # fmt: skip
        assert answer["drifted_ranks"] == [0, 1] and answer["live_dirty"], answer
        assert "commit a verified version" in refused(client.continue_generation, round_id=f"r{version}").message
        assert client.weight_version() == held and client.status()["paused"]

    foreign_write_then_abort("1", held="default")
    rig.sync("1", seed=1, round_id="s1")
    foreign_write_then_abort("2", held="1")
    rig.sync("1", seed=1, round_id="c1")  # the committed version again, to repair
    assert not client.status()["live_dirty"] and not client.status()["paused"]


def test_round_ids_are_validated(rig: Rig) -> None:
    client = rig.client
    client.pause_generation()
    for bad in (7, "", "x" * 65):
        with pytest.raises(HttpCallError) as err:
            client.request("POST", "/weightsync/begin", body={"version": "1", "round_id": bad})
        assert err.value.status == 400 and "round_id" in err.value.message
    with pytest.raises(HttpCallError) as err:
        client.request("POST", "/weightsync/abort", body={"written": "no"})
    assert err.value.status == 400
