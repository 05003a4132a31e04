"""The reference engine's HTTP API and its version invariant, served in-process over real HTTP.

The server runs in a thread of the test process (``BackgroundServer``) so sources can reach its memory
with an in-process transport; the subprocess / Mooncake path is in test_reference_server_process.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from refsync import new_transport, write_version

from weightsync_agent.http.client import HttpCallError
from weightsync_agent.targets.engine_client import EngineClient
from weightsync_testing.reference_engine.model import forward_full, forward_tp, full_state, shard
from weightsync_testing.reference_engine.server import ReferenceEngine, serve_in_thread

TP = 2
BUCKET = 8192
TOKENS = [5, 9, 1, 33, 70, 2]


class Harness:
    def __init__(self, engine: ReferenceEngine, client: EngineClient) -> None:
        self.engine = engine
        self.client = client
        self.source = new_transport()

    def write(
        self, version: str, seed: int, rank: int | None = None, corrupt_bucket: int | None = None
    ) -> dict[int, list[str]]:
        """Write full_state(seed) into the given rank (default all) and return each rank's checksums."""
        full = full_state(seed)
        out = {}
        for r in range(TP) if rank is None else [rank]:
            written = write_version(self.source, self.client.manifest(r), full, BUCKET, corrupt_bucket=corrupt_bucket)
            assert not written.failed
            out[r] = written.checksums
        return out

    def sync(self, version: str, seed: int) -> None:
        """One full round: begin, write, verify every rank, commit."""
        self.client.begin(version)
        for r, sums in self.write(version, seed).items():
            assert self.client.verify(r, version, BUCKET, sums).ok
        self.client.commit(version)


@pytest.fixture
def harness() -> Iterator[Harness]:
    engine = ReferenceEngine(engine=1, tp=TP, seed=0, transports=[new_transport() for _ in range(TP)])
    with serve_in_thread(engine) as server:
        h = Harness(engine, EngineClient(server.url, timeout=10))
        yield h
        h.source.close()
    engine.close()


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to float summation order (another thread count or process may sum differently)."""
    return torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def logits(client: EngineClient) -> torch.Tensor:
    return torch.tensor(client.forward(TOKENS))


def expected_logits(seed: int) -> torch.Tensor:
    full = full_state(seed)
    return forward_tp([shard(full, TP, r) for r in range(TP)], TOKENS)


def test_transfer_engine_info_has_sglangs_shape(harness: Harness) -> None:
    client = harness.client
    sessions = set()
    for rank in range(TP):
        raw = client.request("GET", "/remote_instance_transfer_engine_info", query={"rank": rank})[1]
        assert set(raw) == {"rank", "remote_instance_transfer_engine_info"}
        assert raw["rank"] == rank
        session_id, weights_info = raw["remote_instance_transfer_engine_info"]
        manifest = client.manifest(rank)
        assert (manifest.engine, manifest.rank, manifest.session_id) == (1, rank, session_id)
        assert weights_info["schemaVersion"] == "weightsync.io/manifest/v1"
        assert not manifest.staging
        assert manifest.regions[0].address == harness.engine.weights[rank].buffer.data_ptr()
        sessions.add(session_id)
    assert len(sessions) == TP  # one transport session per rank
    # the deprecated name answers the same
    old = client.request("GET", "/get_remote_instance_transfer_engine_info", query={"rank": 1})[1]
    assert old == client.request("GET", "/remote_instance_transfer_engine_info", query={"rank": 1})[1]
    for bad in ({}, {"rank": -1}, {"rank": TP}, {"rank": "x"}):
        with pytest.raises(HttpCallError) as err:
            client.request("GET", "/remote_instance_transfer_engine_info", query=bad)
        assert err.value.status == 400


def test_sglang_info_routes_report_the_version(harness: Harness) -> None:
    client = harness.client
    assert client.health()
    assert client.weight_version() == "default"
    assert client.model_info()["weight_version"] == "default"
    for route in ("/get_weight_version", "/weight_version", "/get_model_info"):
        assert client.request("GET", route)[1]["weight_version"] == "default"
    info = client.server_info()
    assert (info["tp_size"], info["weight_version"]) == (TP, "default")
    client.flush_cache()
    assert client.supports_weightsync()


def test_pause_refuses_generation_until_continue(harness: Harness) -> None:
    client = harness.client
    before = logits(client)
    assert same(before, expected_logits(0))
    tokens = client.generate(TOKENS, 4)
    assert len(tokens) == 4
    client.pause_generation("retract")
    assert client.status()["paused"] and client.status()["pause_mode"] == "retract"
    for call in (lambda: client.forward(TOKENS), lambda: client.generate(TOKENS, 2)):
        with pytest.raises(HttpCallError) as err:
            call()
        assert err.value.status == 503
    assert client.health()  # paused is not unhealthy
    client.continue_generation()
    assert torch.equal(logits(client), before)
    assert client.generate(TOKENS, 4) == tokens
    with pytest.raises(HttpCallError) as err:
        client.request("POST", "/pause_generation", body={"mode": "later"})
    assert err.value.status == 400


def test_live_round_changes_version_only_on_commit(harness: Harness) -> None:
    client = harness.client
    with pytest.raises(HttpCallError, match="pause generation first") as err:
        client.begin("1")
    assert err.value.status == 409
    client.pause_generation("abort")
    client.begin("1")
    sums = harness.write("1", seed=1)
    assert client.weight_version() == "default"  # written, not committed
    with pytest.raises(HttpCallError) as err:
        client.continue_generation()  # the live weights are mid-update
    assert err.value.status == 409
    assert client.verify(0, "1", BUCKET, sums[0]).ok
    with pytest.raises(HttpCallError, match="unverified") as err:
        client.commit("1")  # rank 1 not verified yet
    assert err.value.status == 409 and err.value.body["unverified_ranks"] == [1]
    assert client.weight_version() == "default"
    report = client.verify(1, "1", BUCKET, sums[1])
    assert report.ok and report.buckets == len(sums[1]) and report.buckets > 1
    assert client.commit("1")["weight_version"] == "1"
    assert client.weight_version() == "1"
    client.continue_generation()
    got = logits(client)
    assert same(got, expected_logits(1))
    torch.testing.assert_close(got, forward_full(full_state(1), TOKENS), rtol=1e-4, atol=1e-5)


def test_commit_refused_after_failed_verify_and_last_verify_counts(harness: Harness) -> None:
    client = harness.client
    client.pause_generation()
    client.begin("2")
    good = harness.write("2", seed=2)
    bad = harness.write("2", seed=2, rank=1, corrupt_bucket=3)
    assert bad[1] == good[1]  # the source reports the true checksums; a byte of bucket 3 differs on the target
    assert client.verify(0, "2", BUCKET, good[0]).ok
    report = client.verify(1, "2", BUCKET, bad[1])
    assert not report.ok and report.mismatched == (3,)
    with pytest.raises(HttpCallError) as err:
        client.commit("2")
    assert err.value.status == 409 and err.value.body["failed_ranks"] == [1]
    assert client.weight_version() == "default"
    # resend rank 1, verify again: the last verify is what counts
    harness.write("2", seed=2, rank=1)
    assert client.verify(1, "2", BUCKET, good[1]).ok
    client.commit("2")
    assert client.weight_version() == "2"


def test_commit_refused_without_round_or_verify(harness: Harness) -> None:
    client = harness.client
    with pytest.raises(HttpCallError) as err:
        client.commit("3")  # no round at all
    assert err.value.status == 409
    client.pause_generation()
    client.begin("3")
    with pytest.raises(HttpCallError) as err:
        client.verify(0, "4", BUCKET, [])  # another version's verify
    assert err.value.status == 409
    with pytest.raises(HttpCallError) as err:
        client.commit("3")  # nothing verified
    assert err.value.body["unverified_ranks"] == [0, 1]
    sums = harness.write("3", seed=3)
    short = client.verify(0, "3", BUCKET, sums[0][:-1])  # wrong bucket count
    assert not short.ok and "expected" in (short.error or "")
    wrong_size = client.verify(1, "3", BUCKET * 2, sums[1])  # buckets of another size
    assert not wrong_size.ok
    with pytest.raises(HttpCallError):
        client.commit("3")
    # SGLang's route is a commit too: refused the same way, with SGLang's failure shape
    with pytest.raises(HttpCallError) as err:
        client.update_weight_version("3")
    assert err.value.status == 400 and err.value.body["success"] is False
    assert client.weight_version() == "default"
    for r in range(TP):
        assert client.verify(r, "3", BUCKET, sums[r]).ok
    assert client.update_weight_version("3")["new_version"] == "3"
    assert client.weight_version() == "3"


def test_a_round_begun_without_verification_commits_on_the_writes_alone(harness: Harness) -> None:
    client = harness.client
    client.pause_generation()
    client.begin("5", verify=False)  # the group set transfer.verify: false
    harness.write("5", seed=5)
    assert client.commit("5")["weight_version"] == "5"
    client.begin("6")  # the default still needs every rank verified
    harness.write("6", seed=6)
    with pytest.raises(HttpCallError) as err:
        client.commit("6")
    assert err.value.body["unverified_ranks"] == [0, 1]
    with pytest.raises(HttpCallError, match="verify must be true or false"):
        client.request("POST", "/weightsync/begin", body={"version": "7", "verify": "no"})


def test_verify_detects_a_corrupted_byte_in_engine_memory(harness: Harness) -> None:
    client = harness.client
    client.pause_generation()
    client.begin("5")
    sums = harness.write("5", seed=5)
    manifest = client.manifest(0)
    entry = manifest.by_name()["model.layers.1.mlp.down_proj.weight"]
    offset = entry.address - manifest.regions[0].address + 7
    harness.engine.weights[0].buffer[offset] ^= 1  # one bit, inside the engine
    report = client.verify(0, "5", BUCKET, sums[0])
    assert report.mismatched == (offset // BUCKET,)
    with pytest.raises(HttpCallError):
        client.commit("5")


def test_staged_round_keeps_serving_old_weights_until_commit(harness: Harness) -> None:
    client = harness.client
    old = logits(client)
    live = client.manifest(0)
    assert client.stage(True)
    staged = client.manifest(0)
    assert staged.staging and staged.regions[0].address != live.regions[0].address
    assert staged.layout_fingerprint == live.layout_fingerprint
    client.begin("7")  # no pause needed: sources write the staging buffers
    sums = harness.write("7", seed=7)
    assert torch.equal(logits(client), old)  # still v-1, bit for bit
    for r in range(TP):
        assert client.verify(r, "7", BUCKET, sums[r]).ok
    assert torch.equal(logits(client), old) and client.weight_version() == "default"
    client.commit("7")
    assert client.weight_version() == "7"
    assert same(logits(client), expected_logits(7))
    # an aborted staged round leaves the served weights and version alone
    client.begin("8")
    harness.write("8", seed=8)
    client.abort("8")
    assert client.weight_version() == "7" and same(logits(client), expected_logits(7))
    assert not client.status()["live_dirty"]
    with pytest.raises(HttpCallError):
        client.commit("8")
    assert not client.stage(False)
    assert not client.manifest(0).staging


def test_aborted_live_round_keeps_the_engine_paused_until_a_verified_commit(harness: Harness) -> None:
    client = harness.client
    client.pause_generation()
    client.begin("9")
    harness.write("9", seed=9, rank=0)  # half written
    assert client.abort()["aborted"] == "9"
    assert client.weight_version() == "default"
    assert client.status()["live_dirty"]
    with pytest.raises(HttpCallError) as err:
        client.continue_generation()
    assert err.value.status == 409
    harness.sync("9", seed=9)
    client.continue_generation()
    assert client.weight_version() == "9" and same(logits(client), expected_logits(9))


def test_round_bookkeeping_is_strict(harness: Harness) -> None:
    client = harness.client
    with pytest.raises(HttpCallError) as err:
        client.begin("default")  # already there
    assert err.value.status == 409
    client.stage(True)
    client.begin("10")
    assert client.begin("10")["resumed"]  # the same version again: a fresh round (nothing verified yet)
    assert client.begin("11")["superseded"] == "10"  # a dead coordinator's round does not block its successor
    with pytest.raises(HttpCallError):
        client.stage(False)  # the manifest may not move under a round
    with pytest.raises(HttpCallError):
        client.abort("10")  # not the open round any more
    assert client.abort("11")["aborted"] == "11"
    assert client.abort()["aborted"] is None
    for body in ({"rank": 0}, {"rank": "0", "version": "1", "bucket_bytes": 1, "checksums": []}):
        with pytest.raises(HttpCallError) as err:
            client.request("POST", "/weightsync/verify", body=body)
        assert err.value.status == 400
