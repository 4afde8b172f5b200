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
