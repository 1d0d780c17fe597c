"""Join URLs and QR codes: round trips through PNG files and terminal text, strict refusals."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
from PIL import Image

from engine.credentials import codes as pairing
from engine.credentials.codes import (
    JoinCode,
    PairingError,
    join_url,
    parse_join_url,
    qr_text,
    read_qr_image,
    save_qr_png,
)

TOKEN = bytes.fromhex("8f" * 16 + "0123456789abcdef" * 2)
HEX = TOKEN.hex()
SCALE = 6


def _image(cells: list[list[bool]]) -> Image.Image:
    """Modules (True = dark) to a black-on-white image, SCALE pixels per module."""
    height, width = len(cells), len(cells[0])
    img = Image.new("L", (width * SCALE, height * SCALE), 255)
    for y, row in enumerate(cells):
        for x, dark in enumerate(row):
            if dark:
                img.paste(0, (x * SCALE, y * SCALE, (x + 1) * SCALE, (y + 1) * SCALE))
    return img


def _cells_from_plain(text: str, *, ink_dark: bool) -> list[list[bool]]:
    halves = {"\u2588": (True, True), "\u2580": (True, False), "\u2584": (False, True),
              " ": (False, False)}
    rows: list[list[bool]] = []
    for line in text.split("\n"):
        pairs = [halves[c] for c in line]
        rows.append([t == ink_dark for t, _ in pairs])
        rows.append([b == ink_dark for _, b in pairs])
    return rows


def _cells_from_ansi(text: str) -> list[list[bool]]:
    rows: list[list[bool]] = []
    for line in text.split("\n"):
        top: list[bool] = []
        bottom: list[bool] = []
        fg = bg = None
        for match in re.finditer(r"\x1b\[(\d+)(?:;(\d+))?m|(\u2580)", line):
            if match.group(3):
                assert fg is not None and bg is not None
                top.append(fg == 30)
                bottom.append(bg == 40)
            elif match.group(2):
                fg, bg = int(match.group(1)), int(match.group(2))
        rows += [top, bottom]
    return rows


def _decode(img: Image.Image, tmp_path: Path) -> str:
    path = tmp_path / "screen.png"
    img.save(path)
    return read_qr_image(path)


def test_url_shape_and_parse() -> None:
    url = join_url("192.168.1.20:8454", TOKEN, "desk fleet")
    assert url == f"shoal://join?head=192.168.1.20:8454&token={HEX}&fleet=desk%20fleet"
    code = parse_join_url(url)
    assert code == JoinCode("192.168.1.20", 8454, TOKEN, "desk fleet")
    assert code.head == "192.168.1.20:8454"


@pytest.mark.parametrize(("head", "host", "port"), [
    ("192.168.1.20:8454", "192.168.1.20", 8454),
    ("[fd7a:115c:a1e0::5]:8454", "fd7a:115c:a1e0::5", 8454),
    ("studio.tail1a2b.ts.net:9000", "studio.tail1a2b.ts.net", 9000),
])
def test_round_trip_through_png_and_zxing(tmp_path: Path, head: str, host: str,
                                          port: int) -> None:
    url = join_url(head, TOKEN, "Zoë's desk & lab")
    png = tmp_path / "pair.png"
    save_qr_png(url, png)
    decoded = read_qr_image(png)
    assert decoded == url
    code = parse_join_url(decoded)
    assert (code.head_host, code.head_port, code.token, code.fleet) == \
        (host, port, TOKEN, "Zoë's desk & lab")


def test_jpeg_photo_like_image_decodes(tmp_path: Path) -> None:
    url = join_url("10.0.0.2:8454", TOKEN, "f")
    png = tmp_path / "pair.png"
    save_qr_png(url, png)
    jpg = tmp_path / "photo.jpg"
    with Image.open(png) as img:
        img.convert("RGB").rotate(90, expand=True).save(jpg, quality=70)
    assert parse_join_url(read_qr_image(jpg)).token == TOKEN


@pytest.mark.parametrize("mode", ["ansi", "plain-dark-terminal", "plain-light-terminal"])
def test_terminal_qr_scans(tmp_path: Path, mode: str) -> None:
    url = join_url("192.168.1.20:8454", TOKEN, "desk")
    if mode == "ansi":
        text = qr_text(url)
        assert "\x1b[" in text
        cells = _cells_from_ansi(text)
    else:
        invert = mode == "plain-light-terminal"
        text = qr_text(url, ansi=False, invert=invert)
        assert "\x1b" not in text
        cells = _cells_from_plain(text, ink_dark=invert)
    assert len(text.split("\n")) <= 30  # compact: two module rows per line
    assert _decode(_image(cells), tmp_path) == url


BAD = [
    "",
    "https://join?head=1.2.3.4:8454&token=" + HEX + "&fleet=f",
    "shoal://leave?head=1.2.3.4:8454&token=" + HEX + "&fleet=f",
    "shoal://join/extra?head=1.2.3.4:8454&token=" + HEX + "&fleet=f",
    "shoal://join?head=1.2.3.4:8454&token=" + HEX + "&fleet=f#frag",
    "shoal://join?head=1.2.3.4:8454&token=" + HEX,
    "shoal://join?token=" + HEX + "&fleet=f",
    "shoal://join?head=1.2.3.4:8454&token=" + HEX[:-2] + "&fleet=f",
    "shoal://join?head=1.2.3.4:8454&token=" + HEX[:-2] + "zz&fleet=f",
    "shoal://join?head=1.2.3.4:8454&token=" + HEX + "00&fleet=f",
    "shoal://join?head=1.2.3.4:8454&token=" + HEX + "&token=" + HEX + "&fleet=f",
    "shoal://join?head=1.2.3.4:8454&token=" + HEX + "&fleet=f&" + HEX + "=1",
    "shoal://join?head=1.2.3.4&token=" + HEX + "&fleet=f",
    "shoal://join?head=1.2.3.4:0&token=" + HEX + "&fleet=f",
    "shoal://join?head=1.2.3.4:70000&token=" + HEX + "&fleet=f",
    "shoal://join?head=" + HEX + ":8454&token=" + HEX + "&fleet=f",
    "shoal://join?head=fe80::1:8454&token=" + HEX + "&fleet=f",
    "shoal://join?head=bad_host!:8454&token=" + HEX + "&fleet=f",
    "shoal://join?head=1.2.3.4:8454&token=" + HEX + "&fleet=",
    "shoal://join?head=1.2.3.4:8454&token=" + HEX + "&fleet=a%0Ab",
    "shoal://join?head=1.2.3.4:8454&token=" + HEX + "&fleet=%FF",
    "shoal://join?head=1.2.3.4:8454&token=" + HEX + "&fleet=" + "x" * 65,
    "shoal://join?head=1.2.3.4:8454&token=" + HEX + "&fleet=f&&",
    "shoal://join?head=1.2.3.4:8454&token=" + HEX + "&fleet=f" + "x" * 1100,
]


@pytest.mark.parametrize("text", BAD)
def test_bad_codes_refused_without_the_token(text: str) -> None:
    with pytest.raises(PairingError) as err:
        parse_join_url(text)
    message = str(err.value)
    assert "\n" not in message and message
    for leak in (HEX, HEX[:16], HEX[-16:], HEX[:-2], HEX.upper()):
        assert leak not in message


def test_unbracketed_ipv6_head_is_bracketed() -> None:
    url = join_url("fd7a:115c:a1e0::5:8454", TOKEN, "f")
    assert "head=%5Bfd7a:115c:a1e0::5%5D:8454" in url
    assert parse_join_url(url).head == "[fd7a:115c:a1e0::5]:8454"


def test_upper_case_scheme_and_whitespace_accepted() -> None:
    code = parse_join_url(f"  SHOAL://JOIN?head=h:1&token={HEX.upper()}&fleet=f\n")
    assert (code.head_host, code.head_port, code.token) == ("h", 1, TOKEN)


def test_token_never_in_repr_or_str() -> None:
    code = parse_join_url(join_url("10.0.0.2:8454", TOKEN, "f"))
    for text in (repr(code), str(code)):
        assert HEX not in text and "token=" not in text.replace("token=...", "")


@pytest.mark.parametrize(("head", "token", "fleet"), [
    ("nohost", TOKEN, "f"), ("h:99999", TOKEN, "f"), ("h:1", TOKEN[:31], "f"),
    ("h:1", TOKEN, ""), ("h:1", TOKEN, " f"), ("h:1", TOKEN, "a\tb"),
])
def test_join_url_validates(head: str, token: bytes, fleet: str) -> None:
    with pytest.raises(PairingError) as err:
        join_url(head, token, fleet)
    assert HEX not in str(err.value)


def test_image_errors(tmp_path: Path) -> None:
    with pytest.raises(PairingError, match="there is no image at"):
        read_qr_image(tmp_path / "missing.png")
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not an image at all")
    with pytest.raises(PairingError, match="not an image Shoal can read"):
        read_qr_image(junk)
    blank = tmp_path / "blank.png"
    Image.new("L", (200, 200), 255).save(blank)
    with pytest.raises(PairingError, match="no QR code found"):
        read_qr_image(blank)
    other = tmp_path / "other.png"
    pairing._qr("https://example.com/").save(str(other), kind="png", scale=8)
    with pytest.raises(PairingError, match="not a Shoal join code"):
        read_qr_image(other)


def test_png_holding_the_token_is_private(tmp_path: Path) -> None:
    url = join_url("10.0.0.2:8454", TOKEN, "desk")
    path = tmp_path / "pair.png"
    old = os.umask(0o022)  # the usual umask: a plain write would leave it 0644
    try:
        save_qr_png(url, path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        path.chmod(0o644)  # an older, readable copy is replaced by a private one
        save_qr_png(url, path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_qr_image(path) == url
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pair.png"]  # no temp file left


def test_png_in_an_unwritable_place_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(PairingError, match="cannot write the QR image") as err:
        save_qr_png(join_url("h:1", TOKEN, "f"), tmp_path / "file" / "pair.png")
    assert HEX not in str(err.value)


def test_join_code_from_a_url_a_text_file_or_an_image(tmp_path: Path) -> None:
    url = join_url("10.0.0.2:8454", TOKEN, "desk")
    assert pairing.join_code_from(f"  {url}\n") == url
    text = tmp_path / "code.txt"
    text.write_text(url + "\n")
    assert pairing.join_code_from(str(text)) == url
    assert pairing.join_code_from(f"@{text}") == url
    png = tmp_path / "code.png"
    save_qr_png(url, png)
    assert pairing.join_code_from(f"@{png}") == url
    assert pairing.join_code_from(str(png)) == url
    with pytest.raises(PairingError, match="there is no file at") as err:
        pairing.join_code_from(f"@{tmp_path / 'missing.txt'}")
    assert "\n" not in str(err.value)
    # not a file and not a URL: parsing says it is not a join code
    with pytest.raises(PairingError, match="not a Shoal join code"):
        parse_join_url(pairing.join_code_from("nonsense"))
