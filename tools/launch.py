"""Launching the dashboard for a real browser, one way for every tool and test: Streamlit's
headless argv on a free loopback port, waiting until it listens, and Debian's chromium with the
flags a headless run needs (driven through playwright, never `playwright install`)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from app.link.source import ROOT
from app.streamlit_argv import TEST_HOOKS, streamlit_argv
from kvscope_contract.ready import free_port

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def start_streamlit(app_args: list[str], *, cwd: Path = ROOT, python: str = sys.executable,
                    out=subprocess.DEVNULL, timeout: float = 120, options: tuple[str, ...] = (),
                    env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`streamlit run app/main.py OPTIONS -- APP_ARGS`, headless on a free port in a process group
    of its own, once it listens (a browser that comes too early is refused): (process, url). `out`:
    where its output goes (a file, not a pipe nobody reads: a full pipe blocks Streamlit); `env`:
    more environment."""
    port = free_port()
    env = {**os.environ, TEST_HOOKS: "1", **(env or {})}  # the grid publishes what it drew, for the page's driver
    argv = streamlit_argv(python, app_args, "--server.port", str(port), *options, main="app/main.py")  # `cwd`'s app
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    raise RuntimeError(f"streamlit did not listen on port {port} (exit code {proc.poll()})")


def open_grid(browser, url: str, errors: list[str], blocks: int | None = None, *, width: int = 1500,
              height: int = 1400, timeout_ms: int = 300_000, prepare=None):
    """A page of the app at `url` once its grid has drawn (a pool of `blocks`, or any pool); the
    page's errors go to `errors`; `prepare(page)` runs before it loads (routes, listeners)."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.on("pageerror", lambda e: errors.append(str(e)))
    if prepare is not None:
        prepare(page)
    page.goto(url)
    drawn = f"=== {blocks}" if blocks is not None else "> 0"
    page.wait_for_function(f"window.__kvscope_grid && window.__kvscope_grid.n {drawn}", timeout=timeout_ms)
    return page


def click_until(page, button, done: str, arg=None, *, tries: int = 6, wait_ms: int = 30_000) -> None:
    """Click `button` (a locator: its first match) until the page's JS predicate `done(arg)` holds,
    clicking again after `wait_ms` without it. A click in a Streamlit fragment that redraws on a
    timer (the lessons' sidebar, twice a second) can land while a slow machine redraws it (its old
    copy is shown beside the new one meanwhile) and be lost; a user clicks again. `done` must hold
    as soon as a click is taken (a lesson's "running until" too), so that no click is taken twice."""
    for _ in range(tries):
        if page.evaluate(done, arg):
            return
        if button.count():
            button.first.click(timeout=wait_ms)
        try:
            page.wait_for_function(done, arg=arg, timeout=wait_ms)
            return
        except Exception:  # playwright's TimeoutError: not taken (yet); the button, if still there, again
            pass
    raise AssertionError(f"{done} did not hold after {tries} clicks; the page says: {page.inner_text('body')[:2500]}")


def open_expander(panel, *, tries: int = 4, wait_ms: int = 10_000) -> None:
    """Open a Streamlit expander (`panel`, a locator of its <details>) as a user does: click its
    title until its content takes clicks. Its `open` attribute is no sign: an expander that the
    app closes keeps it through the closing animation, while its content is already inert."""
    is_open = "d => d.open && !d.querySelector('[data-testid=stExpanderDetails]').inert"
    for _ in range(tries):
        if panel.evaluate(is_open):
            return
        panel.locator("summary").click(timeout=wait_ms)
        deadline = time.monotonic() + wait_ms / 1000
        while time.monotonic() < deadline and not panel.evaluate(is_open):
            time.sleep(0.1)
    raise AssertionError(f"the expander did not open after {tries} clicks: {panel.inner_text()[:500]}")


def reset_pool(page, blocks: int, *, tries: int = 4, wait_ms: int = 30_000) -> None:
    """The sidebar's Reset pool form, filled with `blocks` device blocks and submitted, until the
    grid draws that pool. The form lives in the engine panel, a fragment redrawn on a timer: a
    click, or the expander's opening, can be lost to a redraw as in `click_until`."""
    side = page.get_by_test_id("stSidebar")
    done = f"window.__kvscope_grid && window.__kvscope_grid.n === {blocks}"
    for _ in range(tries):
        field = side.get_by_label("Device blocks")
        if not field.is_visible():
            side.get_by_text("Reset pool").click()
            field.wait_for(timeout=wait_ms)
        field.fill(str(blocks))
        side.get_by_role("button", name="Reset engine", exact=True).click(timeout=wait_ms)
        try:
            page.wait_for_function(done, timeout=wait_ms)
            return
        except Exception:  # playwright's TimeoutError: not taken; the form again
            pass
    raise AssertionError(f"no pool of {blocks} blocks after {tries} resets; the page says: "
                         f"{page.inner_text('body')[:2500]}")
