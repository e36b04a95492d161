"""What a step's code did that the doctor could only name, not prevent (files written and put
back, folders made, connections, processes): :class:`Effects` adds them up over sessions and says
each once, files and folders one verb touched in one folder (or in the folders of one folder)
grouped into one clause.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re

__all__ = ["FILES_GROUPED", "Effects"]

FILES_GROUPED = 4  # files one verb touched in one folder, named as one clause from this many
# longest first; a save made read-only or linked each step is as many clauses otherwise
_FILE_VERBS = ("changed the mode of", "made the folder", "removed the folder", "wrote", "removed",
               "linked")  # fmt: skip


@dataclasses.dataclass
class Effects:
    """Side effects recorded (what: how many times) and those put back as they were; added up
    over sessions (examining, then trying fixes) and said once."""

    found: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    put_back: set[str] = dataclasses.field(default_factory=set)

    def __iadd__(self, other: Effects) -> Effects:
        """Added up: what one session did not put back is not said put back after another."""
        kept = (self.put_back | other.put_back) - (self.found.keys() - self.put_back)
        self.put_back = kept - (other.found.keys() - other.put_back)
        self.found.update(other.found)
        return self

    def said(self) -> list[str]:
        """Each once, with how many times it happened; files or folders one verb touched in one
        folder, or in the folders of one folder (a checkpoint a step), :data:`FILES_GROUPED` or
        more, as one clause."""
        return _said_grouped(self.found, self.put_back)


def _said_grouped(found: collections.Counter[str], put_back: set[str]) -> list[str]:
    """The side effects ``found`` (what: times) in words, grouped as :meth:`Effects.said` says;
    ``put_back``: those put back as they were."""
    touched = {what: _verb_and_path(what) for what in found}
    keys = {w: [_group(touched[w], w in put_back, levels) for levels in (1, 2)]
            for w in found if touched[w]}  # fmt: skip
    counts = [collections.Counter(k[i] for k in keys.values()) for i in (0, 1)]
    grouped: dict[str, tuple[str, str, bool]] = {}
    for what, (own, parent) in keys.items():  # the folder's folder where it holds many more
        if counts[1][parent] >= max(FILES_GROUPED, 2 * counts[0][own]):
            grouped[what] = parent
        elif counts[0][own] >= FILES_GROUPED:
            grouped[what] = own
    members = collections.defaultdict(list)
    for what, key in grouped.items():
        members[key].append(what)
    said = []
    for what, n in found.items():
        key = grouped.get(what)
        if key is None:
            said.append(what + (f" ({n} times)" if n > 1 else "")
                        + (", put back as it was" * (what in put_back)))  # fmt: skip
        elif members[key][0] == what:  # said where its first member stands
            said.append(_group_said(key, members[key], found))
    return said


def _verb_and_path(what: str) -> tuple[str, str] | None:
    """(verb, the path it left) of a file or folder effect: a rename's by where it went."""
    if what.startswith("renamed ") and " to " in what:
        return "renamed", what.rpartition(" to ")[2]
    return next(((verb, what[len(verb) + 1 :]) for verb in _FILE_VERBS
                 if what.startswith(verb + " ")), None)  # fmt: skip


def _group(touched: tuple[str, str], put_back: bool, levels: int) -> tuple[str, str, bool]:
    verb, folder = touched
    for _ in range(levels):
        folder = os.path.dirname(folder)
    return verb, folder, put_back


def _group_said(key: tuple[str, str, bool], members: list[str], found) -> str:
    verb, folder, put_back = key
    names = [os.path.relpath(_verb_and_path(w)[1], folder or os.curdir) for w in members]
    times = sum(found[w] for w in members)
    noun = {"renamed": "entries into"}.get(verb, "folders in" if verb.endswith("folder") else "files in")
    said = verb if verb.endswith(" of") else verb.split()[0]
    # the names of the largest numbered series, first to last, and how many others beside it
    shapes = [re.sub(r"\d+", "#", n) for n in names]
    largest = collections.Counter(shapes).most_common(1)[0][0]
    series = [n for n, shape in zip(names, shapes, strict=True) if shape == largest]
    span = series[0] if series[0] == series[-1] else f"{series[0]} to {series[-1]}"  # renamed onto one
    others = len(names) - len(series)
    span += f" and {others} other{'s' * (others != 1)}" if others else ""
    return (f"{said} {len(members)} {noun} {folder or 'the working folder'} "
            f"({span})" + (f", {times} times in all" if times > len(members) else "")
            + (", each put back as it was" if put_back else ""))  # fmt: skip
