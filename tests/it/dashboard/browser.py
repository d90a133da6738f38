#!/usr/bin/python3
"""The dashboard's pages in a real headless Chromium (Debian's chromium and chromium-driver, through Debian's
python3-selenium), started by tests/it/dashboard/browser.rs, which set up Redis, a daemon and two dashboards and
passes what to expect as JSON in argv[1]. Fails (exit 1, the reason on stderr) when a page does not show what
Redis holds; prints one JSON line of what it measured. Saves its screenshots into `shots`."""

import json
import os
import subprocess
import sys
import time

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

ARGS = json.loads(sys.argv[1])


def eventually(within, what, condition):
    """Polls `condition` (it may raise while the page redraws) until it returns something true."""
    deadline = time.monotonic() + within
    last = None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except (StaleElementReferenceException, WebDriverException, ValueError) as error:
            last = error
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {within}s (last: {last!r})")


def read(what, get):
    """`get()`, tried again while the page redraws under it (the element it found was replaced)."""
    return eventually(5, what, lambda: [get()])[0]


def cell(driver, queue, field):
    return read(f"{queue}'s {field}", lambda: driver.find_element(
        By.CSS_SELECTOR, f'tr[data-queue="{queue}"] [data-field="{field}"]').text)


def card(driver, field):
    return int(read(f"the {field} card", lambda: driver.find_element(
        By.CSS_SELECTOR, f'.card [data-field="{field}"]').text))


def shot(driver, name):
    driver.save_screenshot(os.path.join(ARGS["shots"], name))


def chromium():
    """Debian's headless Chromium through its chromedriver, at a laptop's window size."""
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,720", "--force-prefers-reduced-motion", "--lang=en-US"]:
        options.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def main():
    driver = chromium()
    measured = {}
    try:
        url = ARGS["url"]
        # The overview lists every queue with the counts Redis holds.
        driver.get(url + "/")
        for queue, fields in ARGS["expect"].items():
            for field, value in fields.items():
                eventually(10, f"{queue} {field} = {value} on the overview",
                           lambda: cell(driver, queue, field) == str(value))
        state = read("billing's state", lambda: driver.find_element(
            By.CSS_SELECTOR, 'tr[data-queue="billing"] .badge').text)
        assert state == "paused", f"billing shows {state!r}"

        # A push shows on the page within two seconds.
        ready = int(cell(driver, "billing", "ready"))
        started = time.monotonic()
        subprocess.run([ARGS["kmqd"], "-c", ARGS["config"], "push", "billing", "test", "{}"], check=True,
                       stdout=subprocess.DEVNULL)
        eventually(2, "the push on the overview", lambda: cell(driver, "billing", "ready") == str(ready + 1))
        measured["push_shown_ms"] = round((time.monotonic() - started) * 1000)
        assert measured["push_shown_ms"] <= 2000, measured

        # The charts draw the hour of history the daemons keep in Redis (seeded for mail), and move with it.
        def drawn(queue, series):
            return driver.execute_script(
                "const line = document.querySelector(arguments[0]);"
                "return line && line.tagName === 'polyline' ? line.getAttribute('points').split(' ').length : 0;",
                f'.charts[data-queue="{queue}"] .{series}')
        eventually(10, "mail's hour of rates on the chart", lambda: drawn("mail", "s-done") >= 60)
        eventually(10, "mail's hour of depths on the chart", lambda: drawn("mail", "s-ready") >= 60)
        measured["chart_points"] = drawn("mail", "s-done")

        # Rates moving, for the picture.
        eventually(20, "mail's done/s above 0", lambda: float(cell(driver, "mail", "done_rate")) > 0)
        driver.set_window_size(1280, 620)
        time.sleep(0.3)  # the relayout (no condition to poll: the same elements, smaller)
        shot(driver, "dashboard-overview.png")
        driver.set_window_size(390, 844)
        time.sleep(0.3)  # the relayout (no condition to poll: the same elements, narrower)
        shot(driver, "dashboard-phone.png")
        driver.set_window_size(1280, 900)

        # The overview's compact limits: reports runs 3 of its max_running 3, held back.
        driver.get(url + "/")
        eventually(10, "reports held back on the overview", lambda: cell(driver, "reports", "limits") == "3/3 held back")

        # The limits panel of a queue's page: running against max_running, the rate window's starts, the limited
        # type's row, and what holds the queue back, in the words of `kmqd stats`.
        driver.get(url + "/queues/reports")

        def text(selector):
            return read(selector, lambda: driver.find_element(By.CSS_SELECTOR, selector).text)
        eventually(10, "running 3 / 3", lambda: text('#limits [data-field="running"] .value') == "3 / 3")
        eventually(10, "3 starts in the minute's window",
                   lambda: text('#limits [data-field="rate-1m"] .value') == "3 / 600")
        report = '#types tr[data-type="report"] '
        eventually(10, "the report type's row", lambda: (text(report + '[data-field="running"]'),
                                                          text(report + '[data-field="waiting"]')) == ("1 / 1", "2"))
        held = text('#limits [data-field="held-back"]')
        assert held == 'Held back now: running 3/3 · type "report": running 1/1', held
        assert text("#held-badge") == "held back"
        measured["limits_held_back"] = held
        # On a phone the panel fits the screen's width (its cards stack; only the tables scroll sideways).
        driver.set_window_size(390, 844)
        eventually(5, "the panel within a phone's width", lambda: driver.execute_script(
            "return document.getElementById('limits').getBoundingClientRect().right <= window.innerWidth"))
        driver.execute_script("document.getElementById('limits').previousElementSibling.scrollIntoView()")
        shot(driver, "dashboard-limits.png")
        driver.set_window_size(1280, 900)

        # A grouped queue's busiest groups: acme paused with its 3 tasks waiting, busy running 1 of its max_running
        # 1 with 2 waiting; acme's Resume makes its tasks run (the queue's done count goes to 3).
        driver.get(url + "/queues/tenants")

        def group(name, field):
            return text(f'#groups tr[data-group="{name}"] [data-field="{field}"]')
        eventually(15, "acme paused with 3 waiting", lambda: (group("acme", "waiting"), group("acme", "state"))
                   == ("3", "paused"))
        eventually(15, "busy at its max_running", lambda: (group("busy", "running"), group("busy", "waiting"))
                   == ("1 / 1", "2"))
        assert text('#limits [data-field="groups-waiting"] .value') == "2"
        shot(driver, "dashboard-groups.png")
        eventually(5, "a click on acme's Resume", lambda: driver.find_element(
            By.CSS_SELECTOR, '#groups tr[data-group="acme"] button[data-action="resume"]').click() or True)
        eventually(5, "the resume's answer", lambda: "resume group acme" in driver.find_element(By.ID, "flash").text)
        flash = read("the flash", lambda: driver.find_element(By.ID, "flash").text)
        assert '"resumed":true' in flash, flash
        eventually(20, "acme's tasks to run", lambda: card(driver, "done") == 3)
        eventually(10, "acme gone from the groups", lambda: not driver.find_elements(
            By.CSS_SELECTOR, '#groups tr[data-group="acme"]'))
        measured["groups_shown"] = group("busy", "running")

        # Requeueing a dead task from its button makes it run (it fails again: the failed counter moves).
        driver.get(url + "/queues/jobs")
        row = '#dead tr[data-id="doomed"]'
        eventually(10, "doomed in the dead table", lambda: driver.find_elements(By.CSS_SELECTOR, row))
        failed = card(driver, "failed")
        eventually(10, "the queue's charts", lambda: driver.find_elements(By.CSS_SELECTOR, '.charts[data-queue="jobs"]'))
        shot(driver, "dashboard-queue.png")
        eventually(5, "a click on doomed's Requeue", lambda: driver.find_element(
            By.CSS_SELECTOR, row + ' button[data-action="requeue"]').click() or True)
        eventually(5, "the requeue's answer", lambda: "requeue doomed" in driver.find_element(By.ID, "flash").text)
        flash = read("the flash", lambda: driver.find_element(By.ID, "flash").text)
        assert '"requeued":["doomed"]' in flash, flash
        eventually(20, "doomed to run again", lambda: card(driver, "failed") == failed + 1)

        # Pause and Resume from the queue's header: the badge follows Redis.
        for button_name, state in [("pause", "paused"), ("resume", "serving")]:
            eventually(5, f"a click on {button_name}", lambda: driver.find_element(
                By.CSS_SELECTOR, f'h1 button[data-action="{button_name}"]').click() or True)
            eventually(5, f"the queue {state}", lambda: read("the state badge", lambda: driver.find_element(
                By.ID, "queue-state").text) == state)

        # The daemons page lists the daemon on each queue; a task found by id shows where it is.
        driver.get(url + "/daemons")
        eventually(10, "a daemon per queue", lambda: len(driver.find_elements(
            By.CSS_SELECTOR, "tr[data-owner]")) == ARGS["daemons"])
        driver.get(url + "/task?queue=jobs&id=doomed")
        eventually(10, "doomed found dead", lambda: read("the place", lambda: driver.find_element(
            By.CSS_SELECTOR, ".found h2").text).startswith("dead"))

        # A running task's page shows its progress report.
        driver.get(url + "/task?queue=tenants&id=busy0")
        eventually(10, "busy0's progress", lambda: "50% half way" in read("the progress", lambda: driver.find_element(
            By.CSS_SELECTOR, ".found .progress").text))
        driver.get(url + "/task?queue=jobs&id=doomed")

        # A task's page looks it up once (a lookup scans the queue's lists), not every second: in 3 s no other
        # lookup goes out (the other pages ask every second), and "Look again" makes one more.
        def lookups():
            return driver.execute_script(
                "return performance.getEntriesByType('resource')"
                ".filter((entry) => entry.name.includes('/api/queues/jobs/tasks/doomed')).length")
        eventually(10, "the first lookup", lambda: lookups() == 1)
        time.sleep(3)  # an absence: what the page would have asked meanwhile (no condition to poll for)
        assert lookups() == 1, f"the task page looked again on its own: {lookups()} lookups in 3 s"
        eventually(5, "a click on Look again", lambda: driver.find_element(
            By.CSS_SELECTOR, 'button[data-action="look-again"]').click() or True)
        eventually(10, "the second lookup", lambda: lookups() == 2)
        measured["task_page_lookups"] = lookups()

        # --read-only: no button anywhere, and an action sent anyway is refused.
        ro = ARGS["read_only_url"]
        for path in ["/", "/queues/jobs", "/queues/tenants", "/daemons"]:
            driver.get(ro + path)
            eventually(10, f"{path} drawn", lambda: driver.find_elements(By.CSS_SELECTOR, "main table"))
            buttons = driver.execute_script("return document.querySelectorAll('main button').length")
            assert buttons == 0, f"{path} has {buttons} buttons"
            badge = read("the read-only badge", lambda: driver.find_element(By.ID, "mode-badge").text)
            assert badge == "read-only", badge
        refused = driver.execute_async_script("""
            const done = arguments[arguments.length - 1];
            const token = document.querySelector('meta[name="kmqd-csrf"]').content;
            fetch("/api/queues/jobs/pause", {method: "POST", headers: {"X-Kmqd-Csrf": token}})
              .then((response) => done(response.status), (error) => done(String(error)));
        """)
        assert refused == 403, f"a read-only action answered {refused}"
        measured["read_only_refused"] = refused
    finally:
        driver.quit()
    print(json.dumps(measured))


if __name__ == "__main__":
    try:
        main()
    except AssertionError as error:
        print(f"browser check failed: {error}", file=sys.stderr)
        sys.exit(1)
