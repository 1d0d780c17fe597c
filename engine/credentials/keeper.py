"""`FleetCredentials`: the one keeper of this machine's fleet token and the fleet's name
while Shoal runs. Shoal hands the token to the roles that speak on the fleet's links when
it changes; everything else (the snapshot, pairing codes, the events) reads both here.
Keychain and file work runs off the event loop."""

from __future__ import annotations

import asyncio
import logging
import secrets
from pathlib import Path

from engine.credentials import codes, tokens
from engine.credentials.codes import JoinCode
from engine.credentials.fleet_name import load_fleet_name, save_fleet_name
from engine.errors import CommandError, JoinError, ShoalError, StartError

log = logging.getLogger("shoal")


def new_token() -> bytes:
    return secrets.token_bytes(tokens.TOKEN_BYTES)


async def read_join_code(code: str) -> JoinCode:
    """A join URL, or the path of an image of its QR code (read off the loop); JoinError
    (one line, never the code's text: it holds the token) when it is neither."""
    text = code.strip()
    try:
        if not text.lower().startswith(f"{codes.SCHEME}://"):
            text = await asyncio.to_thread(_read_image, text)
        return codes.parse_join_url(text)
    except codes.PairingError as exc:
        raise JoinError(str(exc), code="bad_join_code") from None


def _read_image(path: str) -> str:
    return codes.read_qr_image(Path(path).expanduser())


class FleetCredentials:
    """The token (None: this machine is in no fleet yet) and the fleet's name for people,
    kept in ``home`` (the token in the OS keychain or ``fleet/token``, the name in
    ``fleet/name``); ``auth_file``: a token file the user named, read instead."""

    def __init__(self, home: Path, *, auth_file: Path | None = None) -> None:
        self._home = home
        self._auth_file = auth_file
        self._token: bytes | None = None
        self._name: str | None = None

    @property
    def token(self) -> bytes | None:
        return self._token

    @property
    def name(self) -> str | None:
        return self._name

    async def load(self, code: JoinCode | None, *, home: Path, auth_file: Path | None,
                   fallback_name: str | None) -> None:
        """At start, from the settings of that start (``home``, ``auth_file``): the token
        and name of a join code (kept only once a head has taken the token: `keep`), else
        those kept here; ``fallback_name`` stands in until a name is kept. StartError (one
        line) for a token that cannot be read."""
        self._home, self._auth_file = home, auth_file
        self._token = self._name = None
        if code is not None:
            self._token, self._name = code.token, code.fleet
        else:
            self._token = await self._read()
        if self._name is None:
            self._name = await asyncio.to_thread(load_fleet_name, self._home) or fallback_name

    async def keep(self) -> None:
        """Store the token in use (and its name) where this machine keeps them."""
        await self._store(self._token, self._name)

    async def replace(self, token: bytes | None, name: str | None) -> bool:
        """Keep and use ``token`` (and ``name``, when given); True when the token changed,
        so the roles must be handed the new one."""
        changed = token != self._token
        await self._store(token, name)
        self._token = token
        return changed

    async def rename(self, name: str) -> None:
        self._name = name
        await asyncio.to_thread(save_fleet_name, self._home, name)

    async def forget(self) -> list[str]:
        """Remove the token from wherever it is kept; the places it was removed from."""
        places = await asyncio.to_thread(tokens.forget_token, self._home)
        self._token = None
        return places

    async def join_code(self, head: str, default_name: str) -> tuple[str, str, bytes, str]:
        """This fleet's join URL pointing at ``head`` (HOST:PORT), the fleet's name in it
        (``default_name`` when it has none), and its QR code as PNG bytes and as text."""
        if self._token is None:
            raise CommandError("this machine has no fleet token yet; start a fleet here "
                               "first (Start a fleet here, or `shoal fleet token`)",
                               code="no_token")
        name = self._name or default_name
        try:
            url = codes.join_url(head, self._token, name)
        except codes.PairingError as exc:
            raise CommandError(str(exc), code="bad_pairing") from None
        png = await asyncio.to_thread(codes.qr_png, url)
        return url, name, png, codes.qr_text(url)

    async def move(self, to: tokens.Place) -> str:
        """Keep the token in the OS keychain or in the token file; one line says where."""
        try:
            return await asyncio.to_thread(tokens.move_token, self._home, to)
        except tokens.TokenError as exc:
            raise CommandError(str(exc), code="bad_token") from None

    async def _read(self) -> bytes | None:
        path = self._auth_file
        try:
            if path is not None:
                return await asyncio.to_thread(tokens.read_token, path)
            return await asyncio.to_thread(tokens.load_fleet_token, self._home)
        except tokens.TokenError as exc:
            raise StartError(str(exc), code="bad_token") from None

    async def _store(self, token: bytes | None, name: str | None) -> None:
        if token is None:
            return
        try:
            where = await asyncio.to_thread(tokens.store_fleet_token, self._home, token, "auto")
        except tokens.TokenError as exc:
            raise ShoalError(str(exc), code="bad_token") from None
        if name:
            await self.rename(name)
        log.info("stored the fleet token of '%s' in %s", name or "this fleet", where)
