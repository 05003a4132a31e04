"""Read WeightSyncGroup objects from YAML/dicts and validate them as the API server would.

The API server checks the CRD's schema and CEL rules; outside a cluster we check the same things with
the pydantic models (schema) and cel-python (the very same CEL expressions), so `weightsync plan -f`
and the operator reject what the API server rejects, with the same messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any, Final

import yaml
from pydantic import ValidationError

from weightsync.api import cel, crd
from weightsync.api.v1alpha1 import API_VERSION, KIND, WeightSyncGroup

#: A group file bigger than this is not a WeightSyncGroup (the API server stores objects of ~1.5 MB at most).
MAX_FILE_BYTES: Final = 1024 * 1024


class GroupFileError(ValueError):
    """A file that cannot hold WeightSyncGroups (missing, too big, not text, not YAML); ``str()`` is one line."""


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without aliases: a spec never needs ``*ref``, and aliases are how a few hundred bytes become gigabytes
    once the document is copied into models (a "billion laughs" file)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
            raise GroupFileError(
                f"line {mark.line + 1}, column {mark.column + 1}: YAML aliases (*name) are not accepted in a "
                "WeightSyncGroup file"
            )
        return super().compose_node(parent, index)


class SpecError(ValueError):
    """An invalid WeightSyncGroup; ``problems`` lists every mistake, each as 'path: message'."""

    def __init__(self, name: str, problems: list[str]) -> None:
        self.name = name
        self.problems = problems
        listing = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"WeightSyncGroup {name or '<unnamed>'} is invalid:\n{listing}")


def _pydantic_problems(exc: ValidationError, prefix: str) -> list[str]:
    problems = []
    for error in exc.errors():
        location = ".".join(str(part) for part in error["loc"] if not str(part).startswith("function-"))
        problems.append(f"{prefix}{location}: {error['msg']}")
    return problems


def parse_group(obj: Mapping[str, Any], *, old: Mapping[str, Any] | None = None) -> WeightSyncGroup:
    """Validate one object (schema, then CEL; transition rules too when ``old`` is given)."""
    name = str(obj.get("metadata", {}).get("name", ""))
    if obj.get("kind", KIND) != KIND or obj.get("apiVersion", API_VERSION) != API_VERSION:
        raise SpecError(name, [f"expected apiVersion {API_VERSION}, kind {KIND}"])
    try:
        group = WeightSyncGroup.model_validate(obj)
    except ValidationError as exc:
        raise SpecError(name, _pydantic_problems(exc, "")) from exc
    defaulted = defaulted_object(group)
    rule_sets = crd.rule_sets()
    violations = cel.check(defaulted, rule_sets)
    if old is not None:
        old_group = WeightSyncGroup.model_validate(old)
        violations += cel.check_transition(defaulted_object(old_group), defaulted, rule_sets)
    if violations:
        raise SpecError(name, [str(v) for v in violations])
    return group


def defaulted_object(group: WeightSyncGroup) -> dict[str, Any]:
    """The object as the API server stores it: defaults filled in, absent optionals left out."""
    return {
        "apiVersion": group.api_version,
        "kind": group.kind,
        "metadata": group.metadata.model_dump(exclude_defaults=False),
        "spec": group.spec.model_dump(mode="json", by_alias=True, exclude_none=True),
    }


def iter_documents(text: str) -> Iterable[dict[str, Any]]:
    """The YAML documents of ``text`` that are objects (a ``List`` gives its items); GroupFileError if not YAML."""
    try:
        docs = list(yaml.load_all(text, Loader=_NoAliasLoader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise GroupFileError(f"not YAML: {where}{problem}") from exc
    for doc in docs:
        if isinstance(doc, dict):
            if doc.get("kind") == "List":
                yield from (item for item in doc.get("items", []) if isinstance(item, dict))
            else:
                yield doc


def read_group_file(path: str | Path) -> str:
    """The text of a group file ('-': stdin), refused with one line if missing, over MAX_FILE_BYTES or not UTF-8."""
    try:
        if str(path) == "-":
            import sys

            data = _read_capped(sys.stdin.buffer)
        else:
            with open(path, "rb") as handle:
                data = _read_capped(handle)
    except OSError as exc:
        raise GroupFileError(exc.strerror or str(exc)) from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GroupFileError(f"not a text file (byte {exc.start} is not UTF-8)") from exc


def _read_capped(handle: IO[bytes]) -> bytes:
    data = handle.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise GroupFileError(f"more than {MAX_FILE_BYTES // 1024} KiB: too big for a WeightSyncGroup file")
    return data


def load_groups(path: str | Path) -> list[WeightSyncGroup]:
    """Every WeightSyncGroup in a YAML file (other kinds are skipped), validated.

    GroupFileError when the file cannot be read as YAML; SpecError when a group is invalid."""
    text = read_group_file(path)
    groups = [parse_group(doc) for doc in iter_documents(text) if doc.get("kind") == KIND]
    if not groups:
        raise SpecError("", [f"{path}: no {KIND} found"])
    return groups
