"""TTC_* parsing: every odd value falls back to the documented default with a message, never raises."""

from __future__ import annotations

import pytest

from torch_threadsafe_compile._env import read_settings


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "Yes", "on", " ON ", "all"])
def test_disable_true_values(value: str) -> None:
    s = read_settings({"TTC_DISABLE": value})
    assert s.disabled and not s.problems


@pytest.mark.parametrize("value", ["", "0", "false", "No", "off"])
def test_disable_false_values(value: str) -> None:
    s = read_settings({"TTC_DISABLE": value})
    assert not s.disabled and not s.disabled_patches and not s.problems


def test_disable_patch_list() -> None:
    s = read_settings({"TTC_DISABLE": "first_compile, fx-tracing-flag"})
    assert not s.disabled
    assert s.disabled_patches == {"first_compile", "fx_tracing_flag"}


@pytest.mark.parametrize("value", ["!!", "2;rm -rf", "\u00e9t\u00e9 ?"])
def test_disable_garbage_is_reported_and_ignored(value: str) -> None:
    s = read_settings({"TTC_DISABLE": value})
    assert not s.disabled and not s.disabled_patches
    assert len(s.problems) == 1 and "TTC_DISABLE" in s.problems[0]


def test_log_levels() -> None:
    assert read_settings({"TTC_LOG": "DEBUG"}).log_level == "debug"
    s = read_settings({"TTC_LOG": "loud"})
    assert s.log_level is None and "TTC_LOG" in s.problems[0]


@pytest.mark.parametrize("value,expected", [("30", 30.0), ("0.5", 0.5), ("0", None), ("off", None)])
def test_watchdog_values(value: str, expected: float | None) -> None:
    s = read_settings({"TTC_WATCHDOG": value})
    assert s.watchdog_s == expected and not s.problems


@pytest.mark.parametrize("value", ["-3", "inf", "nan", "soon"])
def test_watchdog_garbage(value: str) -> None:
    s = read_settings({"TTC_WATCHDOG": value})
    assert s.watchdog_s is None and "TTC_WATCHDOG" in s.problems[0]


@pytest.mark.parametrize("value", ["1e-6", "0.01", "0.099"])
def test_watchdog_bound_below_minimum_is_refused(value: str) -> None:
    """Issue 28 (9): a bound this short makes the watchdog a busy loop that reports every ordinary compile."""
    s = read_settings({"TTC_WATCHDOG": value})
    assert s.watchdog_s is None and "TTC_WATCHDOG" in s.problems[0] and ">= 0.1" in s.problems[0]


def test_long_bad_value_is_quoted_short() -> None:
    """Issue 28 (9): a 100 KB value is not echoed in full; the line says how long it was."""
    s = read_settings({"TTC_LOG": "x" * 100_000})
    assert len(s.problems) == 1 and len(s.problems[0]) < 200 and "100000 characters" in s.problems[0]


def test_every_bad_variable_is_reported() -> None:
    """Issue 28 (9): all bad variables in the one line, unknown patch ids included (they used to be reported
    later, at torch's import, where the one warning line was already spent)."""
    s = read_settings({"TTC_DISABLE": "first_compile,no_such_patch", "TTC_LOG": "loud", "TTC_WATCHDOG": "soon"})
    assert s.disabled_patches == {"first_compile", "no_such_patch"}
    joined = "; ".join(s.problems)
    assert "no_such_patch" in joined and "TTC_LOG" in joined and "TTC_WATCHDOG" in joined


def test_every_bad_variable_reaches_the_one_warning_line() -> None:
    from conftest import run_py

    p = run_py("import torch, torch._dynamo", env={"TTC_DISABLE": "no_such_patch", "TTC_LOG": "loud"})
    ours = [line for line in p.stderr.splitlines() if "torch-threadsafe-compile" in line]
    assert p.returncode == 0 and len(ours) == 1, p.stderr[-2000:]
    assert "no_such_patch" in ours[0] and "TTC_LOG" in ours[0]
