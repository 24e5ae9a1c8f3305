"""Where `modelship load` sends: the gateway by default, the servers with --direct or
--canary, and the servers when the stack has no gateway; and its exit code."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from modelship.cli.fleet import _load_exit_code, _load_targets

SETTINGS = SimpleNamespace(gateway_url="http://127.0.0.1:9000",
                           gateway_grpc="127.0.0.1:9001")
NO_GATEWAY = SimpleNamespace(gateway_url=None, gateway_grpc=None)
SERVERS = [SimpleNamespace(endpoint=SimpleNamespace(http=f"http://127.0.0.1:80{i}0",
                                                    grpc=f"127.0.0.1:80{i}1"))
           for i in (1, 2)]


@pytest.mark.parametrize(("settings", "protocol", "gateway", "urls", "via"), [
    (SETTINGS, "grpc", True, ["127.0.0.1:9001"], "gateway"),
    (SETTINGS, "http", True, ["http://127.0.0.1:9000"], "gateway"),
    (SETTINGS, "grpc", False, ["127.0.0.1:8011", "127.0.0.1:8021"], "replicas"),
    (SETTINGS, "http", False, ["http://127.0.0.1:8010", "http://127.0.0.1:8020"],
     "replicas"),
    (NO_GATEWAY, "grpc", True, ["127.0.0.1:8011", "127.0.0.1:8021"], "replicas"),
    (NO_GATEWAY, "http", True, ["http://127.0.0.1:8010", "http://127.0.0.1:8020"],
     "replicas"),
])
def test_load_goes_through_the_gateway_unless_told_or_there_is_none(
        settings: SimpleNamespace, protocol: str, gateway: bool, urls: list[str],
        via: str) -> None:
    assert _load_targets(settings, SERVERS, protocol, gateway=gateway,
                         via="replicas") == (urls, via)


@pytest.mark.parametrize(("requests", "errors", "budget", "code", "said"), [
    (0, 0, 0.0, 1, ""),  # nothing answered: the run measured nothing
    (100, 0, 0.0, 0, ""),
    (100, 1, 0.0, 1, "1 of 100 requests failed (1.00% > --max-error-rate 0)"),
    (100, 1, 0.01, 0, ""),  # at the budget: within it
    (100, 2, 0.01, 1, "2 of 100 requests failed"),
])
def test_the_exit_code_is_1_past_the_error_budget_or_when_nothing_answered(
        requests: int, errors: int, budget: float, code: int, said: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    doc = {"requests": requests, "errors": errors, "error_texts": {"timeout": errors}}
    assert _load_exit_code(doc, budget) == code
    err = capsys.readouterr().err
    assert said in err
    assert ("failed" in err) == (code == 1 and requests > 0)
