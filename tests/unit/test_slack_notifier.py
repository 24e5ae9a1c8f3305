"""Pure parts of the Slack edge: URL normalisation, argument checks, null notifier, parsing."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest

from modelship.errors import UsageError
from modelship.slack.client import SlackClient, web_api_base_url
from modelship.slack.emulator import ApiError, format_ts, parse_blocks, parse_body
from modelship.slack.notifier import Notifier, NullNotifier, SlackNotifier


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000/api/"),
        ("http://127.0.0.1:5000/", "http://127.0.0.1:5000/api/"),
        ("http://127.0.0.1:5000/api", "http://127.0.0.1:5000/api/"),
        ("http://127.0.0.1:5000/api/", "http://127.0.0.1:5000/api/"),
        ("https://slack.com/api/", "https://slack.com/api/"),
        (" https://proxy.example/slack ", "https://proxy.example/slack/api/"),
    ],
)
def test_web_api_base_url(given: str, expected: str) -> None:
    assert web_api_base_url(given) == expected


@pytest.mark.parametrize("bad", ["", "127.0.0.1:5000", "ftp://host/api/", "http://"])
def test_web_api_base_url_refuses_non_http(bad: str) -> None:
    with pytest.raises(UsageError) as caught:
        web_api_base_url(bad)
    assert caught.value.hint


def test_client_constructor_does_no_io_and_checks_arguments() -> None:
    # Port 9 (discard) on loopback: nothing is contacted until a method is called.
    client = SlackClient("http://127.0.0.1:9", "xoxb-x", timeout_s=0.25)
    assert client.base_url == "http://127.0.0.1:9/api/"
    with pytest.raises(UsageError):
        SlackClient("http://127.0.0.1:9", "  ", timeout_s=1)
    with pytest.raises(UsageError):
        SlackClient("http://127.0.0.1:9", "xoxb-x", timeout_s=0)


def test_upload_of_missing_path_is_a_usage_error(tmp_path: Any) -> None:
    client = SlackClient("http://127.0.0.1:9", "xoxb-x", timeout_s=0.25)
    with pytest.raises(UsageError) as caught:
        client.upload_file("#c", tmp_path / "missing.png", "missing.png")
    assert "missing.png" in caught.value.message


def test_null_notifier_returns_no_thread() -> None:
    notifier: Notifier = NullNotifier()
    assert notifier.post("hello") is None
    assert notifier.post("hello", blocks=[{"type": "divider"}], thread_ts="1.000001") is None


@pytest.mark.parametrize("cls", [SlackNotifier, NullNotifier])
@pytest.mark.parametrize("method", ["post", "update", "upload"])
def test_every_notifier_has_the_protocols_signatures(cls: type, method: str) -> None:
    # the annotations were the only check (mypy); a drifted keyword breaks callers at run time
    assert inspect.signature(getattr(cls, method)) == inspect.signature(getattr(Notifier, method))
    client = SlackClient("http://127.0.0.1:9", "xoxb-x", timeout_s=0.25)
    notifier = SlackNotifier(client, "#releases") if cls is SlackNotifier else NullNotifier()
    assert notifier.channel == ("#releases" if cls is SlackNotifier else None)


@pytest.mark.parametrize(
    ("micros", "ts"),
    [(1_732_990_000_000_100, "1732990000.000100"), (1_000_000, "1.000000"), (999_999, "0.999999")],
)
def test_format_ts(micros: int, ts: str) -> None:
    assert format_ts(micros) == ts


BLOCKS = [{"type": "section", "text": {"type": "mrkdwn", "text": "hi"}}]


@pytest.mark.parametrize("raw", [BLOCKS, json.dumps(BLOCKS)])
def test_parse_blocks_accepts_list_or_json_string(raw: Any) -> None:
    assert parse_blocks(raw) == BLOCKS


@pytest.mark.parametrize("raw", [None, ""])
def test_parse_blocks_absent(raw: Any) -> None:
    assert parse_blocks(raw) is None


@pytest.mark.parametrize(
    "raw",
    ["not json", json.dumps({"type": "section"}), [{"text": "no type"}], ["x"],
     [{"type": "divider"}] * 51],
)
def test_parse_blocks_refuses_what_slack_refuses(raw: Any) -> None:
    with pytest.raises(ApiError) as caught:
        parse_blocks(raw)
    assert caught.value.code == "invalid_blocks"


def test_parse_body_encodings() -> None:
    assert parse_body("application/json; charset=utf-8", b'{"a": [1]}') == {"a": [1]}
    assert parse_body("application/x-www-form-urlencoded", b"a=1&b=&c=x%20y") == {
        "a": "1",
        "b": "",
        "c": "x y",
    }
    assert parse_body("", b"") == {}
    with pytest.raises(ApiError) as caught:
        parse_body("application/json", b"[1, 2]")
    assert caught.value.code == "invalid_json"
