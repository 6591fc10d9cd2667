"""Headless Debian chromium driven by selenium, for the browser tests; they skip when it is missing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

CHROMEDRIVER = "/usr/bin/chromedriver"


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def browser():
    """A headless chromium ``webdriver.Chrome`` that records console messages; skips if unavailable."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    binary = chromium_binary()
    if binary is None or not Path(CHROMEDRIVER).exists():
        pytest.skip("chromium / chromium-driver are not installed (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1400"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def console_errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def assert_not_blank(png: Path) -> None:
    """The screenshot has real content: many distinct colours, not one flat fill."""
    from PIL import Image

    img = Image.open(png).convert("RGB")
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 20, (f"{png} looks blank ({colours and len(colours)} "
                                                       "colours)")
    lo, hi = img.convert("L").getextrema()
    assert hi - lo > 100, f"{png} has no contrast"
