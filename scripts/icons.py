"""Render the PNG sizes of every icon from its SVG source in resources/icons/.

    .venv/bin/python scripts/icons.py          # writes NAME-SIZE.png beside each NAME.svg
    .venv/bin/python scripts/icons.py --check  # exit 1 when a PNG is missing or stale

The PNGs are checked in, so the app needs no SVG renderer at run time (and a tray host
gets pixel-exact small sizes); run this after changing an SVG.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt
from PySide6.QtGui import QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer

ROOT = Path(__file__).resolve().parents[1]
ICONS = ROOT / "resources" / "icons"
SIZES = (16, 22, 24, 32, 48, 64, 128, 256)


def render(svg: Path, size: int) -> bytes:
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"{svg} is not a valid SVG; fix it and run again")
    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter)
    painter.end()
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")
    return bytes(data.data())


def main(argv: list[str]) -> int:
    check = "--check" in argv
    _app = QGuiApplication([])
    stale = []
    for svg in sorted(ICONS.glob("*.svg")):
        for size in SIZES:
            png = ICONS / f"{svg.stem}-{size}.png"
            data = render(svg, size)
            if png.exists() and png.read_bytes() == data:
                continue
            if check:
                stale.append(png.name)
            else:
                png.write_bytes(data)
                print(f"wrote {png.relative_to(ROOT)}")
    if stale:
        print(f"stale or missing: {', '.join(stale)}; run scripts/icons.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
