"""Pairing: the join URL, its QR code in the terminal or a PNG, and reading it back.

``shoal://join?head=HOST:PORT&token=HEX&fleet=NAME`` carries everything a new
machine needs: where the head takes joins, the fleet token, and the fleet's
name for people. Parsing is strict and every refusal is one line that never
repeats what was given (the text holds the token).

Writing and reading files blocks: from asyncio code call :func:`save_qr_png`,
:func:`read_qr_image` and :func:`join_code_from` through ``asyncio.to_thread``.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import segno

SCHEME = "shoal"
ACTION = "join"
TOKEN_BYTES = 32
MAX_URL_CHARS = 1024
MAX_FLEET_CHARS = 64
FIELDS = ("head", "token", "fleet")

_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class PairingError(Exception):
    """A join code or QR image is unusable; one line, never quoting the code."""


@dataclass(frozen=True)
class JoinCode:
    head_host: str
    head_port: int
    token: bytes = field(repr=False)
    fleet: str

    @property
    def head(self) -> str:
        """``HOST:PORT`` (an IPv6 host in brackets)."""
        return _join_hostport(self.head_host, self.head_port)

    def __str__(self) -> str:
        return f"join code for fleet '{self.fleet}' at head {self.head}"


def _join_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    if len(host) > 253 or not host:
        return False
    return all(_HOST_LABEL.match(label) for label in host.rstrip(".").split("."))


def split_head(head: str) -> tuple[str, int]:
    """(host, port) from ``HOST:PORT`` or ``[IPv6]:PORT``; PairingError when malformed."""
    bad = PairingError("the head address is not HOST:PORT (a host name or IP address and a "
                       "port 1-65535); copy the whole join code again")
    if head.startswith("["):
        host, sep, port_text = head[1:].partition("]:")
        if not sep:
            raise bad
        try:
            if ipaddress.ip_address(host).version != 6:
                raise bad
        except ValueError:
            raise bad from None
    else:
        host, sep, port_text = head.rpartition(":")
        if not sep or ":" in host or not _valid_host(host):
            raise bad
    if not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5:
        raise bad
    port = int(port_text)
    if not 0 < port < 65536:
        raise bad
    return host, port


def _check_fleet(fleet: str) -> str:
    if not fleet or len(fleet) > MAX_FLEET_CHARS or _CONTROL.search(fleet) \
            or fleet != fleet.strip():
        raise PairingError(f"the fleet name must be 1-{MAX_FLEET_CHARS} printable characters "
                           "without leading or trailing spaces")
    return fleet


def join_url(head: str, token: bytes, fleet: str) -> str:
    """``shoal://join?head=HOST:PORT&token=HEX&fleet=NAME``, each value URL-encoded.

    ``head`` may give an IPv6 host with or without brackets; the URL has them.
    """
    if head.count(":") > 1 and not head.startswith("["):
        host_part, _, port_part = head.rpartition(":")
        head = f"[{host_part}]:{port_part}"
    host, port = split_head(head)
    if len(token) != TOKEN_BYTES:
        raise PairingError(f"a fleet token is {TOKEN_BYTES} bytes; make one with "
                           "`shoal fleet token`")
    query = urllib.parse.urlencode(
        [("head", _join_hostport(host, port)), ("token", token.hex()),
         ("fleet", _check_fleet(fleet))],
        quote_via=urllib.parse.quote, safe=":")
    return f"{SCHEME}://{ACTION}?{query}"


def parse_join_url(text: str) -> JoinCode:
    """The join code in ``text``; PairingError (one line, no token) when it is not one."""
    not_code = PairingError("that is not a Shoal join code (it starts with shoal://join?); "
                            "copy the whole code printed by `shoal fleet pair`")
    text = text.strip()
    if not text or len(text) > MAX_URL_CHARS:
        raise not_code
    parts = urllib.parse.urlsplit(text)
    if parts.scheme.lower() != SCHEME or parts.netloc.lower() != ACTION \
            or parts.path not in ("", "/") or parts.fragment:
        raise not_code
    try:
        pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True,
                                       strict_parsing=True, max_num_fields=len(FIELDS) + 2,
                                       errors="strict")
    except (ValueError, UnicodeDecodeError):
        raise PairingError("the join code is garbled (bad URL encoding); copy the whole code "
                           "again") from None
    values: dict[str, str] = {}
    for key, value in pairs:
        if key not in FIELDS:
            raise PairingError("the join code has a field this Shoal does not know; update "
                               "Shoal here, or make the code again with `shoal fleet pair`")
        if key in values:
            raise PairingError(f"the join code has '{key}' twice; copy the whole code again")
        values[key] = value
    for key in FIELDS:
        if not values.get(key):
            raise PairingError(f"the join code has no {key}; copy the whole code printed by "
                               "`shoal fleet pair`")
    token_text = values["token"]
    if len(token_text) != 2 * TOKEN_BYTES or not re.fullmatch(r"[0-9a-fA-F]+", token_text):
        raise PairingError(f"the join code's token is not {2 * TOKEN_BYTES} hex characters; "
                           "copy the whole code again")
    host, port = split_head(values["head"])
    try:
        fleet = _check_fleet(values["fleet"])
    except PairingError as exc:
        raise PairingError(f"the join code's fleet name is unusable: {exc}") from None
    return JoinCode(head_host=host, head_port=port, token=bytes.fromhex(token_text),
                    fleet=fleet)


# --- QR codes --------------------------------------------------------------------

QR_BORDER = 2  # modules of quiet zone in the terminal (4 in files)
PNG_SCALE = 8
PNG_BORDER = 4


def _qr(url: str) -> segno.QRCode:
    import segno

    return segno.make(url, error="m", micro=False)


def _matrix(url: str, border: int) -> list[list[bool]]:
    """Rows of modules, True for dark, with ``border`` light modules around."""
    qr = _qr(url)
    return [[bool(m) for m in row] for row in qr.matrix_iter(scale=1, border=border)]


_UPPER, _LOWER, _FULL = "\u2580", "\u2584", "\u2588"
_ANSI_RESET = "\x1b[0m"
_FG = {True: 30, False: 97}  # dark: black; light: bright white
_BG = {True: 40, False: 107}


def qr_text(url: str, *, ansi: bool = True, invert: bool = False) -> str:
    """The QR code for ``url`` as terminal text, two module rows per line (half blocks).

    ``ansi`` (default) paints dark and light modules in explicit black and white,
    so the code scans on dark and light terminal themes alike. Without colours,
    ink marks the light modules (right for light text on a dark terminal);
    ``invert`` swaps that for dark text on a light background.
    """
    rows = _matrix(url, QR_BORDER)
    if len(rows) % 2:
        rows.append([False] * len(rows[0]))
    lines: list[str] = []
    for top, bottom in zip(rows[0::2], rows[1::2], strict=True):
        if ansi:
            out: list[str] = []
            current: tuple[bool, bool] | None = None
            for t, b in zip(top, bottom, strict=True):
                if (t, b) != current:
                    out.append(f"\x1b[{_FG[t]};{_BG[b]}m")
                    current = (t, b)
                out.append(_UPPER)
            lines.append("".join(out) + _ANSI_RESET)
        else:
            ink_dark = invert
            chars = []
            for t, b in zip(top, bottom, strict=True):
                it, ib = (t == ink_dark), (b == ink_dark)
                chars.append(_FULL if it and ib else _UPPER if it else _LOWER if ib else " ")
            lines.append("".join(chars))
    return "\n".join(lines)


def qr_png(url: str, *, scale: int = PNG_SCALE) -> bytes:
    """The QR code for ``url`` as PNG bytes (black on white, 4-module quiet zone)."""
    import io

    out = io.BytesIO()
    _qr(url).save(out, kind="png", scale=scale, border=PNG_BORDER,
                  dark="black", light="white")
    return out.getvalue()


def save_qr_png(url: str, path: Path) -> None:
    """Write the QR code for ``url`` as a PNG file.

    The image carries the fleet token, so it is written like the token file: mode
    0600, atomically (an existing file is replaced, never left half written).
    """
    from engine.files import write_private

    try:
        write_private(path, qr_png(url))
    except OSError as exc:
        raise PairingError(f"cannot write the QR image {path}: {exc.strerror}; "
                           "choose a writable path") from None


def read_qr_image(path: Path) -> str:
    """The Shoal join code in the QR image at ``path`` (PNG, JPEG...), decoded with zxing-cpp."""
    import zxingcpp
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            gray = image.convert("L")
    except FileNotFoundError:
        raise PairingError(f"there is no image at {path}; give the path of the saved "
                           "QR code (or the join URL itself)") from None
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError):
        raise PairingError(f"{path} is not an image Shoal can read (PNG or JPEG of a QR "
                           "code); save the QR code again") from None
    qr_only = zxingcpp.BarcodeFormats(zxingcpp.BarcodeFormat.QRCode)
    barcodes = zxingcpp.read_barcodes(gray, formats=qr_only)
    texts = list(dict.fromkeys(b.text for b in barcodes if b.text))
    codes = [t for t in texts if t.strip().lower().startswith(f"{SCHEME}://")]
    if not texts:
        raise PairingError(f"no QR code found in {path}; photograph or save it again, "
                           "sharper and whole")
    if not codes:
        raise PairingError(f"the QR code in {path} is not a Shoal join code; use the one "
                           "`shoal fleet pair` prints")
    if len(codes) > 1:
        raise PairingError(f"{path} holds several join codes; crop it to one")
    return codes[0].strip()


TEXT_CODE_MAX_BYTES = 4096  # a text file holding a join code; bigger ones are images


def join_code_from(spec: str) -> str:
    """The join URL that ``spec`` gives: the URL itself, or a file (``@PATH`` or a path)
    holding it as text or as a QR image. Reads files: call from a thread in asyncio code.
    """
    text = spec.strip()
    if text.lower().startswith(f"{SCHEME}://"):
        return text
    named = text.startswith("@")
    path = Path(text[1:] if named else text)
    if not path.is_file():
        if named:
            raise PairingError(f"there is no file at {path}; give the file holding the join "
                               "code (text or a QR image), or the code itself")
        return text  # not a file: parse_join_url says what it is not
    try:
        with path.open("rb") as f:
            head = f.read(TEXT_CODE_MAX_BYTES + 1)
    except OSError as exc:
        raise PairingError(f"cannot read {path}: {exc.strerror}; check its permissions") \
            from None
    if len(head) <= TEXT_CODE_MAX_BYTES:
        written = head.decode("utf-8", errors="replace").strip()
        if written.lower().startswith(f"{SCHEME}://"):
            return written
    return read_qr_image(path)
