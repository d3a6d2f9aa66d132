#!/usr/bin/env python3
"""The HTML report in a real browser, and the training curves in TensorBoard's reader.

    report_browser.py CKPT_BINARY WORKDIR [SCREENSHOT.png]

1. Makes a sliced example checkpoint (uneven vocabulary, replicated norms, fused QKV,
   ZeRO-1 optimizer moments), asks `ckpt inspect --json` for its tensors and pieces,
   writes `ckpt inspect --html`, opens the report in headless Chromium and checks: the
   tensor count, every tensor's drawing (one group per piece, rectangles for the
   non-empty owners), sorting, filtering, no errors in the console. Saves a screenshot.
   Then the report of DeepSpeed's ZeRO-3 fixture: the same piece counts, each rank's
   flat range drawn as its runs (a partial row, whole rows, a partial row).
2. Trains a few steps with `ckpt train --out`, reads the event file with TensorBoard's
   own EventAccumulator and checks the loss curve against `ckpt train --json`.

Selenium drives Debian's `chromium` through Debian's `chromium-driver`: both come from
the same source package, so the driver always speaks the browser's protocol version.
Playwright would need its own Node driver and expects the Chromium revision it was built
against, which `playwright install` downloads from a CDN these machines cannot reach.
"""

import json
import os
import subprocess
import sys

# Absolute: the commands run with the scratch directory as their working directory.
CKPT, WORK = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
SHOT = sys.argv[3] if len(sys.argv) > 3 else os.path.join(WORK, "report.png")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ckpt(*args):
    r = subprocess.run([CKPT, *args], cwd=WORK, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"ckpt {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.stdout


def wait_rows(drv, n, what):
    """Waits until the table shows `n` rows (the filter runs 120 ms after typing)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(drv, 10).until(
            lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.row")) == n)
    except TimeoutException:
        sys.exit(f"{what}: want {n} rows, the page says "
                 f"{drv.find_element(By.ID, 'count').text!r} "
                 f"(filter {drv.find_element(By.ID, 'filter').get_attribute('value')!r})")


def browser_check():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    ckpt("example", "ex", "--mesh", "dp=2,tp=4", "--hidden", "16", "--vocab", "37",
         "--optimizer", "--force")
    doc = json.loads(ckpt("inspect", "ex", "--json"))
    tensors = {t["name"]: t for t in doc["tensors"]}
    report = os.path.join(WORK, "report.html")
    ckpt("inspect", "ex", "--html", report)

    opts = webdriver.ChromeOptions()
    opts.binary_location = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    for a in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1100,900"]:
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver"))
    drv = webdriver.Chrome(service=service, options=opts)
    try:
        drv.get("file://" + os.path.abspath(report))
        WebDriverWait(drv, 20).until(
            lambda d: d.execute_script("return document.body.dataset.ready") == "1")
        count = drv.find_element(By.ID, "count").text
        assert count == f"{len(tensors)} of {len(tensors)} tensors", count
        rows = drv.find_elements(By.CSS_SELECTOR, "tr.row")
        assert len(rows) == len(tensors), (len(rows), len(tensors))
        assert [r.find_element(By.TAG_NAME, "td").text for r in rows] == sorted(tensors)

        drawn = 0
        for i in range(len(rows)):
            row = drv.find_elements(By.CSS_SELECTOR, "tr.row")[i]
            name = row.find_element(By.TAG_NAME, "td").text
            row.click()
            detail = drv.find_element(By.CSS_SELECTOR, "tr.detail")
            groups = detail.find_elements(By.CSS_SELECTOR, "svg.pieces g.piece")
            pieces = tensors[name]["pieces"]
            assert len(groups) == len(pieces), (name, len(groups), len(pieces))
            with_rects = drv.execute_script(
                "return [...document.querySelectorAll('tr.detail g.piece')]"
                ".filter(g => g.querySelector('rect')).length")
            owners = [p for p in pieces if not p["copy"] and p["bytes"] > 0]
            assert with_rects == len(owners), (name, with_rects, len(owners))
            legend = detail.find_elements(By.CSS_SELECTOR, "tr.legend-row")
            assert len(legend) == len(pieces), (name, len(legend))
            drawn += with_rects
            row.click()  # closes it again
            assert not drv.find_elements(By.CSS_SELECTOR, "tr.detail"), name

        # Sort by bytes, largest first (two clicks), then filter.
        th = drv.find_element(By.CSS_SELECTOR, "th[data-key=bytes]")
        th.click()
        th.click()
        first = drv.find_element(By.CSS_SELECTOR, "tr.row td").text
        biggest = max(tensors.values(),
                      key=lambda t: (t["bytes"], -sorted(tensors).index(t["name"])))
        assert tensors[first]["bytes"] == biggest["bytes"], (first, biggest["name"])
        box = drv.find_element(By.ID, "filter")
        box.send_keys("qkv")
        want = [n for n in tensors if "qkv" in n.lower()]
        wait_rows(drv, len(want), "filter qkv")
        assert drv.find_element(By.ID, "count").text == f"{len(want)} of {len(tensors)} tensors"
        box.clear()
        box.send_keys("/^embed|norm/")
        want = [n for n in tensors if n.startswith("embed") or "norm" in n]
        wait_rows(drv, len(want), "filter /^embed|norm/")

        # The picture of docs/pictures.md: the fused QKV weight, each rank holding its part
        # of each of the three blocks.
        box.clear()
        box.send_keys("/^layers\\.0\\.attn\\.qkv\\.weight$/")
        wait_rows(drv, 1, "filter qkv of layer 0")
        drv.find_element(By.CSS_SELECTOR, "tr.row").click()
        drv.save_screenshot(SHOT)
        errors = [e for e in drv.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        print(f"browser: {len(tensors)} tensors, {drawn} pieces drawn, sort and filter ok; "
              f"report {os.path.getsize(report)} bytes; screenshot {SHOT}")

        # The plan page of a 4 -> 3 reshard: its totals are the plan's, each tensor
        # shows 3 target pieces (per block) over the source pieces' outlines.
        plan = json.loads(ckpt("reshard", "ex", "-o", "r3", "--mesh", "dp=2,tp=3", "--plan",
                               "--json", "--html", "plan.html"))
        drv.get("file://" + os.path.join(os.path.abspath(WORK), "plan.html"))
        WebDriverWait(drv, 20).until(
            lambda d: d.execute_script("return document.body.dataset.ready") == "1")
        outputs = drv.find_elements(By.CSS_SELECTOR, "#outputs tr.output-row")
        assert len(outputs) == len(plan["files"]), (len(outputs), len(plan["files"]))
        assert f"({plan['bytes_read']} B)" in drv.find_element(By.ID, "summary-plan").text
        drv.find_element(By.ID, "filter").send_keys("/^embed\\.weight$/")
        wait_rows(drv, 1, "plan: filter embed.weight")
        drv.find_element(By.CSS_SELECTOR, "tr.row").click()
        targets = drv.find_elements(By.CSS_SELECTOR, "tr.detail g.piece")
        sources = drv.find_elements(By.CSS_SELECTOR, "tr.detail g.source")
        src_pieces = [p for p in tensors["embed.weight"]["pieces"] if not p["copy"]]
        assert len(sources) == len(src_pieces), (len(sources), len(src_pieces))
        assert len(targets) == 3, len(targets)
        drv.save_screenshot(os.path.join(WORK, "plan.png"))
        errors = [e for e in drv.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        print(f"plan page: {len(outputs)} outputs, embed.weight as {len(targets)} target "
              f"pieces over {len(sources)} source pieces")
        zero_check(drv)
    finally:
        drv.quit()


def flat_runs(a, n, cols):
    """Rectangles of a flat range [a, a+n) over rows of `cols`: the end of a row, whole
    rows, the start of a row (the report's flatStrips)."""
    if n == 0:
        return 0
    b = a + n
    if a // cols == b // cols:
        return 1
    whole_from = a // cols + (1 if a % cols else 0)
    return (1 if a % cols else 0) + (1 if b // cols > whole_from else 0) + (1 if b % cols else 0)


def zero_check(drv):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    zero = os.path.join(REPO, "tests/fixtures/deepspeed/zero3_fp32/ckpt")
    tensors = {t["name"]: t for t in json.loads(ckpt("inspect", zero, "--json"))["tensors"]}
    ckpt("inspect", zero, "--html", "zero.html")
    drv.get("file://" + os.path.join(WORK, "zero.html"))
    WebDriverWait(drv, 20).until(
        lambda d: d.execute_script("return document.body.dataset.ready") == "1")
    rows = drv.find_elements(By.CSS_SELECTOR, "tr.row")
    assert len(rows) == len(tensors), (len(rows), len(tensors))
    flat = mid_row = 0
    for i in range(len(rows)):
        row = drv.find_elements(By.CSS_SELECTOR, "tr.row")[i]
        name = row.find_element(By.TAG_NAME, "td").text
        row.click()
        pieces, shape = tensors[name]["pieces"], tensors[name]["shape"]
        rects = drv.execute_script(
            "return [...document.querySelectorAll('tr.detail g.piece')]"
            ".map(g => g.querySelectorAll('rect').length)")
        assert len(rects) == len(pieces), (name, len(rects), len(pieces))
        cols = shape[-1] if shape else 1
        for p, n in zip(pieces, rects):
            if "flat" in p:
                flat += 1
                a, k = p["flat"]
                mid_row += a % cols != 0
                assert n == flat_runs(a, k, cols), (name, p, n)
        row.click()
    assert flat > 0 and mid_row > 0, (flat, mid_row)
    errors = [e for e in drv.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    print(f"zero3 page: {len(tensors)} tensors, {flat} flat pieces drawn as runs "
          f"({mid_row} starting mid-row)")


def tensorboard_check():
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # 2 epochs of 6 updates of 32 images, each followed by a test accuracy.
    steps = 12
    out = json.loads(ckpt("train", "--ranks", "2", "--epochs", "2", "--train-limit", "192",
                          "--test-limit", "200", "--batch-size", "32", "--out", "run",
                          "--json", "--quiet"))
    assert out["steps"] == steps, out
    acc = EventAccumulator(os.path.join(WORK, "run"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/images_per_sec"} <= set(tags), tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, steps + 1)), [e.step for e in loss]
    # f32 in the event, f32 printed by ckpt: equal to the last bit.
    assert abs(loss[-1].value - out["final_loss"]) <= 1e-6 * abs(out["final_loss"]), (
        loss[-1].value, out["final_loss"])
    ips = acc.Scalars("train/images_per_sec")
    assert len(ips) == steps and all(e.value > 0 for e in ips)
    accs = acc.Scalars("test/accuracy")
    assert len(accs) == 2 and [(e.step, round(e.value, 6)) for e in accs] == [
        (e, round(a, 6)) for e, a in out["test_accuracy"]], (accs, out["test_accuracy"])
    print(f"tensorboard: {len(loss)} losses (last {loss[-1].value:.4f}), {len(ips)} "
          f"throughputs, {len(accs)} accuracies read by EventAccumulator")


os.makedirs(WORK, exist_ok=True)
browser_check()
tensorboard_check()
