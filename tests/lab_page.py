"""The browser tests' way through the Lab's Trace workload: a trace file swept under LRU and OPT."""
from __future__ import annotations

from pathlib import Path


def fill(page, label: str, value: str) -> None:
    box = page.get_by_label(label, exact=True)
    box.fill(value)
    box.press("Enter")


def sweep_trace(page, trace: Path, requests: int, capacities: tuple[int, ...]) -> None:
    """From any page: Lab, Trace, the file, its first `requests`, the capacities, LRU and OPT
    (LFU removed), then Run the sweep (not waiting for its result)."""
    from playwright.sync_api import expect

    page.get_by_test_id("stSidebar").get_by_text("Lab", exact=True).click(timeout=120_000)
    main = page.get_by_test_id("stMain")
    main.get_by_text("Trace", exact=True).click()
    main.get_by_text("A file on this machine", exact=True).click()
    fill(page, "Trace file", str(trace))
    fill(page, "First N requests (0: the whole file)", str(requests))
    fill(page, "Capacities (blocks)", ",".join(map(str, capacities)))
    page.get_by_role("button", name="Remove LFU").click()
    expect(page.get_by_role("button", name="Remove LFU")).to_have_count(0)
    page.get_by_role("button", name="Run the sweep").click()
