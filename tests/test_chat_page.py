"""The web chat page at ``/`` answers a message in headless Chromium (issue 22): static files from the
package (no CDN), the model picker filled from /v1/models, the reply streamed over the OpenAI API."""

from __future__ import annotations

import re

import httpx
import pytest

from forwardpass.assets import default_llm_path
from tests.helpers.browser import assert_not_blank, browser, console_errors
from tests.helpers.server import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("chat-page") / "serve.log"
    with ServerProcess(default_llm_path(), "--engine-backend", "thread", log_path=log) as srv:
        yield srv


def test_page_is_self_contained(server):
    html = httpx.get(server.url + "/").text
    assert "<title>forwardpass chat</title>" in html
    for ref in re.findall(r'(?:src|href)="([^"]+)"', html):
        assert ref.startswith(("/", "data:")), f"external resource {ref}"  # no CDN
        if ref.startswith("/chat/"):
            assert httpx.get(server.url + ref).status_code == 200
    assert httpx.get(server.url + "/chat/static/../app.py").status_code == 404


def test_page_answers_a_message(server, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser()
    try:
        driver.get(server.url + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
        options = [o.get_attribute("value") for o in driver.find_elements(By.CSS_SELECTOR, "#model option")]
        assert options == ["test-model"]
        driver.find_element(By.ID, "max-tokens").clear()
        driver.find_element(By.ID, "max-tokens").send_keys("24")
        box = driver.find_element(By.ID, "input")
        box.send_keys("Who is Elizabeth?")
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done='1']"))
        reply = driver.find_element(By.CSS_SELECTOR, ".msg.assistant .text").text
        assert reply.strip(), "empty reply"
        assert driver.find_element(By.CSS_SELECTOR, ".msg.user .text").text == "Who is Elizabeth?"
        assert "tok/s" in driver.find_element(By.ID, "stats").text  # usage arrived on the stream
        assert not driver.find_element(By.ID, "error").is_displayed()
        # a second turn carries the first as history
        box.send_keys("And Darcy?")
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done='1']")) == 2)
        shot = tmp_path / "chat.png"
        driver.save_screenshot(str(shot))
        assert_not_blank(shot)
        assert console_errors(driver) == []
    finally:
        driver.quit()
