"""The console in a real browser: the distribution's Chromium, driven by Playwright.

A real supervisor, a real guest whose call waits for approval, the console
on a real port, and the page clicked as an operator would. Chromium comes
from the distribution (``.ci/run`` and ``scripts/test`` install it when they
can); without it these tests are skipped with the reason — never in CI.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from supervisor import Plan, tool
from tests.console.conftest import Served
from tests.harness import STEP_TIMEOUT_S, Ledger, billing_plan, driven_guest

#: Chromium's own flags for a closed network (see the machine notes in docs/console.md).
CHROMIUM_ARGS = [
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
#: Every wait on the page, in milliseconds.
PAGE_TIMEOUT_MS = STEP_TIMEOUT_S * 1000
XSS = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">'


def _chromium() -> str | None:
    named = os.environ.get("HOSTCALL_CHROMIUM")
    if named:
        return named
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    return None


@pytest.fixture
async def page(served: Served) -> AsyncIterator[Any]:
    executable = _chromium()
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        executable = None
    if executable is None:
        reason = (
            "no Chromium (or no playwright): install Debian's chromium "
            "(scripts/test does when it runs as root with apt)"
        )
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI never skips the browser tests")
        pytest.skip(reason)
    errors: list[str] = []
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=executable, args=CHROMIUM_ARGS, timeout=PAGE_TIMEOUT_MS
        )
        try:
            context = await browser.new_context(viewport={"width": 1280, "height": 860})
            tab = await context.new_page()
            tab.set_default_timeout(PAGE_TIMEOUT_MS)
            tab.on("pageerror", lambda exc: errors.append(str(exc)))
            yield tab
        finally:
            await browser.close()
    assert errors == [], errors  # the page's own script never failed


def url(served: Served, view: str = "") -> str:
    return f"{served.base}/?token={served.console.token}{'#' + view if view else ''}"


async def waiting_card(page: Any) -> Any:
    card = page.locator('[data-proposal][data-state="waiting"]')
    await card.wait_for()
    return card


async def test_an_operator_approves_a_waiting_call_and_sees_it_executed(
    served: Served, ledger: Ledger, page: Any, tmp_path: Path
) -> None:
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    args = {"account": "acct_42", "cents": 1250}
    async with driven_guest(served.sup, plan) as guest:
        await page.goto(url(served, "approvals"))
        call = asyncio.ensure_future(guest.call("call_7", "charge", args))
        card = await waiting_card(page)
        shown_args = await card.locator("pre.args").inner_text()
        facts = await card.inner_text()
        badge = await page.locator("#waiting-count").inner_text()
        await page.wait_for_selector("#connection.live")
        shot = tmp_path / "console.png"
        await page.screenshot(path=str(shot), full_page=True)
        if target := os.environ.get("HOSTCALL_CONSOLE_SCREENSHOT"):
            shutil.copyfile(shot, target)
        await card.get_by_role("button", name="Approve").click()
        reply = await call
        done = page.locator('[data-proposal][data-state="dispatched"]')
        await done.wait_for()
        invocation_id = guest.execution.invocation_id
        await page.goto(url(served, f"invocation/{invocation_id}"))
        row = page.locator('#calls tr[data-call="call_7"]')
        await row.wait_for()
        row_text = await row.inner_text()
    assert reply["status"] == 200 and reply["body"]["effect"] == "executed"
    assert ledger.runs["charge"] == 1
    assert shown_args.replace(" ", "") == '{\n"account":"acct_42",\n"cents":1250\n}'
    assert "irreversible" in facts and invocation_id in facts
    assert guest.execution.execution_id in facts
    assert "left" in facts  # the lease
    assert badge == "1"
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    assert "executed" in row_text and reply["body"]["receipt_id"] in row_text


async def test_an_operator_rejects_with_a_reason_and_the_call_is_refused(
    served: Served, ledger: Ledger, page: Any
) -> None:
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    async with driven_guest(served.sup, plan) as guest:
        await page.goto(url(served, "approvals"))
        call = asyncio.ensure_future(guest.call("c1", "charge", {"account": "a", "cents": 1}))
        card = await waiting_card(page)
        await card.locator("input.reason").fill("wrong account")
        await card.get_by_role("button", name="Reject").click()
        reply = await call
        rejected = page.locator('[data-proposal][data-state="rejected"]')
        await rejected.wait_for()
        text = await rejected.inner_text()
    assert reply["status"] == 403 and reply["body"]["error"]["code"] == "approval_rejected"
    assert ledger.runs["charge"] == 0
    assert "wrong account" in text and "console" in text  # the reason, who decided


async def test_a_click_held_while_a_notice_arrives_still_decides(
    served: Served, ledger: Ledger, page: Any
) -> None:
    # The page re-renders on every notice. A button replaced between its
    # mousedown and mouseup gets no click: the operator's decision was lost.
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    async with driven_guest(served.sup, plan) as guest:
        await page.goto(url(served, "approvals"))
        first = asyncio.ensure_future(guest.call("c1", "charge", {"account": "a", "cents": 1}))
        card = await waiting_card(page)
        await page.wait_for_selector("#connection.live")
        # hover() retries if a redraw replaces the button; the press lands on
        # whichever Approve of c1's card is under the mouse then.
        await card.get_by_role("button", name="Approve").hover()
        await page.mouse.down()
        second = asyncio.ensure_future(guest.call("c2", "charge", {"account": "b", "cents": 2}))
        # The badge is drawn by every render, held or not: the notice is in.
        await page.locator("#waiting-count", has_text="2").wait_for()
        await page.mouse.up()
        reply = await asyncio.wait_for(first, STEP_TIMEOUT_S)
        await page.locator('[data-proposal][data-state="dispatched"]').wait_for()
        waiting = await page.locator('[data-proposal][data-state="waiting"]').count()
        served.sup.approvals.reject(served.sup.approvals.list("waiting")[0].id)
        await asyncio.wait_for(second, STEP_TIMEOUT_S)
    assert reply["status"] == 200 and reply["body"]["effect"] == "executed"
    assert ledger.runs["charge"] == 1
    assert waiting == 1  # c2, drawn once the button was let go


async def test_a_lease_counts_down_and_the_page_shows_it_expired(
    served: Served, ledger: Ledger, page: Any
) -> None:
    plan = billing_plan(ledger, require_approval_for_irreversible=True, approval_timeout_s=4)
    async with driven_guest(served.sup, plan) as guest:
        await page.goto(url(served, "approvals"))
        call = asyncio.ensure_future(guest.call("c1", "charge", {"account": "a", "cents": 1}))
        card = await waiting_card(page)
        lease = await card.locator(".lease").inner_text()
        expired = page.locator('[data-proposal][data-state="expired"]')
        await expired.wait_for()  # pushed by the server, no reload
        reply = await call
        buttons = await expired.get_by_role("button").count()
    assert lease.endswith("s left")
    assert reply["status"] == 403 and reply["body"]["error"]["code"] == "approval_expired"
    assert buttons == 0  # nothing left to decide
    assert ledger.runs["charge"] == 0


async def test_guest_supplied_markup_is_shown_as_text_and_never_runs(
    served: Served, ledger: Ledger, page: Any
) -> None:
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    async with driven_guest(served.sup, plan) as guest:
        await guest.send({"op": "print", "text": XSS})
        await page.goto(url(served, "approvals"))
        call = asyncio.ensure_future(guest.call("c1", "charge", {"account": XSS, "cents": 1}))
        card = await waiting_card(page)
        shown = await card.locator("pre.args").inner_text()
        images_in_card = await card.locator("img").count()
        served.sup.approvals.approve(served.sup.approvals.list("waiting")[0].id)
        await call
        invocation_id = guest.execution.invocation_id
        await page.goto(url(served, f"invocation/{invocation_id}"))
        log = page.locator("pre.log", has_text="onerror")
        await log.wait_for()
        logged = await log.inner_text()
        images = await page.locator("main img").count()
        scripts = await page.locator("main script").count()
        xss = await page.evaluate("window.__xss")
    assert XSS.replace('"', '\\"') in shown  # JSON-escaped quotes, the markup as text
    assert XSS in logged
    assert (images_in_card, images, scripts, xss) == (0, 0, 0, None)


#: A right-to-left override, a zero-width space, an invisible tag character,
#: a line separator, a C1 control, a Hangul filler and a variation selector:
#: what a guest can hide text with.
HIDDEN = "acct_9\u202e0001\u200b\U000e0041\u2028\u009b\u3164\U000e0101"


async def test_characters_that_hide_text_are_shown_as_escapes_to_the_deciding_operator(
    served: Served, ledger: Ledger, page: Any
) -> None:
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    async with driven_guest(served.sup, plan) as guest:
        await page.goto(url(served, "approvals"))
        call = asyncio.ensure_future(guest.call("c1", "charge", {"account": HIDDEN, "cents": 1}))
        card = await waiting_card(page)
        shown = await card.locator("pre.args").inner_text()
        served.sup.approvals.reject(served.sup.approvals.list("waiting")[0].id, reason="test")
        await call
        # A tool the plan lacks is refused, but its made-up name is recorded and listed.
        refused = await guest.call("c2", "refund\u202elave", {})
        await page.goto(url(served, f"invocation/{guest.execution.invocation_id}"))
        row = page.locator('tr[data-call="c2"]')
        await row.wait_for()
        listed = await row.inner_text()
    assert "acct_9\\u202e0001\\u200b\\udb40\\udc41\\u2028\\u009b\\u3164\\udb40\\udd01" in shown
    assert not [c for c in HIDDEN if not c.isascii() and c in shown]
    assert refused["body"]["error"]["code"] == "tool_not_allowed"
    assert "refund\\u202elave" in listed and "\u202e" not in listed
    assert ledger.runs["charge"] == 0


async def test_large_arguments_are_shown_whole_to_approve_and_an_ended_ones_at_a_click(
    served: Served, ledger: Ledger, page: Any
) -> None:
    # The overview lists arguments over 16 KiB as a preview (F46); a waiting
    # call is decided on its arguments whole (SPEC §14), an ended one's are
    # loaded on a click. Hidden characters are escaped in both.
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    args = {"account": "acct_" + "7" * 40_000 + HIDDEN, "cents": 1}
    async with driven_guest(served.sup, plan) as guest:
        await page.goto(url(served, "approvals"))
        call = asyncio.ensure_future(guest.call("c1", "charge", args))
        card = await waiting_card(page)
        whole = card.locator("pre.args", has_text="cents")
        await whole.wait_for()  # loaded with no click
        shown = await whole.inner_text()
        approvable = await card.get_by_role("button", name="Approve").is_enabled()
        served.sup.approvals.reject(served.sup.approvals.list("waiting")[0].id, reason="test")
        await call
        await page.reload()  # what this page loaded is gone: the ended card's preview
        ended = page.locator('[data-proposal][data-state="rejected"]')
        await ended.wait_for()
        previewed = await ended.locator("pre.args").inner_text()
        await ended.get_by_role("button", name="Show all").click()
        await ended.locator("pre.args", has_text="cents").wait_for()
        buttons = await ended.locator("button.whole-args").count()
    assert "7" * 40_000 + "acct_9\\u202e0001" in shown  # whole, hidden text escaped
    assert not [c for c in HIDDEN if not c.isascii() and c in shown]
    assert approvable
    assert previewed.startswith('{\n  "account": "acct_777') and previewed.endswith("…")
    assert len(previewed) < 2100 and "cents" not in previewed
    assert buttons == 0
    assert ledger.runs["charge"] == 0


async def test_arguments_nested_deep_are_shown_whole_with_bounded_indentation(
    served: Served, page: Any
) -> None:
    # Indented whole, arguments nested 200 deep are 200 times their size: a
    # megabyte of them froze the page. Levels past the eighth stay compact.
    @tool(reversibility="irreversible")
    def store(doc: list[Any]) -> int:
        return len(doc)

    plan = Plan([store], name="deep", require_approval_for_irreversible=True)
    doc: Any = [0] * 9_000
    for _ in range(200):
        doc = [doc]
    async with driven_guest(served.sup, plan) as guest:
        await page.goto(url(served, "approvals"))
        call = asyncio.ensure_future(guest.call("c1", "store", {"doc": doc}))
        card = await waiting_card(page)
        whole = card.locator("pre.args", has_text="0,0,0,0]")
        await whole.wait_for()  # loaded whole, with no click
        shown = await whole.inner_text()
        served.sup.approvals.reject(served.sup.approvals.list("waiting")[0].id, reason="test")
        await call
    assert shown.startswith('{\n  "doc": [\n    [\n      [')
    assert "[" * 190 + ",".join(["0"] * 9_000) + "]" * 190 in shown  # compact past level 8
    assert len(shown) < 30_000  # indented whole: some 3.6 million characters


async def test_the_page_without_its_token_is_refused(served: Served, page: Any) -> None:
    response = await page.goto(f"{served.base}/")
    body = await page.inner_text("body")
    wrong = await page.goto(f"{served.base}/?token=not-the-token")
    assert response is not None and response.status == 401
    assert wrong is not None and wrong.status == 401
    assert "hostcall console" not in body and "token" in body


async def test_the_invocations_view_is_live_as_a_guest_starts_and_calls(
    served: Served, ledger: Ledger, page: Any
) -> None:
    await page.goto(url(served, "invocations"))
    await page.wait_for_selector("#connection.live")
    async with driven_guest(served.sup, billing_plan(ledger)) as guest:
        invocation_id = guest.execution.invocation_id
        row = page.locator(f'tr[data-invocation="{invocation_id}"]')
        await row.wait_for()  # pushed: the page was loaded before the guest started
        await guest.call("c1", "lookup", {"account": "a"})
        await page.locator(f'tr[data-invocation="{invocation_id}"] .o-executed').wait_for()
        text = await row.inner_text()
    assert "running" in text and "executed 1" in text
