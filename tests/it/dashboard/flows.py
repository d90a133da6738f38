#!/usr/bin/python3
"""A task's flow on the dashboard's task page in a real headless Chromium (as browser.py, through Debian's
python3-selenium and chromium-driver), started by tests/it/dashboard/flows.rs with a flow run part way: the
tree's nodes with their states, a result holding markup shown as text and never run, a node's link opening
its own page, and the tasks waiting for their dependencies on the overview and the queue's page. Fails (exit 1, the reason on stderr) when the page does not show what Redis holds. Saves
dashboard-flow.png into `shots`."""

import json
import os
import sys

from selenium.webdriver.common.by import By

# browser.py's Chromium and its poll with a deadline (it reads its JSON argument as this script does, and runs
# nothing on import).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from browser import chromium, eventually  # noqa: E402

ARGS = json.loads(sys.argv[1])


def node(driver, queue, task):
    return driver.find_element(By.CSS_SELECTOR, f'#flow li[data-queue="{queue}"][data-id="{task}"]')


def main():
    driver = chromium()
    try:
        url = ARGS["url"]
        driver.get(url + "/task?queue=a&id=report")
        # Each node with its state, the nested one too.
        expected = {("a", "report"): "waiting", ("b", "part-1"): "done", ("b", "part-2"): "dead",
                    ("c", "part-3"): "pending", ("b", "part-4"): "running", ("a", "step"): "waiting",
                    ("c", "fetch"): "pending"}
        for (queue, task), state in expected.items():
            eventually(10, f"{queue}/{task} {state}",
                       lambda: node(driver, queue, task).get_attribute("data-state") == state)
        step = node(driver, "a", "step")
        fetch = step.find_element(By.CSS_SELECTOR, 'li[data-id="fetch"]')
        assert fetch.get_attribute("data-queue") == "c", "fetch is nested under step"
        counts = node(driver, "a", "report").find_element(By.CSS_SELECTOR, '[data-field="counts"]').text
        assert "waits for 5: 1 done, 1 dead, 3 not ended" in counts, counts

        # The result is text: its markup shows as written, and nothing of it ran.
        result = node(driver, "b", "part-1").find_element(By.CSS_SELECTOR, '[data-field="result"]').text
        assert "<script>window.__pwned = 1</script>" in result, result
        assert driver.execute_script("return window.__pwned === undefined"), "the result's script ran"
        assert not driver.find_elements(By.CSS_SELECTOR, "#flow script, #flow img"), "markup became elements"
        driver.save_screenshot(os.path.join(ARGS["shots"], "dashboard-flow.png"))

        # A node's link opens its own page: part-1's kept result.
        node(driver, "b", "part-1").find_element(By.CSS_SELECTOR, 'a[data-link="node"]').click()
        eventually(10, "part-1's page", lambda: "id=part-1" in driver.current_url)
        eventually(10, "part-1's result", lambda: driver.find_element(By.ID, "result")
                   .get_attribute("data-state") == "done")
        shown = driver.find_element(By.CSS_SELECTOR, "#result pre").text
        assert '"rows": 1' in shown and "<script>" in shown, shown
        assert driver.execute_script("return window.__pwned === undefined"), "the result's script ran"

        # WAITING: report and step wait for their dependencies, on the overview and on queue a's page.
        driver.get(url + "/")
        eventually(10, "a's waiting on the overview", lambda: driver.find_element(
            By.CSS_SELECTOR, 'tr[data-queue="a"] [data-field="waiting"]').text == "2")
        driver.get(url + "/queues/a")
        eventually(10, "a's waiting card", lambda: driver.find_element(
            By.CSS_SELECTOR, '.card [data-field="waiting"]').text == "2")
    finally:
        driver.quit()


if __name__ == "__main__":
    try:
        main()
    except AssertionError as error:
        print(error, file=sys.stderr)
        sys.exit(1)
