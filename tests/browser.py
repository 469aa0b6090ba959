"""Headless Chromium (Debian's package) driven by Selenium, for the tests that look at what a browser
shows: nerfstudio's viser viewer (tests/viewer/) and the web viewers of our exports (tests/export/)."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
from PIL import Image

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def _without_priority_boost(chromium: str, folder: Path) -> str:
    """Chromium run as root (CI, containers) raises its display threads to nice -8 (it has CAP_SYS_NICE),
    above the ns-train under test (nice 0) on the same cores, while its SwiftShader WebGL took 0.65-2.4
    cores here. Returns a wrapper that runs it without that capability (so at nice 0 like the rest), or
    ``chromium`` itself when there is nothing to drop (not root) or no setpriv."""
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"):
        return chromium
    wrapper = folder / "chromium-without-sys-nice"
    drop = "/usr/bin/setpriv --bounding-set=-sys_nice --inh-caps=-sys_nice --"
    wrapper.write_text(f'#!/bin/sh\nexec {drop} {chromium} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


class Browser:
    """Headless Chromium (Debian's package) driven by Selenium through /usr/bin/chromedriver."""

    def __init__(self, profile: Path, width=1100, height=700):
        try:
            from selenium import webdriver
            from selenium.webdriver.chrome.service import Service
        except ImportError as e:  # a declared test dependency: pip install -e .[test]
            pytest.fail(f"selenium is not installed ({e}); scripts/setup.sh installs the test extras")
        options = webdriver.ChromeOptions()
        options.binary_location = _without_priority_boost(CHROMIUM, profile.parent)
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    # WebGL without a GPU: SwiftShader, which Chromium no longer falls back to by itself.
                    "--enable-unsafe-swiftshader", "--use-angle=swiftshader",
                    f"--user-data-dir={profile}", f"--window-size={width},{height}"):  # fmt: skip
            options.add_argument(arg)
        self.driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        self.driver.set_script_timeout(30)

    def viewport(self) -> Optional[np.ndarray]:
        """The 3D viewport's pixels (RGB float in [0, 1]) read from its WebGL canvas (viser keeps
        the drawing buffer), without the GUI panels drawn over it."""
        urls = self.driver.execute_script(
            "return Array.from(document.querySelectorAll('canvas')).map(c => {"
            " try { return c.toDataURL('image/png'); } catch (e) { return null; } });"
        )
        best = None
        for url in urls or []:
            if not url or "," not in url:
                continue
            image = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGBA"))
            if image.size == 0:
                continue
            opaque = int((image[..., 3] > 0).sum())
            if opaque and (best is None or opaque > best[0]):
                best = (opaque, image)
        return None if best is None else best[1][..., :3].astype(np.float32) / 255

    def click(self, text: str) -> bool:
        """Clicks the visible button labelled ``text``; False if there is none (yet), or if the GUI
        re-rendered it under our hands (the caller retries)."""
        from selenium.common.exceptions import StaleElementReferenceException
        from selenium.webdriver.common.by import By

        try:
            for button in self.driver.find_elements(By.TAG_NAME, "button"):
                if button.text.strip() == text and button.is_displayed():
                    button.click()
                    return True
        except StaleElementReferenceException:
            pass
        return False

    def shown(self, text: str) -> bool:
        """Whether a button labelled ``text`` is visible."""
        from selenium.common.exceptions import StaleElementReferenceException
        from selenium.webdriver.common.by import By

        try:
            buttons = self.driver.find_elements(By.TAG_NAME, "button")
            return any(button.text.strip() == text and button.is_displayed() for button in buttons)
        except StaleElementReferenceException:
            return False

    def quit(self):
        self.driver.quit()
