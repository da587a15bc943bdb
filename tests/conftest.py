"""pytest's hooks for the suite: the header names the hypothesis profile in use (tests/_examples.py)."""

from _examples import PROFILE


def pytest_report_header(config):
    return f"hypothesis examples: {PROFILE} profile (FIXEDSTATE_TEST_PROFILE)"
