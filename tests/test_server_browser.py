"""The playground page in a real headless Chromium (Debian's chromium + chromium-driver, driven
by selenium): type a prompt, press Generate, tokens stream in coloured by source, and the text
is exactly the engine's greedy output. Runs on the real default model with its shipped drafter
(mtp+ngram), so MTP and lookup drafts both get accepted. Skips, saying why, without a browser.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'specdraft[serve]')")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")

from test_server import running_server  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
PROMPT = "Here is a Python function that checks whether a number is prime:\n\ndef is_prime(n):"
MAX_TOKENS = 64


def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("no Chromium: apt-get install -y chromium chromium-driver (make install-test does)")
    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1100,900"):
        opts.add_argument(flag)
    # The driver is given explicitly: selenium must not try to download one.
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)


@pytest.mark.slow
def test_playground_streams_tokens_coloured_by_source(real_runtime, tmp_path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from specdraft.drafters import load_drafter
    from specdraft.serve import ServedModel
    from specdraft.speculative.engine import Engine

    rt = real_runtime
    drafter, kind, k = load_drafter(rt, "auto", None, None)
    assert kind == "mtp+ngram"
    want = Engine(rt.model, rt.tokenizer).generate([rt.tokenizer.encode(PROMPT)], MAX_TOKENS)[0]
    engine = Engine(rt.model, rt.tokenizer, drafter, k, max_batch_size=2, capacity=512)
    driver = browser()
    try:
        with running_server(ServedModel("gemma3-270m", engine, rt.tokenizer, kind, k)) as url:
            driver.get(url + "/")
            WebDriverWait(driver, 20).until(lambda d: "gemma3-270m" in d.find_element(By.ID, "model").text)
            box = driver.find_element(By.ID, "prompt")
            box.clear()
            box.send_keys(PROMPT)
            tokens_box = driver.find_element(By.ID, "max-tokens")
            tokens_box.clear()
            tokens_box.send_keys(str(MAX_TOKENS))
            driver.find_element(By.ID, "go").click()
            WebDriverWait(driver, 120).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-done"))
            shot = tmp_path / "playground.png"
            driver.save_screenshot(str(shot))
            if os.environ.get("SPECDRAFT_SCREENSHOT"):  # keep a copy to look at
                shutil.copy(shot, Path(os.environ["SPECDRAFT_SCREENSHOT"]))
            assert driver.find_element(By.ID, "error").text == ""
            spans = driver.find_elements(By.CSS_SELECTOR, "#output span[data-source]")
            text = "".join(s.get_attribute("textContent") for s in spans)
            sources = [s.get_attribute("data-source") for s in spans]
            colours = {src: s.value_of_css_property("background-color") for s, src in zip(spans, sources)}
            stats = {i: driver.find_element(By.ID, i).text for i in ("tokens", "rate", "tau", "finish")}
    finally:
        driver.quit()
    assert text == want.text  # the streamed text is exactly plain greedy decoding's
    assert "target" in sources and ("mtp" in sources or "lookup" in sources), sources
    assert len(set(colours.values())) == len(colours)  # one colour per source
    assert int(stats["tokens"]) == len(want.token_ids)
    assert float(stats["tau"]) > 1.0 and float(stats["rate"]) > 0
    assert stats["finish"] in ("length", "stop")
    assert shot.stat().st_size > 10_000
