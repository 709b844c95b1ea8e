"""Settings: one model, read from EAGLE3_* variables, with defaults that follow each other."""

from pathlib import Path

import pytest

from shared.settings import Settings


def test_embedded_storage_lives_under_home_unless_a_storage_url_is_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("EAGLE3_STORAGE_URL", raising=False)
    monkeypatch.setenv("EAGLE3_HOME", str(tmp_path / "state"))
    assert Settings().storage_url == (tmp_path / "state" / "storage").as_uri()

    monkeypatch.setenv("EAGLE3_STORAGE_URL", "s3://bucket/prefix")
    assert Settings().storage_url == "s3://bucket/prefix"


def test_visibility_timeout_must_outlast_the_retry_backoff() -> None:
    with pytest.raises(ValueError, match="visibility_timeout_s=600 must exceed twice retry_backoff_max_s=300"):
        Settings(visibility_timeout_s=600, retry_backoff_max_s=300)
