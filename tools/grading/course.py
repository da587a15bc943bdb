"""What a course of hundreds needs around the grades: a roster, a late policy, hand points kept across
re-runs, and a gradebook an LMS imports.

- **Roster** (``--roster roster.csv``): a CSV with the columns ``name``, ``id``,
  ``email`` (and optionally ``section``). A student's folder is matched to a row by
  its id, its e-mail, the e-mail's part before ``@`` or the name (case and
  spacing ignored). Every row gets grades, with or without a notebook ("not
  submitted"); a folder that matches no row is graded and reported.
- **Late policy** (``--deadline``, ``--grace``, ``--late-penalty``, ``--late-max-days``):
  the time a notebook was handed in is the first line of a file
  ``submitted_at.txt`` next to it (ISO 8601, as an LMS export writes it), else the
  notebook's modification time. Past the deadline plus the grace period, each day
  or part of a day late takes ``--late-penalty`` percent of the points; after
  ``--late-max-days`` days the notebook earns nothing.
- **Duplicates** (``--duplicates``): when a student hands in several notebooks of
  one chapter, ``latest`` (the default) grades the one handed in last, as most
  LMSs do; ``best`` keeps the best-scoring copy. Either way the others are named in
  the notes.
- **Hand points** are the ``points`` an instructor types into the ``by hand`` rows
  of ``gradebook.csv``; a re-run into the same folder reads them back and keeps
  them (merge, never overwrite).
- **Canvas**: ``canvas.csv``, Canvas's gradebook import format, one row per
  student and one column per assignment (chapter), with the total after the late
  penalty.
"""

from __future__ import annotations

import csv
import math
import re
import unicodedata
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

__all__ = ["RosterEntry", "read_roster", "match_roster", "LatePolicy", "submitted_at", "read_hand_points",
           "SUBMITTED_AT"]

SUBMITTED_AT = ("submitted_at.txt", "submitted-at.txt", "submitted_at")


@dataclass(frozen=True)
class RosterEntry:
    name: str
    id: str
    email: str
    section: str = ""


def _key(text: str) -> str:
    text = unicodedata.normalize("NFC", text).casefold()
    return re.sub(r"[\s_.\-]+", " ", text).strip()


def read_roster(path: Path) -> list[RosterEntry]:
    """The roster's rows; ``ValueError`` naming the file if a column is missing or an id repeats."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        fields = {(h or "").strip().lower(): h for h in reader.fieldnames or []}
        missing = [c for c in ("name", "id", "email") if c not in fields]
        if missing:
            raise ValueError(f"roster {path}: expected the columns name, id, email; missing {', '.join(missing)} "
                             f"(got {', '.join(reader.fieldnames or [])})")
        out = []
        for row in reader:
            get = lambda c: (row.get(fields[c]) or "").strip() if c in fields else ""   # noqa: E731
            if get("id") or get("name"):
                out.append(RosterEntry(get("name"), get("id") or get("email") or get("name"), get("email"),
                                       get("section")))
    ids = [e.id for e in out]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ValueError(f"roster {path}: the id {repeated[0]!r} appears more than once")
    return out


def match_roster(folder: str, roster: list[RosterEntry]) -> RosterEntry | None:
    """The roster row a student's folder belongs to, or None."""
    key = _key(folder)
    for pick in (lambda e: e.id, lambda e: e.email, lambda e: e.email.split("@")[0], lambda e: e.name):
        hits = [e for e in roster if pick(e) and _key(pick(e)) == key]
        if len(hits) == 1:
            return hits[0]
    return None


def _parse_time(text: str) -> datetime:
    text = text.strip().replace("Z", "+00:00")
    t = datetime.fromisoformat(text)
    return t if t.tzinfo else t.astimezone()          # a naive time is the machine's local time


def submitted_at(notebook: Path) -> tuple[datetime, str]:
    """When a notebook was handed in, and where that was read from."""
    for name in SUBMITTED_AT:
        path = notebook.parent / name
        if path.is_file():
            line = path.read_text(encoding="utf-8-sig").strip().splitlines()
            if line:
                try:
                    return _parse_time(line[0]), name
                except ValueError:
                    pass
    return datetime.fromtimestamp(notebook.stat().st_mtime, tz=timezone.utc), "the notebook's timestamp"


@dataclass
class LatePolicy:
    deadline: datetime | None = None
    penalty_percent_per_day: float = 10.0
    grace_minutes: float = 0.0
    max_days: int | None = None

    @classmethod
    def parse(cls, deadline: str | None, penalty: float, grace: float, max_days: int | None) -> "LatePolicy":
        if penalty < 0 or penalty > 100:
            raise ValueError(f"--late-penalty: expected a percent in [0, 100], got {penalty}")
        if grace < 0:
            raise ValueError(f"--grace: expected minutes >= 0, got {grace}")
        when = None
        if deadline:
            try:
                when = _parse_time(deadline)
            except ValueError:
                raise ValueError(f"--deadline: expected an ISO 8601 time such as 2026-03-01T23:59, "
                                 f"got {deadline!r}") from None
        return cls(when, penalty, grace, max_days)

    def late_days(self, when: datetime) -> int:
        """Days late, each part of a day counting as one (0: on time or within the grace period)."""
        if self.deadline is None:
            return 0
        over = when - self.deadline - timedelta(minutes=self.grace_minutes)
        return 0 if over <= timedelta(0) else math.ceil(over / timedelta(days=1))

    def penalty(self, days: int) -> float:
        """The fraction of the points taken away."""
        if days <= 0:
            return 0.0
        if self.max_days is not None and days > self.max_days:
            return 1.0
        return min(1.0, days * self.penalty_percent_per_day / 100.0)

    def describe(self) -> str:
        if self.deadline is None:
            return "no deadline"
        text = f"deadline {self.deadline.isoformat(timespec='minutes')}"
        if self.grace_minutes:
            text += f", {self.grace_minutes:g} min grace"
        text += f", {self.penalty_percent_per_day:g}% off per day or part of a day late"
        if self.max_days is not None:
            text += f", nothing after {self.max_days} days"
        return text


def read_hand_points(path: Path) -> dict[tuple[str, str], str]:
    """The points an instructor entered in the ``by hand`` rows of an existing gradebook."""
    if not path.is_file():
        return {}
    out = {}
    with open(path, newline="", encoding="utf-8-sig") as f:
        for row in csv.DictReader(f):
            if row.get("grading") == "by hand" and (row.get("points") or "").strip():
                out[(row["student"], row["exercise"])] = row["points"].strip()
    return out
