"""tandemrl.api.net.free_port: ports bound later by another process come from outside the ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

from tandemrl.api import net


def test_ports_come_from_the_band_below_the_ephemeral_range() -> None:
    eph = net.ephemeral_range()
    assert eph is not None and eph[0] >= net.BAND[1], f"this test needs Linux's usual range, got {eph}"
    ports = [net.free_port("127.0.0.1") for _ in range(50)]
    assert all(net.BAND[0] <= p < net.BAND[1] for p in ports), ports
    assert len(set(ports)) > 40  # drawn at random, not one fixed number
    with socket.socket() as s:  # and free: bindable right away
        s.bind(("127.0.0.1", ports[0]))


def test_a_taken_port_is_never_handed_out(monkeypatch) -> None:
    """With the band narrowed to one port that is in use, the kernel's pick is the fallback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        monkeypatch.setattr(net, "BAND", (taken, taken + 1))
        monkeypatch.setattr(net, "ephemeral_range", lambda: (taken + 1, 65535))
        got = net.free_port("127.0.0.1")
        assert got != taken


def test_unreadable_or_low_ephemeral_range_falls_back_to_the_kernel(tmp_path: Path, monkeypatch) -> None:
    assert net.ephemeral_range(str(tmp_path / "missing")) is None
    (tmp_path / "range").write_text("1024\t65535\n")
    assert net.ephemeral_range(str(tmp_path / "range")) == (1024, 65535)
    monkeypatch.setattr(net, "ephemeral_range", lambda: (1024, 65535))  # no room below it: the kernel picks
    port = net.free_port("127.0.0.1")
    assert 1024 <= port <= 65535
