"""How a pull reads to people: amounts, durations and the progress of a download."""

from __future__ import annotations

from engine.sizes import amount


def duration(s: float) -> str:
    """``45 s``, ``1 min 20 s``, ``2 h 5 min``: a time left, rounded up to the second."""
    total = max(0, int(-(-s // 1)))
    hours, rest = divmod(total, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {seconds} s"
    return f"{seconds} s"


def pace(rate_bps: float, eta_s: float | None) -> list[str]:
    """``["12 MiB/s", "1 min 20 s left"]``: what is known of a download's pace."""
    parts = [f"{amount(rate_bps)}/s"] if rate_bps > 0 else []
    if eta_s is not None:
        parts.append(f"{duration(eta_s)} left")
    return parts


def progress(done: int, total: int, rate_bps: float = 0.0, eta_s: float | None = None) -> str:
    """``40% of 1.2 GiB, 12 MiB/s, 1 min 20 s left``; what is known of it."""
    head = f"{100 * done // total}% of {amount(total)}" if total > 0 else amount(done)
    return ", ".join([head, *pace(rate_bps, eta_s)])
