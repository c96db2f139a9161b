"""A real headless browser for the dashboard's tests: Debian's Chromium driven through
Selenium and Debian's chromedriver (both installed with apt when missing, as Slurm is; nothing
is downloaded by Selenium itself, which is given the driver's path).

``chromium`` (fixture, one browser for a test module) skips when the packages cannot be
installed here (not root, no apt, no Debian mirror) or with ``FABRIC_SKIP_BROWSER=1``; on CI
(``CI=true``) the first fails instead. ``console_errors`` reads what the page logged at level
SEVERE (script errors, CSP violations, failed requests), which the tests require to be none.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.debian import InstallError, Unavailable, install_packages

PACKAGES = ("chromium", "chromium-driver")
COMMANDS = ("chromium", "chromedriver")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/usr/lib/chromium"])


def missing_commands() -> list[str]:
    return [c for c in COMMANDS if shutil.which(c, path=SEARCH_PATH) is None]


def install_or_skip() -> None:
    if os.environ.get("FABRIC_SKIP_BROWSER") == "1":
        pytest.skip("FABRIC_SKIP_BROWSER=1")
    try:
        took = install_packages(PACKAGES, missing_commands)
    except Unavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the dashboard's browser tests need Chromium: {exc}")
        pytest.skip(f"no Chromium here: {exc}")
    except InstallError as exc:
        pytest.fail(str(exc))
    if took:
        print(f"\nbrowser: installed {' '.join(PACKAGES)} in {took:.0f} s")


def new_driver(width: int = 1280, height: int = 900) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(shutil.which("chromium", path=SEARCH_PATH))
    for arg in (
        "--headless=new",
        "--no-sandbox",  # tests run as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",  # nothing but the page's own requests
        "--disable-component-update",
        "--disable-sync",
        f"--window-size={width},{height}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=str(shutil.which("chromedriver", path=SEARCH_PATH)))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(30)
    return driver


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    install_or_skip()
    driver = new_driver()
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver: Any) -> list[str]:
    """The SEVERE entries the page logged since the last call (the log is drained)."""
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def screenshot(driver: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(path))
    return path
