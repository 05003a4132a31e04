"""An engine replica's loader: the engine's own model class in the engine's Python, filling a replica file.

A manifest whose tensors take the ``engine-replica`` path (docs/engines/engine-replicas.md) is written from a
replica no cut fills: the trainer stages its full HF tensors into the engine replica's *feed* replica (an ordinary
replica file, one whole part per tensor), and this loader runs the engine's ``load_weights`` over them, inside
``weightsync_engine/<engine>/replica_serve.py --replica-serve`` (the engine's interpreter,
``$WEIGHTSYNC_ENGINE_PYTHON``), whose model's parameters are views of the engine replica's file. After a load the
file holds the engine's loader layout, byte for byte, and the source sends it like any replica.

One process per engine replica, started when the replica is built (the model is built once) and stopped with it.
"""

from __future__ import annotations

import json
import logging
import queue
import subprocess
import threading
import time
from typing import Any

from weightsync_agent.engine_python import engine_python, trace_script
from weightsync_agent.source.replica import Replica, ReplicaError

log = logging.getLogger("weightsync.agent.engine_loader")

#: How long the engine's import and the model's build may take (the first answer and the bind's).
START_SECONDS = 300.0


class EngineLoader:
    """The loader process of one engine replica (``replica``), reading its feed replica (``feed``)."""

    def __init__(self, replica: Replica, feed: Replica) -> None:
        spec = replica.layout.replica
        if spec is None or replica.shm_path is None or feed.shm_path is None:
            raise ReplicaError(
                f"replica {replica.fingerprint}: an engine loader needs file-backed engine and feed replicas"
            )
        self.replica, self.feed = replica, feed
        self.name = f"engine replica {replica.fingerprint} ({spec['engine']} rank {spec['rank']})"
        self._answers: queue.Queue[str | None] = queue.Queue()
        self._lock = threading.Lock()
        command = [engine_python(), str(trace_script()), str(spec["engine"]), "--replica-serve"]
        try:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1
            )
        except OSError as exc:
            raise ReplicaError(f"{self.name}: cannot start the engine's Python {command[0]}: {exc}") from exc
        self._stderr: list[str] = []
        threading.Thread(target=self._read, args=(self.process.stdout, self._answers), daemon=True).start()
        threading.Thread(target=self._drain, daemon=True).start()
        try:
            self._start(replica, feed, spec)
        except BaseException:
            self.close()
            raise

    def _start(self, replica: Replica, feed: Replica, spec: dict[str, Any]) -> None:
        self._answer(START_SECONDS)  # the engine imported
        self._call(
            {
                "op": "bind",
                "replica": spec,
                "file": str(replica.shm_path),
                "offset": replica.data_offset,
                "tensors": [[t.name, t.offset] for t in replica.layout.tensors],
                "feed": {
                    "file": str(feed.shm_path),
                    "offset": feed.data_offset,
                    "tensors": [[t.name, t.offset] for t in feed.layout.tensors],
                },
            },
            START_SECONDS,
        )

    @property
    def layer_groups(self) -> list[list[str]]:
        """The feed's tensors by decoder layer, when the engine found that loading them a group at a time leaves the
        bytes one load does (``EngineReplica.layer_groups``); empty: one load of every feed."""
        spec = self.replica.layout.replica or {}
        names = [str(feed["name"]) for feed in spec.get("feeds", ())]
        return [[names[i] for i in group] for group in spec.get("layer_groups", ())]

    def load(self, timeout: float, names: list[str] | None = None) -> float:
        """Run the engine's ``load_weights`` over the feed tensors ``names`` (every one when None); the seconds it
        took. Those feeds must not change meanwhile (the caller holds the feed, or a stream staged them: a stream
        stages each part once), and the caller files the replica as loaded (:meth:`Replica.mark_loaded`) once every
        feed went through."""
        request: dict[str, Any] = {"op": "load"} if names is None else {"op": "load", "names": names}
        answer = self._call(request, timeout)
        return float(answer.get("seconds") or 0.0)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()

    def _call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        with self._lock:
            if self.process.poll() is not None or self.process.stdin is None:
                raise ReplicaError(f"{self.name}: the loader exited ({self._last_words()})")
            try:
                self.process.stdin.write(json.dumps(request) + "\n")
                self.process.stdin.flush()
            except OSError as exc:
                raise ReplicaError(f"{self.name}: the loader is gone: {exc} ({self._last_words()})") from exc
            return self._answer(timeout)

    def _answer(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._answers.get(timeout=timeout)
        except queue.Empty:
            self.process.kill()  # a loader that does not answer holds the replica in an unknown state
            raise ReplicaError(f"{self.name}: no answer within {timeout:.0f} s; the loader was stopped") from None
        if line is None:
            raise ReplicaError(f"{self.name}: the loader exited ({self._last_words()})")
        try:
            answer: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReplicaError(f"{self.name}: the loader answered {line[:200]!r}") from exc
        if not answer.get("ok"):
            raise ReplicaError(f"{self.name}: {answer.get('error')}")
        return answer

    @staticmethod
    def _read(stream: Any, into: queue.Queue[str | None]) -> None:
        for line in stream:
            into.put(line)
        into.put(None)

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._stderr = [*self._stderr[-19:], line.rstrip()]
            log.debug("%s: %s", self.name, line.rstrip())

    def _last_words(self) -> str:
        time.sleep(0.05)  # let the stderr reader catch up with a process that just died
        return " | ".join(self._stderr[-3:]) or "no output"
