"""The peer book forgets refusals that ran out, as connections come and go (no caller sweeps it)."""

from __future__ import annotations

import math

from node.net.peers import Opened, PeerBook


def test_a_new_connection_forgets_refusals_that_ran_out() -> None:
    book = PeerBook()
    assert book.connection_opened("p", now=0) is Opened.AUTHENTICATE
    assert book.auth_failed("p", book.epoch("p"), now=0, refuse_s=30, proven=True)
    book.connection_closed("p")
    assert book.connection_opened("q", now=10) is Opened.AUTHENTICATE
    assert book.refused_until("p") == 30  # still refused, disconnected: remembered
    assert book.connection_opened("p", now=20) is Opened.REFUSE
    book.connection_closed("p")
    assert book.connection_opened("r", now=31) is Opened.AUTHENTICATE
    assert book.refused_until("p") == -math.inf  # ran out: forgotten
    assert (book.connections("q"), book.connections("r")) == (1, 1)  # connected peers stay
    assert book.connection_opened("p", now=32) is Opened.AUTHENTICATE  # a fresh start
