"""Render a report.html in headless Chromium at a 1,000-pixel-wide window and save a PNG screenshot.

Look at the page as a person would (the picture stays out of the repository: write it under results/):
    .venv/bin/python scripts/screenshot_report.py results/report/report.html results/report/report.png [--height 3500]
Needs Debian's `chromium` (apt-get install -y chromium); runs offline (the report inlines its figures).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WIDTH = 1000  # the window the report is laid out for


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    sys.exit("no chromium on PATH: apt-get install -y chromium")


def screenshot(html: Path, png: Path, height: int) -> None:
    """One headless Chromium run; a fresh profile folder so no state of another run leaks in."""
    with tempfile.TemporaryDirectory() as profile:
        cmd = [
            chromium(),
            "--headless",
            "--no-sandbox",  # root in a container: the sandbox cannot start
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={WIDTH},{height}",
            f"--screenshot={png.resolve()}",
            html.resolve().as_uri(),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode or not png.is_file():
        sys.exit(f"chromium failed ({proc.returncode}): {proc.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("html", type=Path)
    ap.add_argument("png", type=Path)
    ap.add_argument("--height", type=int, default=3500, help="window height in pixels (the page is cut there)")
    args = ap.parse_args()
    screenshot(args.html, args.png, args.height)
    print(f"{args.png}: {WIDTH}x{args.height} screenshot of {args.html}")


if __name__ == "__main__":
    main()
