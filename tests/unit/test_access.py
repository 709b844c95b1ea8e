"""shared/access.py: where jobs may read from, which job ids exist, the token, and redaction. Real folders and
symlinks in tmp_path; no server."""

import hmac
import os
import stat
from pathlib import Path

import pytest

from shared import access, urls
from shared.access import AccessDenied
from shared.errors import ConfigurationError
from shared.settings import Settings

TOKEN = "0123456789abcdef-test-token"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """roots/data/ (a dataset root) with a dataset, secret/ outside it, and links from inside to both."""
    (tmp_path / "roots" / "data" / "sub").mkdir(parents=True)
    (tmp_path / "roots" / "data" / "chats.jsonl").write_text("{}\n")
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "passwd").write_text("root:x:0:0\n")
    (tmp_path / "roots" / "data" / "escape").symlink_to(tmp_path / "secret")
    (tmp_path / "roots" / "data" / "inside.jsonl").symlink_to(tmp_path / "roots" / "data" / "chats.jsonl")
    (tmp_path / "store").mkdir()
    return tmp_path


def settings_for(tree: Path, **fields: object) -> Settings:
    defaults: dict[str, object] = {
        "home": tree / "home",
        "storage_url": (tree / "store").as_uri(),
        "dataset_roots": [str(tree / "roots" / "data")],
    }
    return Settings(_env_file=None, **(defaults | fields))


# ----------------------------------------------------------------------------------------------------------
# Datasets


def test_a_dataset_under_a_root_is_read_at_its_resolved_path(tree: Path) -> None:
    settings = settings_for(tree)
    data = tree / "roots" / "data" / "chats.jsonl"
    assert access.confine_dataset_url(str(data), settings) == str(data)
    assert access.confine_dataset_url(data.as_uri(), settings) == str(data)
    assert access.confine_dataset_url(str(tree / "roots" / "data" / "sub" / ".." / "chats.jsonl"), settings) == str(
        data
    )
    assert access.confine_dataset_url(str(tree / "roots" / "data" / "inside.jsonl"), settings) == str(data)


@pytest.mark.parametrize(
    "relative",
    [
        pytest.param("secret/passwd", id="outside"),
        pytest.param("roots/data/../../secret/passwd", id="dot-dot"),
        pytest.param("roots/data/escape/passwd", id="symlink-out"),
        pytest.param("roots/data-private/x.jsonl", id="sibling-with-the-root-as-prefix"),
    ],
)
def test_a_local_dataset_outside_the_roots_is_refused_naming_the_rule(tree: Path, relative: str) -> None:
    with pytest.raises(AccessDenied, match=r"is outside the dataset roots .*EAGLE3_DATASET_ROOTS"):
        access.confine_dataset_url(str(tree / relative), settings_for(tree))


def test_without_dataset_roots_only_the_storage_root_is_readable(tree: Path) -> None:
    settings = settings_for(tree, dataset_roots=[])
    with pytest.raises(AccessDenied, match="outside the dataset roots"):
        access.confine_dataset_url(str(tree / "roots" / "data" / "chats.jsonl"), settings)
    upload = tree / "store" / "job-1" / "dataset.jsonl"  # where POST /v1/jobs/upload keeps a dataset
    assert access.confine_dataset_url(upload.as_uri(), settings) == str(upload)


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        pytest.param("http://example.com/data.jsonl", "unsupported scheme 'http'", id="http"),
        pytest.param("file://otherhost/etc/passwd", "a file:// URL names a local path", id="file-with-host"),
        pytest.param("s3://other-bucket/data.jsonl", "must be in the storage bucket", id="other-bucket"),
    ],
)
def test_other_schemes_hosts_and_buckets_are_refused(tree: Path, url: str, rule: str) -> None:
    with pytest.raises(AccessDenied, match=rule):
        access.confine_dataset_url(url, settings_for(tree))


def test_s3_datasets_come_from_the_storage_bucket_or_an_s3_root(tree: Path) -> None:
    settings = settings_for(tree, storage_url="s3://jobs-bucket/prefix", dataset_roots=["s3://team/chat"])
    for url in ("s3://jobs-bucket/anywhere/data.jsonl", "s3://team/chat/data.jsonl"):
        assert access.confine_dataset_url(url, settings) == url
    for url in ("s3://team/chat-private/data.jsonl", "s3://team/other.jsonl", "s3://jobs-bucket/"):
        with pytest.raises(AccessDenied, match="s3:// objects must be in the storage bucket"):
            access.confine_dataset_url(url, settings)


def test_a_url_with_credentials_is_refused_without_repeating_them(tree: Path) -> None:
    settings = settings_for(tree, storage_url="s3://jobs-bucket/prefix")
    with pytest.raises(AccessDenied, match="credentials in a URL are refused") as caught:
        access.confine_dataset_url("s3://AKIAEXAMPLE:wJalrXUtnFEMI@jobs-bucket/data.jsonl", settings)
    assert "wJalrXUtnFEMI" not in str(caught.value) and "AKIAEXAMPLE" not in str(caught.value)


def test_output_urls_follow_the_dataset_rules(tree: Path) -> None:
    settings = settings_for(tree)
    access.confine_output_url(None, settings)
    access.confine_output_url(str(tree / "roots" / "data" / "regenerated.jsonl"), settings)
    with pytest.raises(AccessDenied, match=r"output_url .* is outside the dataset roots"):
        access.confine_output_url(str(tree / "secret" / "authorized_keys"), settings)


def test_dataset_roots_read_from_the_environment_as_a_list_or_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_DATASET_ROOTS", "/srv/a, s3://b/c")
    assert Settings(_env_file=None).dataset_roots == ["/srv/a", "s3://b/c"]
    monkeypatch.setenv("EAGLE3_DATASET_ROOTS", '["/srv/a"]')
    assert Settings(_env_file=None).dataset_roots == ["/srv/a"]
    monkeypatch.delenv("EAGLE3_DATASET_ROOTS")
    assert Settings(_env_file=None).dataset_roots == []


# ----------------------------------------------------------------------------------------------------------
# Models


def test_models_default_to_the_configured_model_folder_and_home_models(tree: Path) -> None:
    (tree / "models" / "target").mkdir(parents=True)
    (tree / "home" / "models" / "smollm2").mkdir(parents=True)
    settings = settings_for(tree, model_path=tree / "models" / "target")
    assert access.model_roots(settings) == [tree / "models", tree / "home" / "models"]
    assert access.confine_model_path(str(tree / "models" / "target"), settings) == tree / "models" / "target"
    assert access.confine_model_path(str(tree / "home" / "models" / "smollm2"), settings).name == "smollm2"
    for outside in (tree / "secret", tree / "models" / ".." / "secret", tree / "roots" / "data" / "escape"):
        with pytest.raises(AccessDenied, match=r"outside the model roots .*EAGLE3_MODEL_ROOTS"):
            access.confine_model_path(str(outside), settings)
    with pytest.raises(AccessDenied, match="must be a local folder"):
        access.confine_model_path("s3://bucket/model", settings)


def test_configured_model_roots_replace_the_defaults(tree: Path) -> None:
    settings = settings_for(tree, model_path=tree / "models" / "target", model_roots=[tree / "roots"])
    assert access.confine_model_path(str(tree / "roots" / "data"), settings) == tree / "roots" / "data"
    with pytest.raises(AccessDenied):
        access.confine_model_path(str(tree / "models" / "target"), settings)


# ----------------------------------------------------------------------------------------------------------
# Job ids, hosts, redaction


@pytest.mark.parametrize("job_id", ["job-20261201-153000-abc123", "uploaded", "a.b_c-d", "x" * 64])
def test_valid_job_ids(job_id: str) -> None:
    assert access.is_valid_job_id(job_id)


@pytest.mark.parametrize(
    "job_id",
    [
        pytest.param("..", id="dot-dot"),
        pytest.param("../etc", id="traversal"),
        pytest.param("a/b", id="slash"),
        pytest.param(".hidden", id="leading-dot"),
        pytest.param("-flag", id="leading-dash"),
        pytest.param("", id="empty"),
        pytest.param("x" * 65, id="too-long"),
        pytest.param("a b", id="space"),
        pytest.param("job\n", id="newline"),
        pytest.param("a\x00b", id="nul"),
    ],
)
def test_invalid_job_ids(job_id: str) -> None:
    assert not access.is_valid_job_id(job_id)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("192.168.1.5", False), ("producer", False)],
)  # fmt: skip
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert urls.is_loopback(host) is loopback


def test_redaction_hides_userinfo_and_nothing_else() -> None:
    assert urls.redact_url("redis://:hunter2@redis:6379/0") == "redis://***@redis:6379/0"
    assert urls.redact_url("error at rediss://user:pw@h:1/0 and s3://AK:SK@b/k") == (
        "error at rediss://***@h:1/0 and s3://***@b/k"
    )
    for plain in ("redis://127.0.0.1:6379/0", "file:///data/a@b.jsonl", "s3://bucket/key@v1"):
        assert urls.redact_url(plain) == plain


# ----------------------------------------------------------------------------------------------------------
# The token


def test_the_api_does_not_start_open(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="EAGLE3_API_TOKEN is not set, and the API does not start open"):
        access.check_api_settings(Settings(_env_file=None, home=tmp_path))
    access.check_api_settings(Settings(_env_file=None, home=tmp_path, api_token=TOKEN))
    access.check_api_settings(Settings(_env_file=None, home=tmp_path, api_auth="off"))


def test_auth_off_is_refused_off_loopback(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"EAGLE3_API_AUTH=off is accepted only .* EAGLE3_API_HOST=0.0.0.0"):
        Settings(_env_file=None, api_auth="off", api_host="0.0.0.0")
    # A copy skips validation; the producer checks again at start.
    copied = Settings(_env_file=None, home=tmp_path, api_auth="off").model_copy(update={"api_host": "0.0.0.0"})
    with pytest.raises(ConfigurationError, match="EAGLE3_API_AUTH=off is accepted only"):
        access.check_api_settings(copied)


@pytest.mark.parametrize(
    "token",
    ["", "changethis", "<output of: openssl rand -hex 32>", "short-token", "   " + "x" * 5 + "   "],
)
def test_empty_example_and_short_tokens_are_refused(token: str) -> None:
    with pytest.raises(ValueError, match="EAGLE3_API_TOKEN is empty, an example value or shorter than 16"):
        Settings(_env_file=None, api_token=token)


def test_token_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(_env_file=None, api_token=TOKEN)
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(access.hmac, "compare_digest", recording)
    assert access.token_matches(TOKEN, settings)
    assert not access.token_matches(TOKEN[:-1] + "X", settings)
    assert not access.token_matches(None, settings)
    assert not access.token_matches(TOKEN, Settings(_env_file=None))
    assert compared == [(TOKEN.encode(), TOKEN.encode()), ((TOKEN[:-1] + "X").encode(), TOKEN.encode())]


def test_settings_repr_hides_the_token_and_url_passwords() -> None:
    settings = Settings(
        _env_file=None,
        api_token=TOKEN,
        redis_url="redis://:hunter2-redis@redis:6379/0",
        s3_endpoint_url="http://u:pw@s3",
    )
    for text in (repr(settings), str(settings)):
        assert TOKEN not in text and "hunter2-redis" not in text and ":pw@" not in text
        assert "redis://***@redis:6379/0" in text
    assert settings.redis_url == "redis://:hunter2-redis@redis:6379/0"  # the value itself is intact


def test_the_session_token_is_private_and_sent_only_to_its_own_api(tmp_path: Path) -> None:
    settings = Settings(_env_file=None, home=tmp_path, api_url="http://127.0.0.1:8123")
    assert access.client_token(settings) is None and access.auth_headers(settings) == {}
    path = access.write_session_token(settings, "http://127.0.0.1:8123", TOKEN)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert access.auth_headers(settings) == {"Authorization": f"Bearer {TOKEN}"}
    elsewhere = settings.model_copy(update={"api_url": "http://api.example.com:8000"})
    assert access.client_token(elsewhere) is None
    configured = settings.model_copy(update={"api_token": Settings(_env_file=None, api_token="y" * 20).api_token})
    assert access.client_token(configured) == "y" * 20  # EAGLE3_API_TOKEN wins over the session file
