"""Read a cluster YAML into a ``ClusterSpec`` or a list of located problems.

Protocol: ``load(path)`` either returns a fully validated spec or raises ``SpecError``
whose ``lines`` are ready to print, one per problem, as ``path.to.field: message
(line N)``. Nothing is returned half-validated. A file that cannot be read or parsed,
is empty, is not a mapping, or nests deeper than ``MAX_DEPTH`` (checked on the event
stream before anything recursive reads it) is one problem with no field path.

Every other problem of a spec is reported in one go, in the file's line order, so an
operator fixes them all in one pass, not one per run:

- a key YAML 1.1 reads as a boolean (``on:``, ``yes:``, ``off:``) names the word as
  written (``on:`` in a role gets the ``select:`` hint); the key is then left out and
  the rest of the document is validated as if it were absent;
- every field problem pydantic finds;
- the cross-field checks (``checks``), also when some fields are bad: the smallest
  part holding each bad field (a list entry such as one node, a role, or an optional
  top-level section) is set aside and the rest checked (``_salvaged``). A problem
  that could come from setting a part aside (one naming a set-aside node, rack or
  datacenter, at a field that names one, or a link missing) is not reported; when a part the checks cannot do
  without is bad (``name``, ``hub``, ``topology`` itself), they wait for the fix.
"""

from __future__ import annotations

import copy
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


def _boolean_keys(root: yaml.Node | None) -> list[tuple[Loc, str, int]]:
    """(path, message, line) per mapping key YAML 1.1 resolved to a boolean (``on``,
    ``yes``, ``off``...); the path ends in the word as written."""
    problems, stack, seen = [], [(root, ())], set()
    while stack:
        node, loc = stack.pop()
        if node is None or id(node) in seen:  # an alias is walked once
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.tag == "tag:yaml.org,2002:bool":
                    if len(loc) == 2 and loc[0] == "roles" and key.value.lower() == "on":
                        why = ("YAML 1.1 reads `on` as true; a role picks its nodes with "
                               "`select: {nodes: [...], labels: {...}}`")
                    else:
                        why = f"YAML 1.1 reads the key {key.value!r} as true/false; quote it if you meant the word"
                    problems.append((loc + (key.value,), why, key.start_mark.line + 1))
                else:
                    stack.append((value, loc + (key.value,)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, loc + (i,)) for i, item in enumerate(node.value))
    return problems


def _drop_boolean_keys(data: object, seen: set | None = None) -> object:
    """``data`` without the mapping keys YAML read as booleans (each already reported)."""
    seen = set() if seen is None else seen
    if id(data) in seen:
        return data
    seen.add(id(data))
    if isinstance(data, dict):
        for key in [k for k in data if isinstance(k, bool)]:
            del data[key]
        for value in data.values():
            _drop_boolean_keys(value, seen)
    elif isinstance(data, list):
        for item in data:
            _drop_boolean_keys(item, seen)
    return data


# Top-level sections with a default: a bad one is set aside (as if absent) for the cross-checks.
_OPTIONAL = frozenset(("auth", "launcher", "ssh", "ray", "engine", "roles", "models", "endpoints"))


def _cut_point(loc: Loc) -> Loc | None:
    """The smallest part that can be set aside and still leave a spec: the deepest list
    entry or role along ``loc``, else an optional top-level section; None if none."""
    cut = None
    for i, part in enumerate(loc):
        if isinstance(part, int) or (i == 1 and loc[0] == "roles"):
            cut = loc[: i + 1]
    if cut is None and loc and loc[0] in _OPTIONAL:
        cut = loc[:1]
    return cut


def _names_in(value: object) -> set[str]:
    """Every ``name:`` in a set-aside part (the nodes of a rack, the racks of a DC...)."""
    if isinstance(value, dict):
        own = {value["name"]} if isinstance(value.get("name"), str) else set()
        return own.union(*(_names_in(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_names_in(v) for v in value))
    return set()


def _strings_at(doc: object, loc: Loc) -> set[str]:
    """Every string in the part of ``doc`` at ``loc`` (a role's ``select`` naming a
    set-aside node may select nothing only because of it)."""
    for part in loc:
        try:
            doc = doc[part]
        except (KeyError, IndexError, TypeError):
            return set()
    if isinstance(doc, str):
        return {doc}
    if isinstance(doc, dict):
        return set().union(*(_strings_at(v, ()) for v in doc.values())) if doc else set()
    if isinstance(doc, list):
        return set().union(*(_strings_at(v, ()) for v in doc)) if doc else set()
    return set()


def _salvaged(data: dict, bad: list[Problem], base: Path) -> list[Problem]:
    """The cross-check problems of ``data`` with the parts holding ``bad`` set aside,
    located in ``data``'s own coordinates; [] when a part they need is bad."""
    cuts = set()
    for loc, _ in bad:
        cut = _cut_point(loc)
        if cut is None:
            return []
        cuts.add(cut)
    rest = copy.deepcopy(data)
    removed: dict[Loc, set[int]] = {}  # list path → indices set aside (original numbering)
    names: set[str] = set()
    # Deepest first, and within one list the highest index first, so each cut's path is still right.
    for cut in sorted(cuts, key=lambda c: (len(c), c[-1] if isinstance(c[-1], int) else -1), reverse=True):
        try:
            parent = rest
            for part in cut[:-1]:
                parent = parent[part]
            parent[cut[-1]]
        except (KeyError, IndexError, TypeError):
            continue  # already gone with a part that held it
        names |= _names_in(parent[cut[-1]])
        if isinstance(cut[-1], int):
            removed.setdefault(cut[:-1], set()).add(cut[-1])
        del parent[cut[-1]]
    try:
        spec = ClusterSpec.model_validate(rest)
    except ValidationError:
        return []  # setting parts aside broke another (a list left empty): the checks wait for the fix
    links_cut = any(c[:2] == ("topology", "links") for c in cuts)
    kept = []
    for loc, msg in cross_check(spec, base):
        if (any(repr(n) in msg for n in names) or names & _strings_at(rest, loc)
                or (links_cut and "has no link" in msg)):
            continue
        kept.append((_original(loc, removed), msg))
    return kept


def _original(loc: Loc, removed: dict[Loc, set[int]]) -> Loc:
    """``loc`` (in a document with list entries ``removed``) in the full document's numbering."""
    out: tuple = ()
    for part in loc:
        if isinstance(part, int) and removed.get(out):
            index, left = -1, part
            while left >= 0:
                index += 1
                if index not in removed[out]:
                    left -= 1
            part = index
        out += (part,)
    return out


def load(path: str | Path) -> ClusterSpec:
    path = Path(path)
    data, root = read_yaml(path)
    if data is None:
        raise SpecError([f"{path}: the file is empty; a cluster spec is a YAML mapping with name:, hub: and "
                         "topology: (see specs/local.yaml, `th spec schema`)"])
    if not isinstance(data, dict):
        kind = _KINDS.get(type(data), type(data).__name__)
        raise SpecError([f"{path}: a cluster spec must be a YAML mapping (name:, hub:, topology:, ...), got {kind}"])
    found = [(line, f"{format_loc(loc)}: {msg} (line {line})") for loc, msg, line in _boolean_keys(root)]
    data = _drop_boolean_keys(data)
    try:
        spec = ClusterSpec.model_validate(data)
    except ValidationError as err:
        problems = _pydantic_problems(err)
        problems += _salvaged(data, problems, path.resolve().parent)
    else:
        problems = cross_check(spec, path.resolve().parent)
    for loc, msg in problems:
        line = _line_of(root, loc)
        found.append((line, f"{format_loc(loc)}: {msg}" + (f" (line {line})" if line else "")))
    if found:
        # In the file's order (stable: problems of one line keep the order they were found in).
        raise SpecError([text for _, text in sorted(found, key=lambda f: f[0] if f[0] is not None else 1 << 30)])
    return spec


def schema() -> dict:
    return ClusterSpec.model_json_schema()
