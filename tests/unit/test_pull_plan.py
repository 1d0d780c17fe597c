"""The pure decisions of a download (engine/models/pulls/plan.py): where it resumes, what a
response to a ranged request means, and how much disk is missing; and what a repository
file name may be before it names a path (engine/models/pulls/hub.py)."""

from __future__ import annotations

import pytest

from engine.models.pulls.hub import safe_name
from engine.models.pulls.plan import (
    MARGIN,
    Need,
    body_starts_at,
    disk_refusal,
    range_header,
    resume_offset,
    shortfall,
)

GB = 1 << 30
MB = 1 << 20


@pytest.mark.parametrize(
    ("part", "size", "offset"),
    [
        (0, 100, 0),  # nothing yet
        (40, 100, 40),  # goes on from what the part holds
        (100, 100, 100),  # whole: only the check is left
        (101, 100, 0),  # longer than the file: not a prefix of it, start over
        (-1, 100, 0),
    ],
)
def test_resume_offset(part: int, size: int, offset: int) -> None:
    assert resume_offset(part, size) == offset


def test_range_header_only_when_resuming() -> None:
    assert range_header(0) == {}
    assert range_header(512) == {"Range": "bytes=512-"}


@pytest.mark.parametrize(
    ("status", "content_range", "asked", "starts"),
    [
        (200, None, 0, 0),  # a whole file, as asked
        (200, None, 500, 0),  # the range ignored: the body is the whole file
        (206, "bytes 500-999/1000", 500, 500),  # the rest, as asked
        (206, "bytes 500-999/*", 500, 500),
        (206, "bytes 400-999/1000", 500, None),  # not where asked: cannot be appended
        (206, None, 500, None),
        (206, "items 500-999/1000", 500, None),
        (416, "bytes */1000", 500, None),
        (302, None, 0, None),
    ],
)
def test_body_starts_at(status: int, content_range: str | None, asked: int,
                        starts: int | None) -> None:
    assert body_starts_at(status, content_range, asked) == starts


@pytest.mark.parametrize(
    ("need", "free", "short"),
    [
        (0, 0, 0),  # nothing to fetch needs no room
        (GB, 2 * GB, 0),
        (GB, GB + MARGIN, 0),  # exactly the file and the margin
        (GB, GB + MARGIN - 1, 1),
        (GB, GB, MARGIN),  # the margin is kept free too
        (4 * GB, GB, 3 * GB + MARGIN),
    ],
)
def test_shortfall(need: int, free: int, short: int) -> None:
    assert shortfall(Need("/h", need, free)) == short


def test_disk_refusal_names_what_is_missing_and_where() -> None:
    line = disk_refusal("org/repo/m-Q4_K_M.gguf", [Need("/home/u/.shoal/downloads",
                                                        4 * GB, GB)], margin=0)
    assert line == ("pulling org/repo/m-Q4_K_M.gguf needs 4 GiB more and "
                    "/home/u/.shoal/downloads has 1 GiB free: free 3 GiB, or pick a "
                    "smaller quantisation")


def test_disk_refusal_checks_each_filesystem() -> None:
    roomy, tight = Need("/dl", GB, 10 * GB), Need("/models", 2 * GB, GB)
    assert disk_refusal("x", [roomy]) is None
    line = disk_refusal("x", [roomy, tight], margin=0)
    assert line is not None and "/models has 1 GiB free: free 1 GiB" in line


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("model-Q4_K_M.gguf", True),
        ("Q4_K_M/model-00001-of-00002.gguf", True),
        ("", False),
        ("/etc/passwd", False),
        ("../model.gguf", False),
        ("a/../../model.gguf", False),
        ("a//b.gguf", False),
        ("./m.gguf", False),
        ("a\\b.gguf", False),
        ("m\x00.gguf", False),
    ],
)
def test_a_repository_name_stays_inside_its_folder(name: str, ok: bool) -> None:
    assert safe_name(name) is ok
