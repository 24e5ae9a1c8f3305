"""The Slack emulator's web view in a real headless Chromium (Debian's chromium and
chromium-driver, installed by `make install`; selenium from the dev extras).

A paused Prefect run waits for approval; its request is posted in the emulator as the
approve stage posts it. On the page, mallory's click is refused and told why, only to her;
alice's click on Approve goes, signed with the stack's secret, to the stack's approvals
endpoint, the run resumes, and the buttons become "Approved by @alice".
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from modelship.approvals.server import PrefectRuns
from modelship.clients import build_clients
from modelship.ledger import Ledger
from modelship.settings import Settings
from modelship.slack import blocks
from modelship.slack.client import SlackClient
from tests.integration.test_approvals_security import (
    _in_thread,
    _record,
    _wait_for,
    waiting_flow,
)

pytestmark = pytest.mark.e2e

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture()
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1200,1600"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def _message(driver: webdriver.Chrome, ts: str) -> Any:
    return driver.find_element(By.CSS_SELECTOR, f'.message[data-ts="{ts}"]')


def _click(driver: webdriver.Chrome, ts: str, selector: str) -> None:
    """Click a button of a message; the page redraws when any message changes, so an
    element found just before may be gone: find it again."""
    deadline = time.monotonic() + 15
    while True:
        try:
            _message(driver, ts).find_element(By.CSS_SELECTOR, selector).click()
            return
        except StaleElementReferenceException:
            if time.monotonic() > deadline:
                raise


def test_approve_from_the_web_view_resumes_the_run(stack_settings: Settings,
                                                   browser: webdriver.Chrome,
                                                   tmp_path: Path) -> None:
    settings = stack_settings
    clients = build_clients(settings)
    assert clients.storage is not None and settings.slack_token is not None
    runs = PrefectRuns(settings.prefect_api_url)
    box: dict[str, Any] = {}
    thread = _in_thread(waiting_flow, box, str(settings.prefect_api_url), 120)
    _wait_for(lambda: "id" in box and runs.state(box["id"]) == "PAUSED", 60, "the pause")
    release_id = f"web-{uuid.uuid4().hex[:8]}"
    try:
        # the request, posted in a release thread as the approve stage posts it
        slack = SlackClient(str(settings.slack_api_url),
                            settings.slack_token.get_secret_value(), timeout_s=10)
        root = slack.post_message("#releases", f"promote approvals-security -> v2 "
                                  f"({release_id}): running")
        ledger = Ledger(clients.storage)
        record = _record(ledger, box["id"], release_id=release_id)
        pending = record.approvals[-1]
        pending["expires_at_iso"] = "in 10 minutes"
        posted = slack.post_message("#releases", blocks.approval_text(pending),
                                    blocks=blocks.approval_blocks(pending, record.to_dict()),
                                    thread_ts=root.ts)
        pending["slack"] = {"channel": posted.channel, "ts": posted.ts, "thread_ts": root.ts}
        ledger.write(record)

        base = str(settings.slack_api_url).removesuffix("api/")
        browser.get(base)
        # bounds of waits that end at the event (a loaded machine renders slowly)
        wait = WebDriverWait(browser, 45,
                             ignored_exceptions=(StaleElementReferenceException,))
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR,
                                             f'.message[data-ts="{posted.ts}"] button.primary'))
        wait.until(lambda d: "Approve approvals-security v2?" in d.find_element(
            By.CSS_SELECTOR, f'.thread[data-thread="{root.ts}"]').text)

        Select(browser.find_element(By.ID, "user")).select_by_value("U0MALLORY")
        _click(browser, posted.ts, "button.primary")
        wait.until(lambda d: d.find_element(By.ID, "status").get_attribute("data-result")
                   == "refused")
        assert "not_an_approver" in browser.find_element(By.ID, "status").text
        wait.until(lambda d: "only visible to you" in d.find_element(
            By.CSS_SELECTOR, f'.thread[data-thread="{root.ts}"]').text)
        assert runs.state(box["id"]) == "PAUSED"

        Select(browser.find_element(By.ID, "user")).select_by_value("U0ALICE")
        wait.until(lambda d: "only visible to you" not in d.find_element(
            By.CSS_SELECTOR, f'.thread[data-thread="{root.ts}"]').text)  # mallory's only
        _click(browser, posted.ts, "button.primary")
        wait.until(lambda d: d.find_element(By.ID, "status").get_attribute("data-result")
                   == "accepted")
        thread.join(30)  # the paused run sees the resume at its next 1-s poll
        assert box.get("result", {}).get("user") == "U0ALICE", box
        wait.until(lambda d: "Approved by @alice" in _message(d, posted.ts).text)
        wait.until(lambda d: not _message(d, posted.ts).find_elements(By.CSS_SELECTOR,
                                                                       "button"))
        browser.save_screenshot(str(tmp_path / "web-view.png"))
        assert (tmp_path / "web-view.png").stat().st_size > 10_000
    finally:
        if thread.is_alive():
            runs.resume(box["id"], {"decision": "reject", "user": "cleanup",
                                    "release_id": release_id, "digest": {}})
            thread.join(10)
        clients.close()
    assert json.dumps(box["result"]["digest"]) == json.dumps(pending["digest"])
    assert time.time() < pending["expires_at"]
