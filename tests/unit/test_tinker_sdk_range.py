"""tandemrl/tinker/sdk_range.py: which SDK a request names, the refusal of an older one, one warning per newer
one; NEWEST is the SDK of the lock. tests/integration/test_tinker_compat.py runs the real SDKs against a real server."""

from __future__ import annotations

import logging
from importlib.metadata import version

import pytest

from tandemrl.tinker.sdk_range import NEWEST, OLDEST, SdkRange, release, sdk_version


def test_newest_is_the_installed_sdk_of_the_lock() -> None:
    assert version("tinker") == NEWEST
    oldest, newest = release(OLDEST), release(NEWEST)
    assert oldest is not None and newest is not None and oldest < newest


def test_release_reads_the_numbers_of_a_version() -> None:
    assert release("0.38.0") == (0, 38, 0)
    assert release("0.40.0rc1") == (0, 40, 0)
    assert release("1.2") == (1, 2, 0)
    assert release("dev") is None


def test_sdk_version_is_the_stainless_header_else_the_user_agent() -> None:
    assert sdk_version({"X-Stainless-Package-Version": "0.30.1", "User-Agent": "Tinker/Python 0.1.0"}) == "0.30.1"
    assert sdk_version({"User-Agent": "AsyncTinker/Python 0.19.0"}) == "0.19.0"
    assert sdk_version({"User-Agent": "python-requests/2.32.3"}) is None
    assert sdk_version({}) is None


def test_older_sdks_are_refused_in_one_line_and_newer_ones_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    gate = SdkRange("0.20.0", "0.38.0")
    assert gate.refusal("0.19.0") == (
        "tinker SDK 0.19.0 is outside the versions tinker-serve supports (0.20.0 to 0.38.0); "
        "pip install 'tinker>=0.20.0,<=0.38.0'"
    )
    for served in (None, "0.20.0", "0.38.0", "not-a-version"):
        assert gate.refusal(served) is None
    with caplog.at_level(logging.WARNING, logger="tandemrl.tinker"):
        assert gate.refusal("0.40.0") is None
        assert gate.refusal("0.40.0") is None
        assert gate.refusal("1.0.0") is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("tinker-serve: tinker SDK 0.40.0 is newer than the versions tinker-serve is tested")
    assert "(0.20.0 to 0.38.0); serving it anyway" in lines[0]
    assert "tinker SDK 1.0.0 is newer" in lines[1]
