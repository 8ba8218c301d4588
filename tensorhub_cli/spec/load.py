"""Read a cluster YAML into a ``ClusterSpec`` or a list of located problems.

Protocol: ``load(path)`` either returns a fully validated spec or raises ``SpecError``
whose ``lines`` are ready to print, one per problem, as ``path.to.field: message
(line N)``. Nothing is returned half-validated. A file that cannot be read or parsed,
is empty, is not a mapping, or nests deeper than ``MAX_DEPTH`` (checked on the event
stream before anything recursive reads it) is one problem with no field path. A key
YAML 1.1 reads as a boolean (``on:``, ``yes:``, ``off:``) is one problem naming the
word as written, before field validation: ``on:`` in a role gets the ``select:`` hint.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from .checks import Loc, Problem, cross_check
from .model import ClusterSpec

MAX_SPEC_BYTES = 4 << 20
MAX_DEPTH = 32  # the deepest real spec path, topology.datacenters[].racks[].nodes[].ssh.*, is 9 levels
_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true/false"}


class SpecError(Exception):
    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def format_loc(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _line_of(root: yaml.Node | None, loc: Loc) -> int | None:
    """1-based line of the deepest YAML node along ``loc`` that exists."""
    node, line = root, None
    for part in loc:
        if node is None:
            break
        line = node.start_mark.line + 1
        nxt = None
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.value == str(part):
                    line = key.start_mark.line + 1
                    nxt = value
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            nxt = node.value[part]
        node = nxt
    if node is not None:
        line = node.start_mark.line + 1
    return line


def _pydantic_problems(err: ValidationError) -> list[Problem]:
    problems = []
    for e in err.errors(include_url=False):
        # pydantic puts union/validator tags in the loc; keep only the document path.
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (typo?)"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        problems.append((loc, msg))
    return problems


def read_yaml(path: Path) -> tuple[object, yaml.Node | None]:
    try:
        if path.stat().st_size > MAX_SPEC_BYTES:
            raise SpecError([f"{path}: spec is larger than {MAX_SPEC_BYTES} bytes"])
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([f"{path}: no such file"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([f"{path}: cannot read: {exc}"]) from None
    try:
        _check_depth(path, text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError([f"{path}: YAML does not parse: {problem}{where}"]) from None
    return data, root


def _check_depth(path: Path, text: str) -> None:
    """Refuse nesting deeper than ``MAX_DEPTH`` from the parser's events (iterative),
    before the composer and constructor, which recurse once per level."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise SpecError([f"{path}: nests deeper than {MAX_DEPTH} levels (line {event.start_mark.line + 1}); "
                                 "a cluster spec is a few levels deep (see `th spec schema`)"])
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _boolean_keys(root: yaml.Node | None) -> list[str]:
    """A line per mapping key YAML 1.1 resolved to a boolean (``on``, ``yes``, ``off``...)."""
    problems, stack, seen = [], [(root, ())], set()
    while stack:
        node, loc = stack.pop()
        if node is None or id(node) in seen:  # an alias is walked once
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.tag == "tag:yaml.org,2002:bool":
                    where = format_loc(loc + (key.value,))
                    if len(loc) == 2 and loc[0] == "roles" and key.value.lower() == "on":
                        why = ("YAML 1.1 reads `on` as true; a role picks its nodes with "
                               "`select: {nodes: [...], labels: {...}}`")
                    else:
                        why = f"YAML 1.1 reads the key {key.value!r} as true/false; quote it if you meant the word"
                    problems.append(f"{where}: {why} (line {key.start_mark.line + 1})")
                else:
                    stack.append((value, loc + (key.value,)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, loc + (i,)) for i, item in enumerate(node.value))
    return sorted(problems)


def load(path: str | Path) -> ClusterSpec:
    path = Path(path)
    data, root = read_yaml(path)
    if data is None:
        raise SpecError([f"{path}: the file is empty; a cluster spec is a YAML mapping with name:, hub: and "
                         "topology: (see specs/local.yaml, `th spec schema`)"])
    if not isinstance(data, dict):
        kind = _KINDS.get(type(data), type(data).__name__)
        raise SpecError([f"{path}: a cluster spec must be a YAML mapping (name:, hub:, topology:, ...), got {kind}"])
    flagged = _boolean_keys(root)
    if flagged:
        raise SpecError(flagged)
    try:
        spec = ClusterSpec.model_validate(data)
    except ValidationError as err:
        problems = _pydantic_problems(err)
    else:
        problems = cross_check(spec, path.resolve().parent)
    if problems:
        lines = []
        for loc, msg in problems:
            line = _line_of(root, loc)
            lines.append(f"{format_loc(loc)}: {msg}" + (f" (line {line})" if line else ""))
        raise SpecError(lines)
    return spec


def schema() -> dict:
    return ClusterSpec.model_json_schema()
