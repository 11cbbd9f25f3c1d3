"""What a user reads is never cut (issue 28: "Open r...", "Restart e...", the grid's "colour by"
buttons wrapping away from their label): the page on the tiny model's embedded engine in a narrow
window, idle, then running a scenario (the metric cards' lines that need engine steps: at 1,000
pixels four cards a row cut every label and most lines under the numbers), then with that engine
killed (its Restart button), every button, label and metric card whole."""
from __future__ import annotations

import os
import signal

import pytest

from tests.processes import children
from tools.launch import CHROMIUM, FLAGS, open_grid

# Buttons and labels whose text is wider than their box (cut, usually with an ellipsis); Streamlit's
# icon ligatures ("restart_alt") are wider than the icon they draw and are left out.
CUT_JS = """() => {
  const cut = [];
  for (const el of document.querySelectorAll('button, label, [data-testid="stWidgetLabel"], .kv .controls label, '
                                             + '.kv .mlabel, .kv .mvalue, .kv .mdelta')) {
    if (!el.offsetParent) continue;
    for (const t of [el, ...el.querySelectorAll('*')]) {
      if (getComputedStyle(t).fontFamily.includes('Material')) continue;
      const own = [...t.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
      if (own && t.scrollWidth > t.clientWidth + 1) cut.push(el.innerText.replace(/\\s+/g, ' ').trim());
    }
  }
  return [...new Set(cut)];
}"""
# the grid's "colour by" and its two buttons on one line
COLOUR_BY_JS = """() => {
  const bar = document.querySelector('.kv .bar');
  const walk = document.createTreeWalker(bar, NodeFilter.SHOW_TEXT);
  let label = null;
  while (walk.nextNode()) if (walk.currentNode.textContent.includes('colour by')) label = walk.currentNode;
  const range = document.createRange();
  range.selectNodeContents(label);
  const tops = [range.getBoundingClientRect().top + range.getBoundingClientRect().height / 2,
    ...[...bar.querySelectorAll('[data-m]')].filter((e) => e.offsetParent)
      .map((e) => e.getBoundingClientRect().top + e.offsetHeight / 2)];
  return Math.max(...tops) - Math.min(...tops) < 6;
}"""


@pytest.mark.slow
@pytest.mark.parametrize("app_url", [["--model", "tiny", "--num-device-blocks", "4096"]], indirect=True)
def test_no_label_is_cut_and_colour_by_stays_with_its_buttons(app_url):
    from playwright.sync_api import expect, sync_playwright

    url, streamlit = app_url
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        errors: list[str] = []
        page = open_grid(browser, url, errors, 4096, width=1000, height=1200)
        page.wait_for_timeout(2000)
        assert page.evaluate(COLOUR_BY_JS), "the grid's 'colour by' wrapped away from its buttons"
        assert page.evaluate(CUT_JS) == []
        side = page.get_by_test_id("stSidebar")  # a request: the metric cards' lines that need steps
        side.get_by_role("button", name="Shared system prompt", exact=True).click()
        page.wait_for_function("document.body.innerText.includes('avg of 16 steps')", timeout=120_000)
        assert page.evaluate(CUT_JS) == []
        for pid in children(streamlit.pid):  # the embedded engine dies
            os.kill(pid, signal.SIGKILL)
        restart = page.get_by_role("button", name="Restart engine")
        expect(restart).to_be_visible(timeout=60_000)
        assert page.evaluate(CUT_JS) == []
        assert not errors, errors
        browser.close()
