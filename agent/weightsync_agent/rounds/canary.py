"""The semantic gate: before an engine's version label moves, it scores the trainer's canary (docs/agent.md,
"The semantic gate").

Byte verification proves the bytes arrived; it cannot see an engine that reads something else from them: a
post-processing step it skipped (MLA's derived ``w_kc``/``w_vc`` left stale), a layer the trainer never staged, a
quantization scale of the wrong contract. A trainer that wants that caught publishes a **canary** with its version:
a fixed prompt (token ids) and the logprob its own model gives each token after the first (teacher forcing). Each
engine scores the same prompt once the version is applied and before it is labelled; a token whose logprob is off by
more than the canary's tolerance fails the round, naming the engine, the token and both values.

The trainer chooses the tolerance: the distance between its forward and the engine's for a correct sync (dtype,
kernels, quantization); docs/agent.md has measured values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Final, Self

from pydantic import Field, model_validator

from weightsync_agent.http.bounds import RequestModel

#: The longest canary: enough for a prompt that touches every layer many times, small next to a rollout.
MAX_CANARY_TOKENS: Final = 512
#: A vocabulary index (the largest published vocabularies are ~260k; 2^31 leaves room, not 10^300).
TokenId = Annotated[int, Field(ge=0, lt=2**31, strict=True)]
#: A token's logprob: finite, at most 0 (a probability is at most 1), above anything float16 can tell apart.
Logprob = Annotated[float, Field(le=0.0, ge=-1e4, allow_inf_nan=False)]


class Canary(RequestModel):
    """A prompt (``inputIds``) and the trainer's logprob of each of its tokens after the first (``logprobs``),
    with the largest difference an engine's logprob may have from it (``tolerance``)."""

    input_ids: list[TokenId] = Field(alias="inputIds", min_length=2, max_length=MAX_CANARY_TOKENS)
    logprobs: list[Logprob] = Field(max_length=MAX_CANARY_TOKENS - 1)
    tolerance: float = Field(gt=0.0, le=10.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_logprob_per_scored_token(self) -> Self:
        if len(self.logprobs) != len(self.input_ids) - 1:
            raise ValueError(
                f"logprobs: one per token after the first: {len(self.input_ids) - 1} for {len(self.input_ids)} "
                f"input ids, got {len(self.logprobs)}"
            )
        return self

    def to_json(self) -> dict[str, object]:
        return self.model_dump(by_alias=True)


def gaps(canary: Canary, scored: Sequence[float | None]) -> list[float]:
    """Per canary token after the first, how far ``scored`` is from the trainer's logprob (inf where the engine
    gave none or a non-finite one)."""
    return [
        math.inf if got is None or not math.isfinite(got) else abs(got - want)
        for got, want in zip(scored, canary.logprobs, strict=True)
    ]


def judge(canary: Canary, scored: Sequence[float | None]) -> str | None:
    """Why an engine's logprobs ``scored`` (one per canary token after the first) do not pass ``canary``, or None
    when every one is within its tolerance."""
    if len(scored) != len(canary.logprobs):
        return f"scored {len(scored)} tokens; the canary has {len(canary.logprobs)} after the first"
    off = gaps(canary, scored)
    worst = max(range(len(off)), key=off.__getitem__)
    if off[worst] <= canary.tolerance:
        return None
    got = scored[worst]
    shown = "none" if got is None else f"{got:.4f}"
    return (
        f"token {worst + 1} of the canary (id {canary.input_ids[worst + 1]}): logprob {shown}, the trainer's "
        f"{canary.logprobs[worst]:.4f} (off by {off[worst]:.3g}, tolerance {canary.tolerance:g})"
    )
