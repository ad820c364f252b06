"""Screenshot the built book's pages in headless Chromium, screen by screen as a reader scrolls, and list what broke.

    python tools/checks/render_pages.py    # every page of _build/html/book/ (jupyter-book build .) into _build/render/
    python tools/checks/render_pages.py -p 05b_fp8 10_llama -o /tmp/render --width 1280

Each page opens at --width x --height CSS px (default 1400 x 1600); once MathJax and the fonts are done, each screen
is saved as <out>/<page>_<nn>.png. A line per page: what did not load, MathJax errors, TeX left untypeset in the
prose, equations/tables/images wider than the article (their ends behind a scroll bar). Exit 1 when a page is missing,
did not load or has one of those; 2 without Chromium (apt-get install chromium).

Driven over the DevTools protocol on a pipe. Not ``chromium --headless --screenshot``: it saves whatever loaded (a
missing page: an all but white error page, exit 0), and a window as tall as a chapter is slow and part white.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

PROBE = r"""(async () => {
  if (window.MathJax && MathJax.startup) await MathJax.startup.promise;
  await document.fonts.ready;
  const article = document.querySelector("article") || document.body, right = article.getBoundingClientRect().right;
  const prose = article.cloneNode(true);
  prose.querySelectorAll("pre, code, script, style, mjx-container").forEach(e => e.remove());  // code may hold "$"
  const where = e => (e.closest("section")?.querySelector("h1, h2, h3")?.textContent || "").replace("#", "").trim();
  const wide = [...article.querySelectorAll("mjx-container[display='true'], div.math, table, pre, img, figure")]
    .filter(e => e.scrollWidth > e.clientWidth + 1 || e.getBoundingClientRect().right > right + 1);
  return {height: document.documentElement.scrollHeight,
          "wider than the article": wide.map(e => `${e.tagName.toLowerCase()} in "${where(e)}"`),
          "images not loaded": [...document.images].filter(i => i.naturalWidth === 0).map(i => i.src),
          "MathJax errors": document.querySelectorAll("mjx-merror").length,
          "TeX not typeset": (prose.textContent.match(/\$\$?[^$\n]{1,40}\$|\\\(|\\\[|\\begin\{/g) || []).slice(0, 5)};
})()"""


class Chromium:
    """Headless Chromium with one tab, spoken to in DevTools messages (NUL-terminated JSON) on its fds 3 and 4."""

    def __init__(self, exe: str, width: int, height: int):
        (to_r, self.to_w), (self.from_r, from_w) = os.pipe(), os.pipe()
        args = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--remote-debugging-pipe",
                f"--window-size={width},{height}", "about:blank"]  # headless: a throw-away profile of its own
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(3, 4),
                                     preexec_fn=lambda: (os.dup2(to_r, 3), os.dup2(from_w, 4)))
        os.close(to_r)
        os.close(from_w)
        self.buf, self.id, self.session = b"", 0, None
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, wait_for: str | None = None, **params) -> dict:
        """Send one command; return its result once it (and the event wait_for, if named) has come back."""
        self.id += 1
        msg = {"id": self.id, "method": method, "params": params}
        if self.session:
            msg["sessionId"] = self.session
        os.write(self.to_w, json.dumps(msg).encode() + b"\0")
        result, seen = None, wait_for is None
        while result is None or not seen:
            while b"\0" not in self.buf:
                if not select.select([self.from_r], [], [], 120)[0]:
                    raise RuntimeError(f"{method}: no answer from Chromium in 120 s")
                chunk = os.read(self.from_r, 1 << 20)
                if not chunk:
                    raise RuntimeError("Chromium closed the DevTools pipe (crashed?)")
                self.buf += chunk
            raw, self.buf = self.buf.split(b"\0", 1)
            reply = json.loads(raw)
            seen = seen or reply.get("method") == wait_for
            if reply.get("id") == self.id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error'].get('message')}")
                if "errorText" in reply["result"]:  # a navigation that failed: no load event to wait for
                    raise RuntimeError(f"did not load: {reply['result']['errorText']}")
                result = reply["result"]
        return result

    def evaluate(self, expr: str):
        r = self.call("Runtime.evaluate", expression=expr, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"script error: {r['exceptionDetails'].get('exception', {}).get('description')}")
        return r["result"].get("value")

    def close(self):
        try:  # Browser.close: Chromium quits and removes its throw-away profile (SIGTERM leaves it in /tmp)
            os.write(self.to_w, b'{"id": 0, "method": "Browser.close"}\0')
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def shoot(browser: Chromium, url: str, stem: Path, height: int) -> tuple[str, bool]:
    """Save the page's screens; return its line (height, screens, what is wrong) and whether anything is."""
    browser.call("Page.navigate", wait_for="Page.loadEventFired", url=url)
    info, step = browser.evaluate(PROBE), height - 120  # what the 120 px sticky header hides, the next screen shows
    shots = 1 + max(0, -(-(info["height"] - height) // step))
    for i in range(shots):
        browser.evaluate(f"window.scrollTo(0, {i * step}); new Promise(r => requestAnimationFrame(() => r(1)))")
        Path(f"{stem}_{i:02d}.png").write_bytes(base64.b64decode(browser.call("Page.captureScreenshot")["data"]))
    flaws = "".join(f"; {k}: {v}" for k, v in info.items() if k != "height" and v)
    return f"{info['height']} px, {shots} screens, {stem}_NN.png{flaws}", bool(flaws)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("html", nargs="?", type=Path, default=Path(__file__).resolve().parents[2] / "_build/html")
    ap.add_argument("-p", "--pages", nargs="+", help="pages of book/, without .html (default: every one)")
    ap.add_argument("-o", "--out", type=Path, help="folder for the screenshots (default: _build/render)")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1600, help="one screen, CSS px")
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("google-chrome"))
    args = ap.parse_args(argv)
    if not args.chromium:
        print("render_pages: no Chromium on PATH (apt-get install chromium, or pass --chromium PATH)", file=sys.stderr)
        return 2
    html = args.html.resolve()
    pages = [html / "book" / f"{p}.html" for p in args.pages] if args.pages else sorted((html / "book").glob("*.html"))
    missing = [str(p) for p in pages if not p.is_file()] if pages else [f"{html}/book/*.html"]
    if missing:
        sys.exit(f"render_pages: not built (jupyter-book build .): {', '.join(missing)}")
    out = args.out or html.parent / "render"
    out.mkdir(parents=True, exist_ok=True)
    browser, bad = Chromium(args.chromium, args.width, args.height), 0
    try:
        for page in pages:
            try:
                line, flawed = shoot(browser, page.as_uri(), out / page.stem, args.height)
            except RuntimeError as e:
                line, flawed = f"FAILED, {e}", True
            bad += flawed
            print(f"{page.name}: {line}")
    finally:
        browser.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
