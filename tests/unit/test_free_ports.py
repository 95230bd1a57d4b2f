"""`free_ports`: the ports `pdspark up` fixes for its services come from outside the kernel's ephemeral range, where
every `bind(port 0)` and outgoing connection of the machine draws (a two-node Ray test once lost a worker's picked port
that way before the worker bound it)."""

import socket

import pytest

from pdspark.launch import free_ports as fp


def _ephemeral() -> tuple[int, int]:
    low, high = (int(v) for v in fp._EPHEMERAL.read_text().split())
    return low, high


needs_linux_range = pytest.mark.skipif(not fp._EPHEMERAL.exists(), reason="no ip_local_port_range on this system")


@needs_linux_range
def test_ports_are_distinct_free_and_outside_the_ephemeral_range():
    low, high = _ephemeral()
    ports = fp.free_ports("127.0.0.1", 12)
    assert len(set(ports)) == 12
    assert all(fp._LOWEST <= p < low or high < p <= 65535 for p in ports)
    held = []
    try:
        for p in ports:  # each is free now: a listener can take it
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", p))
            s.listen()
    finally:
        for s in held:
            s.close()


@needs_linux_range
def test_consecutive_ports_form_one_run():
    first, *rest = fp.free_ports("127.0.0.1", 3, consecutive=True)
    assert rest == [first + 1, first + 2]


def test_without_a_readable_range_the_kernel_picks(monkeypatch, tmp_path):
    monkeypatch.setattr(fp, "_EPHEMERAL", tmp_path / "absent")
    assert fp.outside_ephemeral() == []
    ports = fp.free_ports("127.0.0.1", 4)
    assert len(set(ports)) == 4 and all(0 < p <= 65535 for p in ports)


def test_a_range_covering_every_port_leaves_the_kernel_to_pick(monkeypatch, tmp_path):
    wide = tmp_path / "range"
    wide.write_text("1024\t65535\n")
    monkeypatch.setattr(fp, "_EPHEMERAL", wide)
    assert fp.outside_ephemeral() == []
    first, second = fp.free_ports("127.0.0.1", 2, consecutive=True)
    assert second == first + 1


def test_candidates_stay_inside_the_ranges_with_room_for_the_run():
    ranges = [range(20000, 20004), range(61000, 61002)]
    seen = {fp._candidate(ranges, 3) for _ in range(400)}
    assert seen == {20000, 20001}  # 61000 has no 3-port run; 20002 would end past the range
    assert fp._candidate([range(20000, 20002)], 3) == 0


def test_a_held_port_is_never_returned(monkeypatch):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        taken = holder.getsockname()[1]
        monkeypatch.setattr(fp, "outside_ephemeral", lambda: [range(taken, taken + 1)])
        with pytest.raises(OSError, match="no 1 free ports"):
            fp.free_ports("127.0.0.1", 1)
    finally:
        holder.close()


def test_ports_promised_elsewhere_are_avoided(monkeypatch):
    """`pdspark up` picks the router's ports after the workers' (whose sockets are closed by then): `avoid` keeps
    the two sets apart."""
    monkeypatch.setattr(fp, "outside_ephemeral", lambda: [range(24000, 24003)])
    with pytest.raises(OSError, match="no 1 free ports"):
        fp.free_ports("127.0.0.1", 1, avoid=frozenset({24000, 24001, 24002}))
