"""The app's pages in Debian's chromium, as the browser tests open them."""
from __future__ import annotations


def open_grid(browser, url: str, blocks: int, errors: list[str], width: int = 1500, height: int = 1400):
    """A page of the app at `url`, once its grid has drawn a pool of `blocks`; the page's
    errors go to `errors`."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_function(f"window.__kvscope_grid && window.__kvscope_grid.n === {blocks}", timeout=300_000)
    return page
