"""Assertions shared by the hardening tests: a command either succeeds or fails with exactly one `Error:` line."""

from __future__ import annotations

from click.testing import CliRunner
from hypothesis import settings

from k3compile.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def crashed(r) -> bool:
    """CliRunner catches exceptions instead of printing their traceback: any exception but SystemExit is a crash."""
    return r.exception is not None and not isinstance(r.exception, SystemExit)


def one_line_error(r, msg: str | None = None) -> str:
    """Exit status nonzero, no traceback, exactly one `Error:` line (containing msg); returns that line."""
    assert not crashed(r), f"traceback instead of an error line: {r.exception!r}\n{r.output}"
    assert r.exit_code != 0, r.output
    assert "Traceback" not in r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, r.output
    if msg is not None:
        assert msg in errors[0], r.output
    return errors[0]


def ok_or_one_line_error(r) -> bool:
    """The property of every command on any input: exit 0, or one `Error:` line and a nonzero exit. True on 0."""
    if r.exit_code == 0 and not crashed(r):
        return True
    one_line_error(r)
    return False


def examples(n: int) -> int:
    """A property test's example count, scaled by the active Hypothesis profile (the default profile's 100 = n;
    `--hypothesis-profile thorough` multiplies it by 8). An explicit max_examples would override any profile."""
    return max(1, n * settings.default.max_examples // 100)
