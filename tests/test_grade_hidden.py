"""The hidden cases decide the points (issue #28): drawn per student, judged outside the kernel,
kept out of the student wheel and kit, and deaf to answers made for the self-checks.

The driver cell that the grader sends to a kernel is run here in-process (it is the grader's
own code; the student's functions below are the attack class's), with the display call
captured, so these tests start no kernel.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from grading import attack_class, book, hidden, judge  # noqa: E402
from grading.runner import GRADE_MIME  # noqa: E402

CHAPTER = "03_delta_rule"


def _checks():
    return {(ex.label, j): check for ch in book.read_book(ROOT).values() for ex in ch.exercises
            for j, check in enumerate(ex.checks)}


def _run_driver(label, namespace, student="s", salt="salt", part=0):
    """What the grader does for one check, with the student's namespace in this process."""
    check = _checks()[(label, part)]
    spec, cases = hidden.cases_for(check, hidden.seed(salt, student, label, part))
    code = judge.driver_code(check.thunk, spec.arg, spec.kind, cases, "nonce", GRADE_MIME)
    sent = []
    with mock.patch("IPython.display.publish_display_data", lambda data: sent.append(data[GRADE_MIME])):
        exec(code, namespace)                                    # noqa: S102 - the grader's own driver
    return judge.judge(cases, sent[-1])


def _check(label):
    return next(c for (lab, _), c in _checks().items() if lab == label)


def test_the_cases_are_drawn_per_student_and_reproducible():
    check = _check("ex-dr-delta-step")
    spec, a1 = hidden.cases_for(check, hidden.seed("salt", "ann", "ex-dr-delta-step", 0))
    _, a2 = hidden.cases_for(check, hidden.seed("salt", "ann", "ex-dr-delta-step", 0))
    _, b = hidden.cases_for(check, hidden.seed("salt", "bob", "ex-dr-delta-step", 0))
    _, c = hidden.cases_for(check, hidden.seed("other course", "ann", "ex-dr-delta-step", 0))
    same = lambda x, y: all(np.array_equal(p, q) for p, q in zip(x[0].args, y[0].args))    # noqa: E731
    assert same(a1, a2) and not same(a1, b) and not same(a1, c)


def test_every_check_of_the_book_has_hidden_cases():
    for (label, _), check in _checks().items():
        found = hidden.cases_for(check, 1)
        assert found is not None and found[1], (label, check.call)


@pytest.mark.parametrize("stem", list(book.read_book(ROOT)))
def test_the_worked_solutions_pass_their_hidden_cases(stem, monkeypatch):
    """The expected answers are right: each chapter's worked solutions, run here, meet every hidden case."""
    import contextlib
    import io
    monkeypatch.chdir(ROOT / "exercises")                # where the notebooks run (../results/...)
    setup, by_label = book.solution_code(ROOT, stem)
    ns: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        for src in setup + [s for cells in by_label.values() for s in cells]:
            try:
                exec(src, ns)                                    # noqa: S102 - the book's own solutions
            except Exception:  # noqa: BLE001 - a plotting or printing cell is not needed here
                pass
    for ex in book.read_book(ROOT)[stem].exercises:
        for j, check in enumerate(ex.checks):
            verdict = _run_driver(ex.label, dict(ns), part=j)
            assert verdict.passed, (ex.label, check.call, verdict.message)


def test_answers_made_for_the_self_checks_pass_them_and_get_nothing_from_the_hidden_cases():
    from fixedstate.checks import delta
    ns: dict = {}
    exec(attack_class.ANSWERS, ns)                               # noqa: S102 - the attack class's own code
    # outside the sandbox (the real checks, with their stored answers) every self-check passes ...
    assert delta.check_delta_step(ns["delta_step"]).passed
    assert delta.check_answer("ex-dr-halving", ns["error_after_three"]).passed
    # ... the hidden cases give the function nothing
    verdict = _run_driver("ex-dr-delta-step", ns)
    assert not verdict.passed and "hidden case 1" in verdict.message
    # and in the sandbox's grading edition of the checks the stored answers are gone
    from grading.sandbox import grading_edition
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        edition = grading_edition(Path(tmp) / "checks")
        text = (edition / "delta.py").read_text()
        scope: dict = {"__name__": "fixedstate.checks.delta", "__package__": "fixedstate.checks"}
        exec(compile(text, "delta.py", "exec"), scope)          # noqa: S102 - the package's own module
        assert all("value" not in spec for spec in scope["ANSWERS"].values())
        assert not scope["check_delta_step"](ns["delta_step"]).passed


def test_forged_replies_and_patched_numpy_inside_the_kernel_change_nothing():
    check = _check("ex-dr-delta-step")
    spec, cases = hidden.cases_for(check, 7)
    assert not judge.judge(cases, {"nonce": "n", "cases": [{"passed": True}] * len(cases)}).passed
    assert not judge.judge(cases, {"passed": True, "status": "ok"}).passed
    assert not judge.judge(cases, "PASSED").passed
    ns = {"delta_step": lambda S, k, v, b: np.zeros_like(S)}
    with mock.patch("numpy.allclose", lambda *a, **k: True):      # patched where the student's code runs
        reply_ns = dict(ns)
        code = judge.driver_code(check.thunk, spec.arg, spec.kind, cases, "n", GRADE_MIME)
        sent = []
        with mock.patch("IPython.display.publish_display_data", lambda data: sent.append(data[GRADE_MIME])):
            exec(code, reply_ns)                                   # noqa: S102
    assert not judge.judge(cases, sent[-1]).passed              # judged with the grader's own comparison


def test_a_reply_is_plain_data_only():
    cases = [judge.Case("c", expected=np.ones(3))]
    import base64
    import io
    import pickle
    buf = io.BytesIO()
    np.save(buf, np.array([object()], dtype=object), allow_pickle=True)
    for part in ({"nd": base64.b64encode(buf.getvalue()).decode()},
                 {"nd": base64.b64encode(pickle.dumps(np.ones(3))).decode()},
                 {"nd": "x" * (judge.MAX_BYTES * 2)}, {"s": 3}, 17):
        verdict = judge.judge(cases, {"cases": [{"parts": [part]}]})
        assert not verdict.passed and verdict.status == "bad-data", part
    assert judge.exception_name("LeakError") == "an exception of the notebook's own class"
    assert judge.exception_name("ValueError: secret") == "an exception of the notebook's own class"
    assert judge.exception_name("ValueError") == "ValueError"


@pytest.fixture(scope="module")
def wheel_and_kit(tmp_path_factory):
    import kit
    out = tmp_path_factory.mktemp("kit")
    wheel = kit.build_wheel(out)
    return wheel, kit.build_kit(out, "student", wheel=wheel)


def test_the_hidden_cases_are_not_in_the_student_wheel_or_kit(wheel_and_kit):
    sentinel = hidden.SENTINEL.encode()              # a line found only in tools/grading/hidden/
    assert sentinel in (ROOT / "tools" / "grading" / "hidden" / "__init__.py").read_bytes()
    for archive in wheel_and_kit:
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                assert "hidden" not in name and "grading" not in name, (archive.name, name)
                data = z.read(name)
                if name.endswith(".whl"):
                    inner = zipfile.ZipFile(__import__("io").BytesIO(data))
                    assert not any(sentinel in inner.read(n) for n in inner.namelist())
                assert sentinel not in data, (archive.name, name)


def test_an_answer_that_calls_the_package_is_flagged_for_review_and_a_correct_one_is_not(tmp_path):
    import make_grade_fixtures
    import nbformat
    from grading.grader import Submission, read_submission, review_flags
    chapters = book.read_book(ROOT)
    make_grade_fixtures.make_fixtures(tmp_path, None, ROOT)
    for stem, ch in chapters.items():
        sub = Submission("correct", tmp_path / "correct" / f"{stem}.ipynb", "x")
        read_submission(sub)
        assert review_flags(sub, ch) == {}, stem
    path = tmp_path / "correct" / f"{CHAPTER}.ipynb"
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "def kda_chunk" in c.source)
    cell.source = ("def kda_chunk(q, k, v, beta, log_gate, state):\n"
                   "    return dr.kda_loop(q, k, v, beta=beta, log_gate=log_gate, initial_state=state)\n")
    halving = next(c for c in nb.cells if c.cell_type == "code" and "error_after_three =" in c.source)
    halving.source += "\nerror_after_three = ANSWERS['ex-dr-halving']['value']\n"
    nbformat.write(nb, path)
    sub = Submission("cheat", path, "x")
    read_submission(sub)
    flags = review_flags(sub, chapters[CHAPTER])
    assert "`dr.kda_loop`" in flags["ex-dr-ut-solve"] and "`ANSWERS`" in flags["ex-dr-halving"]
