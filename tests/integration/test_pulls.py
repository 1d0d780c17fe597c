"""Pulls a user can trust, against a local hub (tests/fakehub.py) on 127.0.0.1 serving the
real SmolLM2 GGUF under a catalog-like id: progress with a rate and a time left, a
download cut half way and resumed with a Range (in the same pull, by the next pull, and
after a restart), bytes that do not match the hub's sha256 refused, a disk too small
refused before the first byte, a cancel that leaves nothing, two pulls of one file
sharing one download, and --offline finding what was pulled."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from engine.events import PullProgress, ShoalEvent
from engine.models import cache as model_cache
from engine.models import errors as model_errors
from engine.models import ids, loading
from engine.models.pulls import disk, shared, transfer
from engine.models.pulls.cache import blob_path
from engine.models.pulls.plan import MARGIN
from engine.sizes import amount
from tests.e2e.conftest import smollm2_gguf  # noqa: F401  # the real GGUF, cached per machine
from tests.fakehub import CHUNK, COMMIT, FakeHub, pointed_at, serving
from tests.waiting import until

REPO = "bartowski/SmolLM2-135M-Instruct-GGUF"
FILE = "SmolLM2-135M-Instruct-Q4_K_M.gguf"
SPEC = f"{REPO}:Q4_K_M"
TIMEOUT_S = 60.0


@pytest.fixture
def gguf(smollm2_gguf: Path) -> Path:  # noqa: F811
    return smollm2_gguf


@pytest.fixture
def sha(gguf: Path) -> str:
    return _sha256(gguf)


@pytest.fixture
def held(gguf: Path) -> FakeHub:
    """A hub that holds each download a quarter of the way, until the test releases it."""
    return hub_for(gguf, hold_after=gguf.stat().st_size // 4)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hub_for(gguf: Path, **kw: object) -> FakeHub:
    # a second GGUF in the repository, so the quantisation is what chooses
    return FakeHub(repos={REPO: {FILE: gguf, "SmolLM2-135M-Instruct-Q8_0.gguf": gguf}},
                   **kw)  # type: ignore[arg-type]


async def pull(home: Path, *, cancel: model_errors.CancelFlag | None = None,
               seen: list[tuple[str, int, int]] | None = None) -> Path:
    def progress(line: str, done: int, total: int) -> None:
        if seen is not None:
            seen.append((line, done, total))

    async with asyncio.timeout(TIMEOUT_S):
        return await asyncio.to_thread(model_cache.resolve_model, SPEC, home=home, offline=False,
                                       progress=progress, cancel=cancel)


def key_of(home: Path, sha: str) -> str:
    """What the shared registry keys a download by: the blob it fills in that home."""
    return str(blob_path(ids.models_dir(home) / "hub", REPO, sha))


async def two_pulls(home: Path, hub: FakeHub, sha: str, *,
                    cancel: model_errors.CancelFlag | None = None,
                    seen: tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]] = ([], []),
                    ) -> tuple[asyncio.Task[Path], asyncio.Task[Path]]:
    """A pull the hub holds part-way (``cancel`` is its flag), and a second of the same
    file that waits on its download."""
    a = asyncio.create_task(pull(home, cancel=cancel, seen=seen[0]))
    await asyncio.wait_for(hub.held.wait(), TIMEOUT_S)
    b = asyncio.create_task(pull(home, seen=seen[1]))
    await until(lambda: shared.REGISTRY.callers(key_of(home, sha)) == 2,
                "the second pull waiting")
    return a, b


def part_of(home: Path, sha: str) -> Path:
    return home / "downloads" / f"{sha}.part"


def files_under(folder: Path) -> list[Path]:
    """Every file and link under ``folder`` (a dangling link counts too)."""
    if not folder.exists():
        return []
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink())


async def assert_installed(home: Path, path: Path, sha: str) -> None:
    repo_dir = home / "models" / "hub" / ("models--" + REPO.replace("/", "--"))
    assert path == repo_dir / "snapshots" / COMMIT / FILE
    assert path.is_symlink() and path.resolve() == repo_dir / "blobs" / sha
    assert (repo_dir / "refs" / "main").read_text() == COMMIT
    assert await asyncio.to_thread(_sha256, path) == sha  # off the loop: 100 MiB
    assert not part_of(home, sha).exists()


async def test_a_pull_reports_bytes_rate_and_time_left(
        tmp_path: Path, gguf: Path, sha: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the roles' loader, as the app, the tray and the CLI see it."""
    size = gguf.stat().st_size
    # slow enough for a rate to be measured (about two seconds for the whole file)
    hub = hub_for(gguf, rate_bps=size // 2)
    events: list[ShoalEvent] = []
    pulls = loading.Pulls()
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url):
            async with asyncio.timeout(TIMEOUT_S):
                got = await loading.resolve(SPEC, "llamacpp", home=tmp_path, offline=False,
                                            emit=events.append, pulls=pulls)
    await assert_installed(tmp_path, Path(got.path), sha)
    reports = [e for e in events if isinstance(e, PullProgress)]
    running = [e for e in reports if e.state == "running"]
    assert running and all(e.model == SPEC and e.total_bytes == size for e in running)
    done = [e.done_bytes for e in running]
    assert done == sorted(done) and done[-1] == size  # forward only, up to the total
    assert any(e.message == f"pulling {REPO}/{FILE} ({amount(size)})" for e in running)
    measured = [e for e in running if e.rate_bps > 0 and e.eta_s is not None and e.eta_s > 0]
    assert measured, "no report with a rate and a time left"
    assert all(0 < e.rate_bps < size for e in measured)  # the hub sends size / 2 a second
    assert reports[-1].state == "done" and not pulls.running
    assert hub.gets == 1 and hub.sent == size


async def test_a_stalled_download_shows_every_byte_that_came_and_its_rate_falling(
        tmp_path: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bytes that came just before a stall are shown while it lasts: reports are sent a
    few a second, and the last block before the stall is not dropped for having come too
    soon after the one before it (the app once showed 0 B of a download held after its
    first quarter of a megabyte). While nothing comes, the rate shown falls."""
    hub = hub_for(gguf, hold_after=CHUNK)  # the first block, then nothing until released
    events: list[ShoalEvent] = []
    pulls = loading.Pulls()
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url):
            task = asyncio.create_task(loading.resolve(
                SPEC, "llamacpp", home=tmp_path, offline=False, emit=events.append,
                pulls=pulls))
            try:
                await until(hub.held.is_set, "the hub holding the download")
                assert hub.sent == CHUNK
                await until(lambda: SPEC in pulls.running
                            and pulls.running[SPEC].done_bytes == CHUNK,
                            "the bytes before the stall shown")
                await until(lambda: pulls.running[SPEC].rate_bps > 0, "a rate measured")
                rate = pulls.running[SPEC].rate_bps
                await until(lambda: 0 < pulls.running[SPEC].rate_bps < rate,
                            "the rate falling while nothing comes")
                assert pulls.running[SPEC].done_bytes == CHUNK  # nothing more came
            finally:
                hub.release.set()
                await asyncio.wait([task], timeout=TIMEOUT_S)
                task.cancel()  # only where it is still running: the test failed then
            await task
    running = [e.done_bytes for e in events
               if isinstance(e, PullProgress) and e.state == "running"]
    assert running == sorted(running) and running[-1] == gguf.stat().st_size


async def test_a_download_cut_half_way_goes_on_from_there_in_the_same_pull(
        tmp_path: Path, gguf: Path, sha: str, monkeypatch: pytest.MonkeyPatch) -> None:
    size = gguf.stat().st_size
    hub = hub_for(gguf, cut_after=size // 2, cuts=1)
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url):
            path = await pull(tmp_path)
    await assert_installed(tmp_path, path, sha)
    assert hub.starts == [0, size // 2]  # the second GET asked for the rest only
    assert hub.sent == size  # nothing fetched twice


async def test_an_interrupted_pull_is_resumed_by_the_next_one_after_a_restart(
        tmp_path: Path, gguf: Path, sha: str, monkeypatch: pytest.MonkeyPatch) -> None:
    size = gguf.stat().st_size
    monkeypatch.setattr(transfer, "ATTEMPTS", 1)  # no retry within the pull: it fails
    hub = hub_for(gguf, cut_after=size // 2, cuts=1)
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url):
            with pytest.raises(model_errors.ModelMissing) as failed:
                await pull(tmp_path)
            line = str(failed.value)
            assert line.startswith(f"the download of {REPO}/{FILE} stopped at ")
            assert line.endswith("; run again to resume from there") and "\n" not in line
            part = part_of(tmp_path, sha)
            held = part.stat().st_size
            assert 0 < held <= size // 2
            assert files_under(tmp_path / "models") == []  # nothing half-pulled there
            # a restart: a new registry of downloads, the part on disk, and only the bytes
            # still to fetch need room (a mocked free-space figure just above them)
            monkeypatch.setattr(shared, "REGISTRY", shared.Shared())
            monkeypatch.setattr(disk, "free_bytes", lambda _p: size - held + MARGIN + 1)
            sent_before = hub.sent
            seen: list[tuple[str, int, int]] = []
            path = await pull(tmp_path, seen=seen)
    await assert_installed(tmp_path, path, sha)
    assert hub.starts == [0, held]  # the second GET asked for the rest (Range: bytes=N-)
    assert hub.sent - sent_before == size - held
    assert (f"resuming {REPO}/{FILE} at {amount(held)} of {amount(size)}", held, size) in seen


async def test_bytes_that_do_not_match_the_hub_sha256_are_refused_and_removed(
        tmp_path: Path, gguf: Path, sha: str, monkeypatch: pytest.MonkeyPatch) -> None:
    size = gguf.stat().st_size
    hub = hub_for(gguf, corrupt=True)
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url), pytest.raises(model_errors.ModelMissing) as refused:
            await pull(tmp_path)
    line = str(refused.value)
    assert line.startswith(f"{REPO}/{FILE} came out with sha256 ")
    assert f"the hub says {sha[:12]}…; the download is corrupt, run again" in line
    assert hub.sent == size  # it was all downloaded, then refused
    assert not part_of(tmp_path, sha).exists()
    assert files_under(tmp_path / "models") == []
    assert [p for p in files_under(tmp_path / "downloads") if p.suffix == ".part"] == []


async def test_a_disk_too_small_is_refused_before_any_byte(
        tmp_path: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = gguf.stat().st_size
    free = 10 << 20
    # a mocked free-space figure: 10 MiB free wherever the pull would write
    monkeypatch.setattr(disk, "free_bytes", lambda _p: free)
    hub = hub_for(gguf)
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url), pytest.raises(model_errors.ModelMissing) as refused:
            await pull(tmp_path)
    assert str(refused.value) == (
        f"pulling {REPO}/{FILE} needs {amount(size + MARGIN)} more and "
        f"{tmp_path / 'downloads'} has {amount(free)} free: free "
        f"{amount(size + MARGIN - free)}, or pick a smaller quantisation")
    assert hub.infos == 1 and hub.gets == 0 and hub.sent == 0  # no GET of the file
    assert files_under(tmp_path / "models") == [] and files_under(tmp_path / "downloads") == []


async def cancelled_half_way(tmp_path: Path, hub: FakeHub, sha: str, *,
                             keep_part: bool) -> None:
    """A pull that ``hub`` holds half-way, cancelled once its part is being written
    (``keep_part``: as Shoal.stop cancels a fleet-chosen pull)."""
    cancel = model_errors.CancelFlag()
    task = asyncio.create_task(pull(tmp_path, cancel=cancel))
    await asyncio.wait_for(hub.held.wait(), TIMEOUT_S)
    await until(lambda: part_of(tmp_path, sha).exists(), "the part being written")
    cancel.set(keep_part=keep_part)
    hub.release.set()
    with pytest.raises(model_errors.PullCancelled):
        await task


async def test_cancel_leaves_neither_a_part_nor_anything_in_the_model_folder(
        tmp_path: Path, held: FakeHub, sha: str, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = held
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url):
            await cancelled_half_way(tmp_path, hub, sha, keep_part=False)
    assert not part_of(tmp_path, sha).exists()
    assert files_under(tmp_path / "models") == []
    assert [p for p in files_under(tmp_path / "downloads") if p.suffix == ".part"] == []
    assert hub.gets == 1 and shared.REGISTRY.callers(key_of(tmp_path, sha)) == 0


async def test_a_pull_stopped_by_quitting_keeps_its_part_and_the_next_start_resumes(
        tmp_path: Path, held: FakeHub, sha: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet-chosen download stops when Shoal quits; the next start goes on from it
    rather than fetching again what came (the user's own cancel keeps nothing: above)."""
    hub = held
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url):
            await cancelled_half_way(tmp_path, hub, sha, keep_part=True)
            kept = part_of(tmp_path, sha).stat().st_size
            assert kept > 0
            assert files_under(tmp_path / "models") == []  # nothing half-pulled there
            monkeypatch.setattr(shared, "REGISTRY", shared.Shared())  # a restart
            path = await pull(tmp_path)
    await assert_installed(tmp_path, path, sha)
    assert hub.starts == [0, kept]  # the next start asked for the rest (Range: bytes=N-)


async def test_two_pulls_of_one_file_share_one_download(
        tmp_path: Path, held: FakeHub, sha: str, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = held
    first: list[tuple[str, int, int]] = []
    second: list[tuple[str, int, int]] = []
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url):
            a, b = await two_pulls(tmp_path, hub, sha, seen=(first, second))
            hub.release.set()
            paths = await asyncio.gather(a, b)
    assert paths[0] == paths[1]
    await assert_installed(tmp_path, paths[0], sha)
    assert hub.gets == 1 and hub.sent == paths[0].stat().st_size  # one download for both
    for seen in (first, second):  # both heard the same transfer, up to the whole file
        assert max(done for _, done, _ in seen) == hub.sent


async def test_one_of_two_pulls_cancelled_leaves_the_other_its_download(
        tmp_path: Path, held: FakeHub, sha: str, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = held
    cancel = model_errors.CancelFlag()
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url):
            a, b = await two_pulls(tmp_path, hub, sha, cancel=cancel)
            cancel.set()
            with pytest.raises(model_errors.PullCancelled):
                await a  # at once, while the download is still held
            assert not b.done() and shared.REGISTRY.callers(key_of(tmp_path, sha)) == 1
            hub.release.set()
            path = await b
    await assert_installed(tmp_path, path, sha)
    assert hub.gets == 1 and hub.sent == path.stat().st_size


async def test_offline_finds_the_pulled_model(
        tmp_path: Path, gguf: Path, sha: str, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = hub_for(gguf)
    async with serving(hub):
        with pointed_at(monkeypatch, hub.url):
            path = await pull(tmp_path)
            again = await pull(tmp_path)  # in the cache: asked about, not downloaded again
    assert again == path and hub.gets == 1 and hub.infos == 2
    # the hub is gone: --offline reads the cache alone
    found = await asyncio.to_thread(model_cache.resolve_model, SPEC, home=tmp_path, offline=True)
    assert found == path and await asyncio.to_thread(_sha256, found) == sha
    with pytest.raises(model_errors.ModelMissing, match="not in the cache"):
        await asyncio.to_thread(model_cache.resolve_model, f"{REPO}:Q2_K", home=tmp_path,
                                offline=True)
