"""shared/storage/locations.py: one file named three ways (a path, a file:// URL, an s3:// URL on a real SeaweedFS),
read by lines, replaced whole, asked whether it exists."""

from pathlib import Path

import pytest

from shared.errors import ConfigurationError
from shared.settings import Settings
from shared.storage import locations
from shared.storage.objects import ObjectNotFound


def names(tmp_path: Path, s3_server) -> list[tuple[str, Settings | None]]:
    bucket = s3_server.storage_url(f"loc-{tmp_path.name}").removeprefix("s3://").split("/")[0]
    return [
        (str(tmp_path / "a" / "data.jsonl"), None),
        ((tmp_path / "b" / "data.jsonl").as_uri(), None),
        (f"s3://{bucket}/c/data.jsonl", Settings(s3_endpoint_url=s3_server.endpoint_url)),
    ]


def test_a_file_is_written_whole_read_by_lines_and_found_whatever_names_it(
    tmp_path: Path, s3_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    for url, settings in names(tmp_path, s3_server):
        assert not locations.exists(url, settings)
        with pytest.raises(ObjectNotFound):
            list(locations.read_lines(url, settings))
        locations.write_whole(url, b'{"a": 1}\n{"b": 2}\n', settings)
        locations.write_whole(url, b'{"a": 1}\n{"b": 3}\n', settings)  # replaced, not appended
        assert locations.exists(url, settings)
        assert [line.rstrip(b"\n") for line in locations.read_lines(url, settings)] == [b'{"a": 1}', b'{"b": 3}']
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["data.jsonl"]  # no temporary file left behind


def test_another_scheme_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="unsupported scheme 'http'"):
        locations.write_whole("http://example.com/data.jsonl", b"", None)
