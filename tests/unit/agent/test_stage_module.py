"""``stage_module``'s bookkeeping with plain tensors and a recording stager (the FSDP2 and Megatron-style runs
against real agents are tests/agent/test_trainers.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from weightsync_agent.client.modules import identity, stage_module


class Recorder:
    def __init__(self, expected: set[str] | None = None) -> None:
        self.staged: dict[str, torch.Tensor] = {}
        self.strict: list[bool] = []
        self._expected = expected

    def stage(self, name: str, tensor: torch.Tensor, *, strict: bool = True) -> int:
        self.staged[name] = tensor.clone()
        self.strict.append(strict)
        return 1


class WithExpected(Recorder):
    def expected(self) -> set[str]:
        assert self._expected is not None
        return self._expected


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def test_every_parameter_is_staged_under_its_name_and_the_peak_is_the_largest_one() -> None:
    into = Recorder()
    report = stage_module(into, model())
    assert set(into.staged) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert report.parameters == 4 and report.staged == 4 and report.skipped == ()
    assert report.largest_parameter_bytes == report.peak_bytes == 8 * 4 * 4  # 0.weight, no copy made
    assert report.staged_bytes == (8 * 4 + 8 + 2 * 8 + 2) * 4
    assert into.strict == [False] * 4  # nothing says what the targets need: unknown names are the stager's call


def test_only_what_the_targets_expect_is_staged_and_the_rest_is_reported() -> None:
    into = WithExpected({"0.weight", "1.bias"})
    report = stage_module(into, model())
    assert set(into.staged) == {"0.weight", "1.bias"} and into.strict == [True, True]
    assert sorted(report.skipped) == ["0.bias", "1.weight"]


def test_a_converter_renames_and_splits_and_its_copies_count_toward_the_peak() -> None:
    def split(name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name == "0.weight":  # two halves as copies, as a fused-weight converter makes them
            first, second = tensor.chunk(2)
            return [("a.weight", first.clone()), ("b.weight", second.clone())]
        return [(f"hf.{name}", tensor)]

    into = Recorder()
    report = stage_module(into, model(), convert=split)
    assert set(into.staged) == {"a.weight", "b.weight", "hf.0.bias", "hf.1.weight", "hf.1.bias"}
    assert report.peak_bytes == 2 * report.largest_parameter_bytes  # the whole parameter and its two halves


def test_views_of_the_whole_tensor_are_not_counted_twice() -> None:
    def halves(name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        first, second = tensor.chunk(2)
        return [(f"{name}.a", first), (f"{name}.b", second)]

    report = stage_module(Recorder(), model(), convert=halves)
    assert report.peak_bytes == report.largest_parameter_bytes


def test_the_default_converter_strips_wrapper_prefixes() -> None:
    convert = identity()
    tensor = torch.zeros(1)
    assert next(iter(convert("_orig_mod.model.norm.weight", tensor)))[0] == "model.norm.weight"
    assert next(iter(convert("module._fsdp_wrapped_module.lm_head.weight", tensor)))[0] == "lm_head.weight"
